"""``python.`expr```: evaluate an expression in the process, get a table."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from probing.errors import QueryError

_MAX_AUTO_IMPORTS = 8


def to_arrow(value: Any) -> pa.Table:
    """Turn what an expression returned into a table.

    A scalar is one row with a ``value`` column; a dict is one row (or
    columns, when every value is a list of one length); a list of dicts is
    rows; a list of scalars is a ``value`` column; pandas DataFrames, Arrow
    tables and record batches pass through.
    """
    if isinstance(value, pa.Table):
        return value
    if isinstance(value, pa.RecordBatch):
        return pa.Table.from_batches([value])
    if type(value).__name__ == "DataFrame" and hasattr(value, "to_dict"):
        return pa.Table.from_pandas(value, preserve_index=False)
    if isinstance(value, Mapping):
        cols = {str(k): v for k, v in value.items()}
        lists = [v for v in cols.values() if isinstance(v, list | tuple)]
        if cols and len(lists) == len(cols) and len({len(v) for v in lists}) == 1:
            return pa.table({k: _column(list(v)) for k, v in cols.items()})
        return pa.table({k: _column([v]) for k, v in cols.items()})
    if isinstance(value, list | tuple | set | frozenset) or _is_ndarray(value):
        items = list(value)
        if items and all(isinstance(i, Mapping) for i in items):
            return pa.Table.from_pylist([{str(k): v for k, v in i.items()} for i in items])
        return pa.table({"value": _column(items)})
    return pa.table({"value": _column([value])})


def _is_ndarray(value: Any) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "tolist")


def _column(values: list[Any]) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        return pa.array([None if v is None else repr(v) for v in values], type=pa.string())


def eval_with_imports(expr: str) -> Any:
    """Evaluate ``expr`` in a copy of ``__main__``'s namespace; import modules it names.

    ``time.time()`` works without ``import time`` in the target: a NameError
    for an importable top-level module imports it and tries again.
    """
    main = sys.modules.get("__main__")
    namespace: dict[str, Any] = dict(vars(main)) if main is not None else {}
    namespace.setdefault("__builtins__", __builtins__)
    for _ in range(_MAX_AUTO_IMPORTS):
        try:
            return eval(expr, namespace)  # noqa: S307 - local socket only
        except NameError as err:
            name = getattr(err, "name", None)
            if not name or name in namespace:
                raise
            try:
                namespace[name] = importlib.import_module(name)
            except ImportError:
                raise err from None
    raise NameError("too many names to import")


def evaluate(expr: str) -> pa.Table:
    """``python.`expr```: the value of ``expr`` as a table."""
    try:
        return to_arrow(eval_with_imports(expr))
    except QueryError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's expression may raise anything: the answer
        raise QueryError(f"python.`{expr}`: {type(err).__name__}: {err}") from err
