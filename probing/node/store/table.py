"""One append-only column table: pending batches, sealed compressed chunks."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import pyarrow as pa

from probing.errors import log_unexpected
from probing.node.store import chunks
from probing.node.store.chunks import Chunk
from probing.node.store.codec import Codec

# sealed by age (a chunk every few seconds), a long trace leaves thousands of
# small files, which every query lists and whose footers it reads: every
# MERGE_AT chunks of fewer than chunk_rows rows become one
MERGE_AT = 16
# a merged chunk's parts stay on disk this long, out of every snapshot taken
# since, for the queries whose snapshot was taken before (past their time limit)
MERGED_KEPT_S = 120.0


class Host(Protocol):
    """What a table needs of the store that holds it (``probing.node.store.Store``)."""

    codec: Codec
    chunk_rows: int
    seal_after_s: float

    def chunk_root(self) -> str: ...

    def enforce_retention(self) -> None: ...

    def seal_later(self, table: EventTable, chunk_id: int, batches: list[pa.RecordBatch]) -> bool:
        """Queue a chunk to be sealed off the caller's thread; False: seal it now."""
        ...


class Snapshot(NamedTuple):
    """What a query reads, consistent at one instant: sealed chunks
    ``first_chunk..last_chunk`` under ``chunk_dir`` (``chunk_dir`` is None
    when there are none) and the rows not sealed yet, as one Arrow table.

    Chunks sealed after the snapshot (from rows that are in ``pending``) fall
    outside the chunk range, so no row is read twice.
    """

    schema: pa.Schema
    container: str  # the codec's: "parquet" or "ipc"
    chunk_dir: str | None
    first_chunk: int
    last_chunk: int
    sealing: tuple[int, ...]  # ids in that range whose files may appear: not ours
    paths: tuple[str, ...]
    pending: pa.Table
    merged: tuple[int, ...] = ()  # ids in that range merged into another since: not ours


@dataclasses.dataclass(frozen=True)
class TableStats:
    schema: str
    table: str
    rows: int
    raw_bytes: int
    stored_bytes: int
    compression_ratio: float | None
    chunks: int
    pending_rows: int
    retired_rows: int
    retired_bytes: int
    dropped_events: int
    read_errors: int  # a writer's flush before a read failed (its rows may lag)


def as_table(batch: pa.RecordBatch | pa.Table | Mapping[str, Any]) -> pa.Table:
    """What a writer appends (``EventTable.append_batch``) as one Arrow table:
    a RecordBatch, a Table, or a mapping of column name to an array-like."""
    if isinstance(batch, Mapping):
        return pa.table(dict(batch))
    if isinstance(batch, pa.RecordBatch):
        return pa.Table.from_batches([batch])
    if not isinstance(batch, pa.Table):
        raise TypeError(f"append_batch takes a RecordBatch, Table or mapping, not {type(batch)}")
    return batch


