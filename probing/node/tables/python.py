"""``python.`expr```: evaluate an expression in the process, get a table.

The process evaluates it (``probing.guest.inside.expr``: columns of plain
values, through the host's own pandas, numpy or pyarrow where the value is
theirs); here they become an Arrow table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa

from probing.errors import ProbingError, QueryError


def to_arrow(columns: dict[str, list[Any]]) -> pa.Table:
    """Plain columns (name -> values) as a table; a column Arrow cannot
    type is its values' ``repr``."""
    if not columns:
        return pa.table({"value": pa.array([], pa.null())})
    return pa.table({k: _column(v) for k, v in columns.items()})


def _column(values: list[Any]) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        return pa.array([None if v is None else repr(v) for v in values], type=pa.string())


def resolver(
    expr_of: Callable[[str], dict[str, list[Any]]],
    pull: Callable[[], None] = lambda: None,
    store: Any = None,
) -> Callable[[str], pa.Table]:
    """``python.<name>`` not stored yet: an ExternalTable the process wrote
    since the last query (``pull`` takes them into ``store``), else
    ``python.`expr``` over the target's ``expr`` (``probing.target``)."""

    def evaluate(expr: str) -> pa.Table:
        pull()
        stored = store.get("python", expr) if store is not None else None
        if stored is not None:
            return stored.to_arrow()
        try:
            return to_arrow(expr_of(expr))
        except QueryError:
            raise
        except ProbingError as err:
            raise QueryError(f"python.`{expr}`: {err}") from err

    return evaluate
