"""One export's window: which rows, read from the probes in time chunks.

The window ends now and reaches ``window_s`` back. Each event table is
counted first (one aggregate per rank), the window is cut into chunks of
about ``CHUNK_ROWS`` rows, and the chunks are read newest first, so that
``--max-events`` keeps the most recent events and says what it left out
(``Cap``). No more than a few chunks of one table each are held at a time:
the one being written and those read ahead (``Prefetched``).
"""

from __future__ import annotations

import math
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import pyarrow as pa

from probing.cli.export.source import Source
from probing.errors import ProbingError
from probing.worker import Worker

# the event tables an export reads, and what each row becomes in a timeline
SLICE_TABLES = ("nccl.calls", "gloo.calls", "cuda.calls")
COUNTER_TABLES = ("nvml.gpu",)
EVENT_TABLES = SLICE_TABLES + COUNTER_TABLES
CHUNK_ROWS = 250_000
T = TypeVar("T")


@dataclass
class Cap:
    """``--max-events``: how many were kept and what was left out, per table."""

    limit: int | None
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    oldest_kept_ns: int | None = None  # where the file starts when it cut

    @property
    def cut(self) -> bool:
        return any(self.dropped.values())

    def room(self) -> int | None:
        return None if self.limit is None else max(0, self.limit - self.kept)

    def message(self) -> str:
        """One line for the CLI and the file ("" when nothing was cut)."""
        if not self.cut:
            return ""
        what = ", ".join(f"{n} {t}" for t, n in self.dropped.items() if n)
        return (
            f"--max-events {self.limit} cut the export: dropped {sum(self.dropped.values())} "
            f"older events ({what}); kept the newest {self.kept}"
        )


@dataclass
class ExportWindow:
    """One export's window over ``source``: its event tables counted, cut into
    chunks and read newest first (the module's docstring)."""

    source: Source
    window_s: float = 60.0
    max_events: int | None = None
    now_ns: int = field(default_factory=time.time_ns)
    counts: dict[str, int] = field(default_factory=dict)
    bounds: tuple[int, int] = (0, 0)  # [first, last + 1) ts over every event table

    def __post_init__(self) -> None:
        if self.max_events is not None and self.max_events < 1:
            raise ProbingError(
                f"--max-events must be at least 1 (got {self.max_events})",
                hint="leave it out to export every event in the window",
            )
        self.cap = Cap(self.max_events)

    @property
    def since_ns(self) -> int:
        return self.now_ns - int(self.window_s * 1e9)

    def _where(self, lo: int, hi: int) -> str:
        return f"ts >= {lo} AND ts < {hi}"

    def count(self) -> None:
        """Rows and time bounds of every event table in the window."""
        group = " GROUP BY rank" if self.source.remote else ""
        sel = ", rank" if self.source.remote else ""
        lo, hi = None, None
        for t in EVENT_TABLES:
            sql = (
                f"SELECT count(*) AS n, min(ts) AS t0, max(ts) AS t1{sel} FROM {t} "
                f"WHERE {self._where(self.since_ns, self.now_ns)}{group}"
            )
            rows = self.source.ask(sql).to_pylist()
            self.counts[t] = sum(r["n"] or 0 for r in rows)
            for r in rows:
                if r["t0"] is not None:
                    lo = r["t0"] if lo is None else min(lo, r["t0"])
                    hi = r["t1"] if hi is None else max(hi, r["t1"])
        self.bounds = (lo or self.since_ns, (hi or self.since_ns) + 1)

    def chunks(self) -> list[tuple[int, int]]:
        """[lo, hi) time ranges covering the bounds, newest first."""
        total = sum(self.counts.values())
        k = max(1, math.ceil(total / CHUNK_ROWS))
        lo, hi = self.bounds
        edges = [lo + (hi - lo) * i // k for i in range(k + 1)]
        edges[-1] = hi
        return [(edges[i], edges[i + 1]) for i in reversed(range(k))]

    def read(self, tables: tuple[str, ...]) -> Iterator[tuple[str, pa.Table, dict[str, int]]]:
        """``(table, rows, offsets)`` in the window, chunk by chunk (newest chunk
        first), ts on the asker's clock (moved by the clock ``offsets`` the
        chunk's own query measured), cut to what ``--max-events`` leaves room
        for. Once the cap is full nothing more is read: the counts say what is left."""
        if not self.counts:
            self.count()
        kept = dict.fromkeys(tables, 0)
        for lo, hi in self.chunks():
            for table in tables:
                if self.cap.room() == 0:
                    break
                sql = f"SELECT * FROM {table} WHERE {self._where(lo, hi)}"
                part, offsets = self.source.measured(sql)
                part = self._capped(self.source.align(part, offsets=offsets))
                kept[table] += part.num_rows
                yield table, part, offsets
        if self.cap.limit is not None:
            self.cap.dropped = {t: max(0, self.counts.get(t, 0) - kept[t]) for t in tables}

    def _capped(self, part: pa.Table) -> pa.Table:
        room = self.cap.room()
        if room is None or part.num_rows <= room:
            self.cap.kept += part.num_rows
            return part
        import pyarrow.compute as pc

        order = pc.sort_indices(part, [("ts", "descending")])
        part = part.take(order[:room])
        self.cap.kept += room
        oldest = pc.min(part.column("ts")).as_py()
        if oldest is not None:
            prev = self.cap.oldest_kept_ns
            self.cap.oldest_kept_ns = oldest if prev is None else min(prev, oldest)
        return part

    def whole(self, sql: str) -> pa.Table:
        """A small table read in one go (stacks, threads, groups), not windowed."""
        return self.source.ask(sql)


class Prefetched(Generic[T]):
    """``items`` read on a thread of their own, at most ``ahead`` before they are
    used (the probes answer while the caller works on the last one); an error
    in the reading is raised where its item would have come. ``close()``
    (safe twice; ``with`` calls it) stops the reading."""

    def __init__(self, items: Iterator[T], ahead: int = 2) -> None:
        self._items = items
        self._box: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=ahead)
        self._reader = Worker("probing-export-read", self._read)  # once: the whole reading
        self._reader.start()

    def _put(self, kind: str, value: Any) -> bool:
        while not self._reader.stopping:
            try:
                self._box.put((kind, value), timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _read(self) -> None:
        try:
            for item in self._items:
                if not self._put("item", item):
                    return
            self._put("end", None)
        except BaseException as err:  # handed to the caller, raised there
            self._put("error", err)

    def __iter__(self) -> Iterator[T]:
        while True:
            kind, value = self._box.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value

    def close(self) -> None:
        self._reader.stop(timeout=None)

    def __enter__(self) -> Prefetched[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
