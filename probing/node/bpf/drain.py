"""The families' ring buffers, drained into the store.

A family loads in two steps: ``compile_family`` (BCC, or the node's cache:
``loader.obtain``), then ``Live.load``: the numpy mirror of its event
checked against the compiled struct, the program loaded
(``loader.Program``) and its ring buffer mapped (``RingReader``). A
``Live`` family also keeps its counters (events, drops, saved reserves)
and sends the events its program stages per CPU into the ring
(``flush_stages``; ``flush_on_switch`` when a thread leaves a CPU).

``Drainer`` moves what the rings hold into the store's ``<family>.calls``
tables, in slices of ``DRAIN_SLICE`` events so that a host thread waiting
for the GIL gets it between them, and resolves the Python stacks the
events name before their rows go in. It is called by the tracer's timer
(``backlog``: how full the rings were, for the next wait), by every query
of a traced table (``drain``) and by the tracer's stop. A family that
cannot send its stages says why once (``BPFUnavailable``); the drainer
hands that to ``report`` and goes on.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from probing import proc
from probing.errors import BPFUnavailable, ProbingError
from probing.node.bpf import families as fam
from probing.node.bpf import kernel, loader
from probing.node.bpf.pystacks import PyStacks
from probing.node.bpf.ringbuf import RingReader, unstage

DRAIN_SLICE = 16384  # events decoded at a time; the GIL is let go between slices
FLUSH_EVERY_S = 0.5  # the timer's drain sends every CPU's staged events this often
ARRIVALS_S = 15.0  # the collectives' arrivals kept for the detector's looks (its PACE_S, and more)
# the collectives' calls kept as drained, for the detector's asks: each asks
# for the calls ended since the one before, less LAG_S (5, 10, 20, 40 s apart
# while a job is new), or every RESYNC_S for the whole window (WINDOW_S)
RECENT_S = 45.0
CLOCK_SLACK_NS = 1_000_000_000  # a call's end (BPF's clock, made wall) and the drain's wall clock
# ... of the calls with an op, only what the detector's asks read (what
# ``comm.collectives`` makes of a family's calls: ``trace.collectives_rows``)
KEPT_COLUMNS = ("op", "comm", "comm_id", "seq", "rank", "nranks", "bytes", "ts", "dur_ns",
                "pid", "tid", "peer", "tag", "wait_ns")  # fmt: skip


def compile_family(f: fam.Family, extra_cflags: list[str]) -> tuple[Any, bool]:
    """``f``'s program compiled (or from the cache), and whether it was cached."""
    cflags = [
        f"-DRINGBUF_PAGES={f.ringbuf_pages}",
        "-Wno-unused-function",
        *([f"-DSTAGE_EVENTS={f.stage}"] if f.stage > 1 else []),
        *f.cflags,
        *extra_cflags,
    ]
    return loader.obtain(f.source, f"{f.name}.h", cflags)


