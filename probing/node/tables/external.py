"""``probing.ExternalTable``: tables the user's own code writes to."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import pyarrow as pa

from probing.guest.outbox import row_values, spec
from probing.node.store import EventTable, Store

SCHEMA = "python"
FLUSH_ROWS = 4096

ColumnSpec: TypeAlias = Sequence[str] | Sequence[tuple[str, pa.DataType]] | pa.Schema


def _parse_columns(columns: ColumnSpec) -> tuple[list[str], pa.Schema | None]:
    names, types = spec(columns)  # checked as the guest's tables check them
    if isinstance(columns, pa.Schema):
        return names, columns
    return names, None if types is None else pa.schema(list(columns))


class ExternalTable:
    """A table your code appends rows to, queryable as ``python.<name>``.

    >>> import probing
    >>> t = probing.ExternalTable("doctest_loss", ["step", "loss"])
    >>> t.append([1, 0.5]); t.append({"step": 2, "loss": 0.25})
    >>> t.append_many([[3, 0.125], [4, 0.0625]])
    >>> len(t)
    4

    Rows are buffered and handed to the store in batches, where they are
    sealed and compressed like every other table. Column types are taken
    from the first rows unless given as ``(name, pyarrow type)`` pairs.
    ``probing.ExternalTable`` writes to this process's probe; this class
    writes to the ``store`` it is given.
    """

    def __init__(self, name: str, columns: ColumnSpec, *, store: Store) -> None:
        if not name or not isinstance(name, str):
            raise ValueError("an ExternalTable needs a name")
        self.name = name
        self.columns, schema = _parse_columns(columns)
        self._table: EventTable = store.table(SCHEMA, name, schema)
        if self._table.column_names is None:
            self._table.column_names = list(self.columns)
        existing = self._table.schema
        if existing is not None and list(existing.names) != self.columns:
            raise ValueError(
                f"python.{name} already exists with columns {existing.names}, not {self.columns}"
            )
        self._buf: list[list[Any]] = [[] for _ in self.columns]
        self._buf_since = 0.0
        self._lock = threading.Lock()
        self._table.add_before_read(self.flush)

    def __len__(self) -> int:
        return self._table.stats().rows

    def append(self, row: Sequence[Any] | Mapping[str, Any]) -> None:
        """Append one row: a sequence in column order, or a mapping by column name."""
        values = self._row_values(row)
        with self._lock:
            if not self._buf[0]:
                self._buf_since = time.monotonic()
            for col, v in zip(self._buf, values, strict=True):
                col.append(v)
            full = len(self._buf[0]) >= FLUSH_ROWS
        if full:
            self.flush()

    def append_many(self, rows: Iterable[Sequence[Any] | Mapping[str, Any]]) -> None:
        """Append many rows (same forms as ``append``)."""
        for row in rows:
            self.append(row)

    def _row_values(self, row: Sequence[Any] | Mapping[str, Any]) -> list[Any]:
        return row_values(self.name, self.columns, row)

    def flush(self) -> None:
        """Hand buffered rows to the store now (queries call this themselves)."""
        with self._lock:
            if not self._buf[0]:
                return
            buf, self._buf = self._buf, [[] for _ in self.columns]
            since = self._buf_since
        schema = self._table.schema
        try:
            if schema is None:
                arrays = [pa.array(col) for col in buf]
            else:
                arrays = [pa.array(col, type=f.type) for col, f in zip(buf, schema, strict=True)]
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as err:
            self._table.count_dropped(len(buf[0]))
            raise ValueError(f"rows do not fit python.{self.name}: {err}") from err
        self._table.append_batch(pa.Table.from_arrays(arrays, names=self.columns), since=since)


class Puller:
    """The ExternalTables of a process beside us: their rows taken from its
    guest (``probing.guest.outbox``) into ``python.<name>`` of ``store``
    before a query reads them. A table's types are the ones its code gave,
    else taken from its first rows."""

    def __init__(self, take: Any, store: Store) -> None:
        self.take = take  # the target's ``external``
        self.store = store
        self._lock = threading.Lock()
        self._known: set[str] = set()

    def pull(self) -> None:
        from probing.errors import ProbingError

        with self._lock:
            try:
                tables = self.take()
            except ProbingError:  # the process is gone: what was taken stays
                return
            for name, box in tables.items():
                self._store_rows(name, box)

    def _store_rows(self, name: str, box: dict[str, Any]) -> None:
        columns, types, rows = box["columns"], box.get("types"), box["rows"]
        schema = None
        if types:
            try:
                schema = pa.schema(
                    [(c, pa.type_for_alias(t)) for c, t in zip(columns, types, strict=True)]
                )
            except (ValueError, KeyError, TypeError):  # a type only the job's pyarrow names
                schema = None
        table = self.store.table(SCHEMA, name, schema)
        if table.column_names is None:
            table.column_names = list(columns)
        if name not in self._known:
            self._known.add(name)
            table.add_before_read(self.pull)
        if box.get("dropped"):
            table.count_dropped(int(box["dropped"]))
        if not rows:
            return
        cols = list(zip(*rows, strict=True))
        target = table.schema or schema
        try:
            if target is None:
                arrays = [pa.array(list(c)) for c in cols]
            else:
                arrays = [pa.array(list(c), type=f.type) for c, f in zip(cols, target, strict=True)]
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            table.count_dropped(len(rows))
            return
        table.append_batch(pa.Table.from_arrays(arrays, names=list(columns)))
