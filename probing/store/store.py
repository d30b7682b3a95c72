"""The process-wide store: every table, one byte budget, one age limit."""

from __future__ import annotations

import os
import threading
import time

import pyarrow as pa
import pyarrow.fs as pafs

from probing.store.codec import DEFAULT_CODEC, get_codec
from probing.store.memfs import MemoryFS
from probing.store.table import EventTable, TableStats

DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_CHUNK_ROWS = 1 << 16


def _env_float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name)
    return float(raw) if raw else default


class Store:
    """Append-only compressed column tables with retention by bytes and age.

    Retention retires whole sealed chunks, oldest first across all tables,
    and counts what it retired per table (``retired_rows``/``retired_bytes``);
    nothing disappears without a count in ``probing.tables``.
    """

    def __init__(
        self,
        *,
        max_bytes: int | None = None,
        max_age_s: float | None = None,
        chunk_rows: int | None = None,
        codec: str | None = None,
        seal_after_s: float = 2.0,
    ) -> None:
        self.max_bytes = int(max_bytes or _env_float("PROBING_STORE_BYTES", DEFAULT_MAX_BYTES))
        self.max_age_s = (
            max_age_s if max_age_s is not None else _env_float("PROBING_STORE_AGE_S", None)
        )
        self.chunk_rows = int(chunk_rows or DEFAULT_CHUNK_ROWS)
        self.codec = get_codec(codec or os.environ.get("PROBING_STORE_CODEC", DEFAULT_CODEC))
        self.seal_after_s = seal_after_s
        self.fs = MemoryFS()
        self.pyfs = pafs.PyFileSystem(self.fs)
        self._tables: dict[tuple[str, str], EventTable] = {}
        self._lock = threading.RLock()

    def table(self, schema: str, name: str, arrow_schema: pa.Schema | None = None) -> EventTable:
        """The table ``schema.name``, created on first use."""
        key = (schema, name)
        with self._lock:
            tbl = self._tables.get(key)
            if tbl is None:
                tbl = self._tables[key] = EventTable(self, schema, name, arrow_schema)
            return tbl

    def get(self, schema: str, name: str) -> EventTable | None:
        with self._lock:
            return self._tables.get((schema, name))

    def tables(self, schema: str | None = None) -> list[EventTable]:
        with self._lock:
            return [t for (s, _), t in self._tables.items() if schema in (None, s)]

    def stats(self) -> list[TableStats]:
        return [t.stats() for t in self.tables()]

    def total_bytes(self) -> int:
        return sum(t.stored_bytes() for t in self.tables())

    def enforce_retention(self) -> None:
        """Retire the oldest chunks until the store fits its byte and age limits."""
        with self._lock:
            tables = list(self._tables.values())
            if self.max_age_s is not None:
                horizon = time.monotonic() - self.max_age_s
                for t in tables:
                    while (c := t.oldest_chunk()) is not None and c.sealed_at < horizon:
                        t.retire_oldest()
            total = sum(t.stored_bytes() for t in tables)
            while total > self.max_bytes:
                candidates = [(c.sealed_at, t) for t in tables if (c := t.oldest_chunk())]
                if not candidates:
                    break  # only pending rows left; they are bounded by chunk_rows
                _, victim = min(candidates, key=lambda pair: pair[0])
                chunk = victim.retire_oldest()
                total -= chunk.stored_bytes if chunk else 0

    def reinit_after_fork(self) -> None:
        self._lock = threading.RLock()
        self.fs.reinit_after_fork()
        for t in self._tables.values():
            t.reinit_after_fork()


_default: Store | None = None
_default_lock = threading.Lock()


def default_store() -> Store:
    """The store of this process (one per process, shared by every table)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Store()
        return _default