class Live:
    """One family's loaded program: BPF object, ring reader, counters."""

    def __init__(self, family: fam.Family, bpf: Any, reader: RingReader) -> None:
        self.family = family
        self.bpf = bpf
        self.reader = reader
        self.events = 0
        self.drops_seen = 0
        self.saved = 0  # events a retried ring reserve kept (preamble.c: SAVED)
        self.next_id = 0
        self.libraries: set[str] = set()
        self._flush: int | None = None
        self._flush_failed = False

    @classmethod
    def load(cls, f: fam.Family, compiled: Any, *, multi: bool, holder: loader.Holder) -> Live:
        """Load ``f``'s ``compiled`` program and map its ring buffer."""
        # the numpy mirror of the C event, field by field, before any event
        loader.check_dtype(
            f"{f.name} event", f.dtype, loader.ctype_of(compiled.map("inflight").leaf)
        )
        if f.stage > 1:
            loader.check_dtype(
                f"{f.name} stage", f.record, loader.ctype_of(compiled.map("stage").leaf)
            )
        bpf = loader.Program(compiled, multi=multi, holder=holder)
        reader = None
        try:
            size = f.ringbuf_pages * mmap.PAGESIZE
            reader = RingReader(bpf["events"].map_fd, size, f.record)
        finally:
            if reader is None:  # it failed: this family's maps go too
                bpf.close()
        return cls(f, bpf, reader)

    def _flush_prog(self) -> int:
        if self._flush is None:
            self._flush = self.bpf.prog_fd("probing_flush", kernel.PROG_TYPE_RAW_TRACEPOINT)
        return self._flush

    def flush_on_switch(self) -> None:
        """A family that stages its events sends a CPU's stage when a thread
        leaves that CPU (``sched_switch``): a thread that moves to another
        CPU has its earlier events in the ring before its later ones.
        ``BPFUnavailable`` where the kernel refuses (its events may then come
        out of order across a migration, and later)."""
        if self.family.stage <= 1:
            return
        try:
            fd = kernel.raw_tracepoint(self._flush_prog(), "sched_switch")
        except (kernel.BPFError, ProbingError) as err:
            raise BPFUnavailable(
                f"{self.family.name}: staged events not sent at a CPU switch: {err}"
            ) from err
        self.bpf.keep(loader.Attachment("sched_switch", [fd], []))

    def flush_stages(self) -> None:
        """Every CPU's staged events into the ring (bpf/preamble.c:
        probing_flush), for a family that stages them. ``BPFUnavailable``
        where the kernel cannot run it (before Linux 5.10), and then it is
        never tried again: the stages go out when full, at a switch or with
        another event."""
        if self.family.stage <= 1 or self._flush_failed:
            return
        try:
            for cpu in kernel.online_cpus():
                kernel.run_on_cpu(self._flush_prog(), cpu)
        except (kernel.BPFError, ProbingError) as err:
            self._flush_failed = True
            raise BPFUnavailable(
                f"{self.family.name}: staged events not sent before a drain: {err}"
            ) from err

    def read(self, events: int) -> np.ndarray:
        """At most about ``events`` events out of the ring."""
        if self.family.stage <= 1:
            return self.reader.read(events)
        return unstage(self.reader.read(max(1, events // self.family.stage)))


class Drainer:
    """The loaded families' rings into ``store``'s tables (and ``writer``),
    with ``decoded`` for their decoders; a family's error goes to ``report``."""

    def __init__(
        self,
        store: Any,
        decoded: fam.Decoded,
        writer: Any = None,
        report: Callable[[str], None] = lambda msg: None,
    ) -> None:
        self.store = store
        self.decoded = decoded
        self.writer = writer  # an OutputWriter, or None
        self.stacks: PyStacks | None = None  # set when the trace resolves Python stacks
        self.live: list[Live] = []
        self.loaded: list[Live] = []  # every family loaded, for status after stop
        self._report = report
        self._lock = threading.Lock()  # the timer thread, stop() and callers
        self._flushed = 0.0  # when the timer's drain last sent every CPU's stage
        # the collectives' arrivals (ts, wall ns) of the last ARRIVALS_S, as
        # drained: (newest, ts) a slice; the detector's looks read them
        self._arrivals: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        # ... and their calls: (drained, wall ns; family; rows), every call
        # drained after ``_kept_ns`` (wall ns): every call the store holds
        # where it held none before this trace
        self._recent: collections.deque[tuple[int, str, pa.RecordBatch]] = collections.deque()
        held = store is not None and any(
            t.holds_rows() for t in store.tables() if t.name == "calls"
        )
        self._kept_ns = time.time_ns() if held else 0

    def add(self, live: Live) -> None:
        self.live.append(live)
        self.loaded.append(live)

    def programs(self) -> list[Any]:
        """The BPF programs of the families loaded now."""
        return [live.bpf for live in self.live]

    def release(self) -> list[Live]:
        """The families loaded now, no longer drained (to be closed)."""
        with self._lock:
            live, self.live = self.live, []
        return live

    # -- draining ---------------------------------------------------------------
    def drain(self) -> int:
        """Move every event made so far into the store (staged ones too);
        returns how many."""
        with self._lock:
            return self._drain_locked(flush=True)

    def filled(self) -> float:
        """How full the fullest ring is (0 to 1): two reads of its positions."""
        return max((r.reader.pending() / r.reader.size for r in list(self.live)), default=0)

    def backlog(self) -> float:
        """Drain; how full the fullest ring was before it (0 to 1). The
        stages are sent at most every FLUSH_EVERY_S here (an IPI per CPU
        each time); a query's drain sends them every time."""
        with self._lock:
            full = self.filled()
            now = time.monotonic()
            flush = now - self._flushed >= FLUSH_EVERY_S
            if flush:
                self._flushed = now
            self._drain_locked(flush=flush)
        return full

    def _drain_locked(self, *, flush: bool) -> int:
        total = 0
        for live in self.live:
            table = self.store.table(live.family.table, "calls")
            counts = live.bpf["dropped"]
            dropped = int(counts[ctypes.c_int(0)].value)
            live.saved = int(counts[ctypes.c_int(1)].value)
            if dropped > live.drops_seen:
                table.count_dropped(dropped - live.drops_seen)
                live.drops_seen = dropped
            if flush:  # what each CPU holds back goes in first
                try:
                    live.flush_stages()
                except BPFUnavailable as err:
                    self._report(str(err))
            # what the ring holds now, in slices (and no more: a producer as
            # fast as the drain never keeps a query's drain going)
            records = live.reader.pending() // live.reader.record_size
            slices = -(-records * live.family.stage // DRAIN_SLICE)
            for _ in range(slices):  # between slices a host thread waiting for
                total += self._drain_slice(live, table)  # the GIL takes it
        return total

    def _drain_slice(self, live: Live, table: Any) -> int:
        ev = live.read(DRAIN_SLICE)
        if not len(ev):
            return 0
        if self.stacks is not None:  # python.stacks rows before the events that use them
            self.stacks.collect(live.bpf, ev["stack_id"])
        batch = fam.to_batch(live.family, ev, self.decoded, live.next_id)
        live.next_id += len(ev)
        live.events += len(ev)
        if "op" in batch.schema.names:  # a collective's family: its arrivals and calls kept
            self._arrived(batch)
            self._keep(live.family.name, batch)
        # a chunk this completes is compressed by the store's sealer thread
        table.append_batch(batch, defer_seal=True)
        if self.writer is not None:
            self.writer.write(f"{live.family.table}.calls", batch)
        return len(ev)

    def _arrived(self, batch: pa.RecordBatch) -> None:
        valid = batch.column("op").is_valid().to_numpy(zero_copy_only=False)
        ts = batch.column("ts").to_numpy(zero_copy_only=False)[valid]
        if not len(ts):
            return
        newest = int(ts.max())
        self._arrivals.append((newest, ts))
        while self._arrivals and self._arrivals[0][0] < newest - ARRIVALS_S * 1e9:
            self._arrivals.popleft()

    def _keep(self, family: str, batch: pa.RecordBatch) -> None:
        """``batch``'s calls with an op, the columns the detector reads (a
        copy: the store's rows go once sealed), kept ``RECENT_S``."""
        import pyarrow.compute as pc

        now = time.time_ns()
        names = [c for c in KEPT_COLUMNS if c in batch.schema.names]
        self._recent.append((now, family, batch.select(names).filter(pc.is_valid(batch["op"]))))
        while self._recent and self._recent[0][0] < now - RECENT_S * 1e9:
            self._kept_ns = self._recent.popleft()[0]

    def calls_since(self, cursor_ns: int) -> dict[str, list[pa.RecordBatch]] | None:
        """Every collective family's calls drained (the rings drained first)
        that may have ended from ``cursor_ns`` (wall ns) on, by family; more
        may come with them (the caller filters). None where some may have
        gone: the last ``RECENT_S`` are kept. No SQL: the detector's asks."""
        self.drain()
        with self._lock:
            if cursor_ns - CLOCK_SLACK_NS <= self._kept_ns:
                return None
            out: dict[str, list[pa.RecordBatch]] = {}
            for drained, family, batch in self._recent:
                if drained >= cursor_ns - CLOCK_SLACK_NS:  # a call ends before it is drained
                    out.setdefault(family, []).append(batch)
            return out

    def collectives_since(self, cursor_ns: int, pid: int) -> dict[str, pa.Table] | None:
        """Each collective family's calls that may have ended from
        ``cursor_ns`` on (``calls_since``) and those of ``pid`` in flight,
        as rows of ``<family>.calls`` (its ``KEPT_COLUMNS``); None where some
        may have gone."""
        got = self.calls_since(cursor_ns)
        if got is None:
            return None
        out = {}
        for live in list(self.live):
            f = live.family
            if "op" in f.schema.names:
                kept = pa.schema([f.schema.field(c) for c in KEPT_COLUMNS if c in f.schema.names])
                done = pa.Table.from_batches(got.get(f.name, []), schema=kept)
                flying = self.inflight(f.name, pid).select(kept.names)
                out[f.name] = pa.concat_tables([done, flying])
        return out

    def arrivals(self, since_ns: int) -> np.ndarray:
        """The collectives entered from ``since_ns`` (wall ns) to now, by
        the calls drained (the rings drained first; calls still in flight
        are not in it), unsorted; the last ``ARRIVALS_S`` at most. No SQL:
        the detector looks at them every second."""
        self.drain()
        with self._lock:
            parts = [ts[ts >= since_ns] for newest, ts in self._arrivals if newest >= since_ns]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def resolve_stacks(self) -> None:
        """Before python.stacks is read: every event drained, and the stacks
        of calls still in flight (a hang's stacks) resolved."""
        self.drain()
        with self._lock:
            if self.stacks is None:
                return
            for live in self.live:
                raw = [bytes(v) for _, v in live.bpf["inflight"].items()]
                if raw:
                    ev = np.frombuffer(b"".join(raw), dtype=live.family.dtype)
                    self.stacks.collect(live.bpf, ev["stack_id"])

    def inflight(self, family: str, pid: int) -> pa.Table:
        """Calls entered and not returned yet (from the pairing map) by the
        threads of ``pid`` still alive, as rows of ``<family>.calls`` with a
        NULL ``dur_ns``."""
        f = fam.FAMILIES[family]
        live = next((x for x in self.live if x.family is f), None)
        if live is None:
            return f.schema.empty_table()
        raw = [bytes(v) for _, v in live.bpf["inflight"].items()]
        if not raw:
            return f.schema.empty_table()
        ev = np.frombuffer(b"".join(raw), dtype=f.dtype)
        ev = ev[(ev["flags"] & fam.HAS_RET) == 0]  # returned calls stay until overwritten
        ev = ev[[proc.exists(pid, f"task/{t}") for t in ev["tid"]]]
        batch = fam.to_batch(f, ev, self.decoded, -1)
        ids = pa.nulls(len(ev), pa.int64())
        return pa.Table.from_batches([batch]).set_column(0, "event_id", ids)
