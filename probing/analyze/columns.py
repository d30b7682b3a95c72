"""Arrow columns as numpy, and rows told apart by hashing instead of sorting.

The collective matching (``collectives.matched``) and the Perfetto export
(``probing.cli.export.timeline``) work a million rows at a time, column by
column. Both number the distinct values of a column, or of a few columns
together, with ``codes``: Arrow's hash-based dictionary encoding numbers
them in the order they first appear, several times faster than
``np.unique``'s sort, and ``firsts`` then finds each one's first row with
one pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def column(table: pa.Table, name: str, kind: pa.DataType | None = None) -> pa.Array:
    """A column as one array: all null, of ``kind`` (int64 if not given), where
    the table has none or only an untyped one (a column of NULLs)."""
    if name not in table.column_names or pa.types.is_null(table.column(name).type):
        return pa.nulls(table.num_rows, kind or pa.int64())
    return table.column(name).combine_chunks()


def ints(values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """An integer column as int64 (null: 0) and where it is not null."""
    if values.null_count == 0:
        out = values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        return out, np.ones(len(values), dtype=bool)
    valid = values.is_valid().to_numpy(zero_copy_only=False)
    out = values.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    return out, valid


def codes(values: pa.Array | np.ndarray) -> tuple[np.ndarray, list[Any]]:
    """Each value's code, numbered in the order values first appear (None is a
    value of its own), and the values so numbered."""
    if isinstance(values, pa.Array) and pa.types.is_dictionary(values.type):
        # already encoded (nulls in its indices): its indices numbered anew
        numbers, index = codes(values.indices)
        words = values.dictionary.to_pylist()
        return numbers, [None if i is None else words[i] for i in index]
    enc = pc.dictionary_encode(values, null_encoding="encode")
    if isinstance(enc, pa.ChunkedArray):
        enc = enc.combine_chunks()
    numbers = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    return numbers, enc.dictionary.to_pylist()


def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Codes of the pairs of two codes (numbered as ``codes``)."""
    return codes(a * (int(b.max()) + 1) + b)[0] if len(a) else a


def per(numbers: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For each code, the value of its rows (the same in each)."""
    out = np.zeros(int(numbers.max()) + 1 if len(numbers) else 0, dtype=values.dtype)
    out[numbers] = values
    return out


def firsts(numbers: np.ndarray) -> np.ndarray:
    """Where each code first appears (codes numbered as ``codes``: a new one
    exceeds all before it)."""
    before = np.maximum.accumulate(numbers)
    return np.flatnonzero(numbers > np.r_[-1, before[:-1]])


def distinct(table: pa.Table, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's combination of the columns ``names`` (absent: None), numbered in
    the order they first appear, and the first row of each."""
    code = np.zeros(table.num_rows, dtype=np.int64)
    for name in names:
        code = pair(code, codes(column(table, name))[0])
    return code, firsts(code)