class EventTable:
    """Rows arrive as Arrow batches; every ``chunk_rows`` they are sealed: the pending
    batches concatenated, encoded by the store's codec into one file of the table's
    chunk directory (on tmpfs), which DataFusion scans. Queries see sealed chunks,
    batches being sealed and pending batches alike: no row is ever invisible."""

    def __init__(self, store: Host, schema_name: str, name: str, schema: pa.Schema | None) -> None:
        self._store = store
        self.schema_name = schema_name
        self.name = name
        self._schema = schema
        # names known before any row (an ExternalTable without types): NULL columns till then
        self.column_names: list[str] | None = None
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._pending_since = 0.0
        self._sealing: dict[int, list[pa.RecordBatch]] = {}  # chunk id -> rows
        self._chunks: list[Chunk] = []
        self._merged = chunks.Merged()  # the merges' parts, kept a while
        self.retired_rows = 0
        self.retired_bytes = 0
        self.dropped_events = 0
        self.read_errors = 0
        self.last_read_error: str | None = None
        self._logged: set[str] = set()  # the read errors written to the log (each once)
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._sealed = threading.Condition(self._lock)  # a chunk left _sealing
        # run before every read: a writer's own buffer (ExternalTable's) handed over
        self._before_read: list[Callable[[], None]] = []
        self.referenced = False  # others' rows refer to these (stack ids): ``snapshots``

    @property
    def qualified_name(self) -> str:
        return f"{self.schema_name}.{self.name}"

    @property
    def schema(self) -> pa.Schema | None:
        return self._schema

    # -- writing -------------------------------------------------------------
    def append_batch(
        self,
        batch: pa.RecordBatch | pa.Table | Mapping[str, Any],
        *,
        since: float | None = None,
        defer_seal: bool = False,
    ) -> int:
        """Append many rows at once; returns the number of rows appended.

        ``batch`` is a RecordBatch, a Table, or a mapping of column name to
        an array-like (numpy array, list, pyarrow array) of equal lengths.
        ``since`` is when the oldest of these rows was produced (monotonic
        clock), for a writer that buffered them: pending rows older than
        ``seal_after_s`` are sealed (compressed) at the next read or append,
        so the store's budget holds even when nobody reads this table.
        ``defer_seal``: a chunk this append completes is compressed by the
        store's sealer thread, not by the caller (the tracer's drain); its
        rows stay readable meanwhile.
        """
        batches = self._conform(batch)
        rows: int = sum(b.num_rows for b in batches)
        if rows == 0:
            return 0
        to_seal = None
        with self._lock:
            if not self._pending:
                self._pending_since = since if since is not None else time.monotonic()
            self._pending.extend(batches)
            self._pending_rows += rows
            aged = time.monotonic() - self._pending_since > self._store.seal_after_s
            if self._pending_rows >= self._store.chunk_rows or aged:
                to_seal = self._take_pending_locked()
        if to_seal is not None and not (defer_seal and self._store.seal_later(self, *to_seal)):
            self._seal(*to_seal)
        return rows

    def count_dropped(self, n: int) -> None:
        """Record events that never reached the table (ring buffer full, bad rows)."""
        with self._lock:
            self.dropped_events += int(n)

    def holds_rows(self) -> bool:
        """Whether a row is here (sealed, being sealed, pending); no drain first."""
        with self._lock:
            return bool(self._chunks or self._sealing or self._pending)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Seal whatever is pending now, and wait for chunks being sealed."""
        with self._lock:
            to_seal = self._take_pending_locked() if self._pending else None
        if to_seal is not None:
            self._seal(*to_seal)
        with self._lock:
            self._sealed.wait_for(lambda: not self._sealing, timeout=timeout_s)

    def _conform(
        self, batch: pa.RecordBatch | pa.Table | Mapping[str, Any]
    ) -> list[pa.RecordBatch]:
        """``batch`` as batches of this table's schema (the first rows fix it);
        rows that do not fit are counted as dropped, and raise."""
        if isinstance(batch, pa.RecordBatch) and batch.schema is self._schema:
            return [batch]  # built for this table (a decoder's): nothing to check
        batch = as_table(batch)
        with self._lock:
            if self._schema is None:
                self._schema = batch.schema
            schema = self._schema
        if batch.schema != schema:
            try:
                batch = batch.select(schema.names).cast(schema)
            except (KeyError, ValueError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
                self.count_dropped(batch.num_rows)
                raise ValueError(
                    f"rows do not fit {self.qualified_name} ({schema}): {err}"
                ) from err
        return list(batch.to_batches())

    def _take_pending_locked(self) -> tuple[int, list[pa.RecordBatch]]:
        chunk_id = chunks.next_id()
        batches = self._pending
        self._pending = []
        self._pending_rows = 0
        self._sealing[chunk_id] = batches
        return chunk_id, batches

    @property
    def chunk_dir(self) -> str:
        return os.path.join(self._store.chunk_root(), self.schema_name, self.name)

    def _seal(self, chunk_id: int, batches: list[pa.RecordBatch]) -> None:
        """Encode ``batches`` into a chunk file. A failure (disk full, …) drops
        and counts those rows and never raises into the writer."""
        # the encoder takes the batches as they are (no combine: one copy less)
        table = pa.Table.from_batches(batches, schema=self._schema)
        try:
            chunk = chunks.write(self.chunk_dir, chunk_id, table, self._store.codec)
        except Exception as err:  # never into the writer (an external table's is the host)
            if not isinstance(err, (OSError, pa.ArrowException)):  # not disk full, not the encoder
                log_unexpected(f"{self.qualified_name}: sealing", err)
            with self._lock:
                del self._sealing[chunk_id]
                self._sealed.notify_all()
                self.dropped_events += table.num_rows
                self.last_error = f"sealing failed, {table.num_rows} rows dropped: {err}"
            print(f"probing: {self.qualified_name}: {self.last_error}", file=sys.stderr)
            return
        with self._lock:
            self._chunks.append(chunk)
            del self._sealing[chunk_id]
            self._sealed.notify_all()
        self._merge_small()
        self._store.enforce_retention()

    def _merge_small(self) -> None:
        """The oldest MERGE_AT chunks of fewer than ``chunk_rows`` rows merged
        into one, where there are that many; the parts of merges
        MERGED_KEPT_S ago removed."""
        now = time.monotonic()
        with self._lock:
            expired = self._merged.expire(now, MERGED_KEPT_S)
            parts = self._merged.due(self._chunks, self._store.chunk_rows, MERGE_AT)
            schema = self._schema
        for c in expired:
            chunks.remove(c)
        codec = self._store.codec
        merged = chunks.merge(parts, schema, self.chunk_dir, codec) if parts and schema else None
        if merged is None:  # none due, a part retired meanwhile, or the disk: as they were
            return
        with self._lock:
            held = self._merged.commit(self._chunks, parts, merged, now)
            if held is not None:
                self._chunks = held
        if held is None:  # a part retired meanwhile
            chunks.remove(merged)

    def _let_go(self, chunk_id: int) -> None:
        """A chunk handed to the sealer after its store was closed: dropped."""
        with self._lock:
            self._sealing.pop(chunk_id, None)
            self._sealed.notify_all()

    # -- retention (called by the store) --------------------------------------
    def oldest_chunk(self) -> Chunk | None:
        with self._lock:
            return self._chunks[0] if self._chunks else None

    def retire_oldest(self) -> Chunk | None:
        with self._lock:
            if not self._chunks:
                return None
            chunk = self._chunks.pop(0)
            self.retired_rows += chunk.rows
            self.retired_bytes += chunk.raw_bytes
        chunks.remove(chunk)
        return chunk

    def take_chunks(self, found: str, codec: Codec) -> int:
        """The sealed chunks under ``found`` (another store's of this table), moved into
        mine oldest first; their rows. A file that cannot be read is left where it is."""
        rows = 0
        for path, schema, n, raw in chunks.described(found, codec):
            # a file written for other columns is not this table's any more
            chunk = chunks.move(path, self.chunk_dir, codec, n, raw) if self._fits(schema) else None
            if chunk is not None:
                with self._lock:
                    self._chunks.append(chunk)
                rows += n
        return rows

    def _fits(self, schema: pa.Schema) -> bool:
        """Whether rows of ``schema`` are this table's (the first fix its columns)."""
        with self._lock:
            if self._schema is None:
                self._schema = schema
            return bool(schema == self._schema)

    def stored_bytes(self) -> int:
        with self._lock:
            pending: int = sum(b.nbytes for b in self._pending)
            return sum(c.stored_bytes for c in self._chunks) + pending

    # -- reading -------------------------------------------------------------
    def snapshot(self, *, before_read: bool = True) -> Snapshot:
        """Every live row: the chunk directory plus the rows not sealed yet."""
        if before_read:
            self.run_before_read()
        if self._pending and time.monotonic() - self._pending_since > self._store.seal_after_s:
            self.flush()
        with self._lock:
            schema = self._schema or pa.schema([(n, pa.null()) for n in self.column_names or []])
            chunks = list(self._chunks)
            sealing = tuple(self._sealing)
            batches = self._unsealed_locked()
        ids = [c.id for c in chunks]
        return Snapshot(
            schema,
            self._store.codec.container,
            self.chunk_dir if chunks else None,
            min(ids, default=0),
            max(ids, default=-1),
            sealing,
            tuple(c.path for c in chunks),
            pa.Table.from_batches(batches, schema=schema),
            self._merged.ids(min(ids, default=0), max(ids, default=-1)),
        )

    def _unsealed_locked(self) -> list[pa.RecordBatch]:
        """Rows not in a chunk file yet: being sealed, then pending."""
        return [b for group in self._sealing.values() for b in group] + list(self._pending)

    def to_arrow(self, columns: list[str] | None = None) -> pa.Table:
        """Every live row as one Arrow table (reads the chunk files: only ``columns``)."""
        snap = self.snapshot()
        parts = [self._store.codec.decode(p, snap.schema, columns) for p in snap.paths]
        return pa.concat_tables([*parts, snap.pending.select(columns or snap.schema.names)])

    def add_before_read(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` before every read (to flush a writer's own buffer)."""
        with self._lock:
            self._before_read.append(hook)

    def remove_before_read(self, hook: Callable[[], None]) -> None:
        with self._lock:
            if hook in self._before_read:
                self._before_read.remove(hook)

    def run_before_read(self) -> None:
        for hook in list(self._before_read):
            try:
                hook()
            except Exception as err:  # a collector's drain: counted, logged once; reads go on
                with self._lock:
                    self.read_errors += 1
                    self.last_read_error = f"{type(err).__name__}: {err}"
                log_unexpected(f"{self.qualified_name}: a flush before a read", err, self._logged)

    def stats(self) -> TableStats:
        self.run_before_read()
        with self._lock:
            sealed = self._chunks
            pending = self._unsealed_locked()
            pend_rows = sum(b.num_rows for b in pending)
            pend_bytes = sum(b.nbytes for b in pending)
            raw = sum(c.raw_bytes for c in sealed) + pend_bytes
            stored = sum(c.stored_bytes for c in sealed) + pend_bytes
            return TableStats(
                schema=self.schema_name,
                table=self.name,
                rows=sum(c.rows for c in sealed) + pend_rows,
                raw_bytes=raw,
                stored_bytes=stored,
                compression_ratio=round(raw / stored, 2) if stored else None,
                chunks=len(sealed),
                pending_rows=pend_rows,
                retired_rows=self.retired_rows,
                retired_bytes=self.retired_bytes,
                dropped_events=self.dropped_events,
                read_errors=self.read_errors,
            )


def snapshots(tables: Sequence[EventTable]) -> list[Snapshot]:
    """Each of ``tables``' snapshots (in their order) as one query reads
    them: every table's hooks run first, since one table's may write another
    (the sampler's read before python.samples adds its samples' stacks to
    python.stacks); then the tables others refer to are taken last, so a row
    a writer adds meanwhile finds what it refers to (a writer adds a stack
    before the rows that use it)."""
    for t in tables:
        t.run_before_read()
    got: dict[int, Snapshot] = {}
    for i in sorted(range(len(tables)), key=lambda i: tables[i].referenced):
        got[i] = tables[i].snapshot(before_read=False)
    return [got[i] for i in range(len(tables))]
