"""``probing.ExternalTable`` in a job: rows the user's code writes, kept in
the guest until the engine takes them (stdlib only: no pyarrow needed).

The engine takes everything appended so far before each query that reads
``python.*`` (``take``) and stores it like any other table. At most
``MAX_ROWS`` rows wait per table; more are counted as dropped.
"""

from __future__ import annotations

import threading

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence
    from typing import Any

MAX_ROWS = 1 << 20
_boxes: dict[str, dict[str, Any]] = {}
_lock = threading.Lock()


def spec(columns: Any) -> tuple[list[str], list[str] | None]:
    """Column names, and type names where given: names, ``(name, type)``
    pairs, or a schema (anything with ``names`` and ``types``)."""
    if hasattr(columns, "names") and hasattr(columns, "types"):
        return [str(n) for n in columns.names], [str(t) for t in columns.types]
    cols = list(columns)
    if not cols:
        raise ValueError("an ExternalTable needs at least one column")
    if all(isinstance(c, str) for c in cols):
        names, types = list(cols), None
    elif all(isinstance(c, tuple) and len(c) == 2 for c in cols):
        names, types = [str(n) for n, _ in cols], [str(t) for _, t in cols]
    else:
        raise TypeError("columns are names, (name, pyarrow type) pairs, or a pyarrow.Schema")
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate column names in {names}")
    return names, types


class Table:
    """A table your code appends rows to, queryable as ``python.<name>``."""

    def __init__(self, name: str, columns: Any, **_: Any) -> None:
        if not name or not isinstance(name, str):
            raise ValueError("an ExternalTable needs a name")
        self.name = name
        self.columns, types = spec(columns)
        with _lock:
            box = _boxes.get(name)
            if box is None:
                _boxes[name] = {"columns": self.columns, "types": types, "rows": [],
                                "dropped": 0, "appended": 0}  # fmt: skip
            elif box["columns"] != self.columns:
                raise ValueError(
                    f"python.{name} already exists with columns {box['columns']}, "
                    f"not {self.columns}"
                )

    def __len__(self) -> int:
        with _lock:
            return int(_boxes[self.name]["appended"])

    def append(self, row: Sequence[Any] | Mapping[str, Any]) -> None:
        """Append one row: a sequence in column order, or a mapping by column name."""
        self.append_many([row])

    def append_many(self, rows: Iterable[Sequence[Any] | Mapping[str, Any]]) -> None:
        values = [self._values(r) for r in rows]
        with _lock:
            box = _boxes[self.name]
            room = MAX_ROWS - len(box["rows"])
            box["rows"].extend(values[: max(room, 0)])
            box["dropped"] += max(len(values) - max(room, 0), 0)
            box["appended"] += len(values)

    def flush(self) -> None:
        """Nothing to do: the engine takes the rows at its next query."""

    def _values(self, row: Any) -> list[Any]:
        return row_values(self.name, self.columns, row)


def row_values(name: str, columns: list[str], row: Any) -> list[Any]:
    """One row's values in column order: a sequence in that order, or a
    mapping by column name (``probing.ExternalTable.append``'s two forms)."""
    if isinstance(row, dict) or (hasattr(row, "keys") and hasattr(row, "get")):
        unknown = set(row) - set(columns)
        if unknown:
            raise ValueError(f"python.{name} has no column(s) {sorted(unknown)}")
        return [row.get(c) for c in columns]
    values = list(row)
    if len(values) != len(columns):
        raise ValueError(
            f"python.{name} has {len(columns)} columns {columns}, got a row of {len(values)}"
        )
    return values


def take() -> dict[str, dict[str, Any]]:
    """Every table's columns, types and the rows appended since the last take."""
    from .inside import plain

    with _lock:
        out = {}
        for name, box in _boxes.items():
            out[name] = {"columns": box["columns"], "types": box["types"],
                         "rows": box["rows"], "dropped": box["dropped"]}  # fmt: skip
            box["rows"], box["dropped"] = [], 0
    for box in out.values():
        box["rows"] = [[plain(v) for v in r] for r in box["rows"]]
    return out
