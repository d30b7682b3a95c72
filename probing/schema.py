"""A table's columns from the dataclass of its rows (analyze.*, trace.probes).

A row's dataclass is its schema (a finding's, a uprobe's): each field a column of the Arrow type
its annotation names (``int`` int64, ``float`` float64, ``str`` string,
``bool`` bool, ``list[X]`` a list of X, ``X | None`` X, nullable), so the
JSON of ``probing diagnose`` (``dataclasses.asdict``) and the SQL tables
never disagree on a field. Two spellings are the tables' own: a
``since`` (ISO text) column is ``since_utc`` beside ``since_ns``, and a
``dict`` field (a hang's stacks by rank) is its JSON text.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from typing import Any

import pyarrow as pa

RENAMED = {"since": "since_utc"}  # beside since_ns: which clock the text is
SCALARS: dict[Any, pa.DataType] = {
    int: pa.int64(), float: pa.float64(), str: pa.string(), bool: pa.bool_()
}  # fmt: skip


def arrow_type(hint: Any) -> pa.DataType:
    """The Arrow type of one field's (resolved) annotation."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        [inner] = [a for a in typing.get_args(hint) if a is not type(None)]
        return arrow_type(inner)
    if origin is list:
        return pa.list_(arrow_type(typing.get_args(hint)[0]))
    if origin is dict:
        return pa.string()  # its JSON text
    if hint in SCALARS:
        return SCALARS[hint]
    raise TypeError(f"no Arrow column for a field of type {hint!r}")


@functools.cache
def schema_of(cls: type) -> pa.Schema:
    """The table of ``cls``'s instances: a column per field, in field order
    (worked out once per class: every analyze.* query asks for it)."""
    hints = typing.get_type_hints(cls)
    return pa.schema(
        [(RENAMED.get(f.name, f.name), arrow_type(hints[f.name])) for f in dataclasses.fields(cls)]
    )


def row_of(finding: Any) -> dict[str, Any]:
    """``finding`` as a row of ``schema_of(type(finding))``."""
    row = {}
    for key, value in dataclasses.asdict(finding).items():
        if isinstance(value, dict):
            value = json.dumps({str(k): v for k, v in value.items()})
        row[RENAMED.get(key, key)] = value
    return row


def table_of(cls: type, findings: list[Any]) -> pa.Table:
    """The table of ``findings`` (instances of ``cls``; none: no rows, the columns)."""
    return pa.Table.from_pylist([row_of(f) for f in findings], schema=schema_of(cls))
