"""The tracer inside the probe: compile, attach, drain, detach.

One ``Tracer`` per process at a time. ``start()`` compiles each family's
BPF program (BCC), attaches its uprobes to the libraries this process has
mapped (and to the NVIDIA/torch libraries it can load later, found on
``sys.path``: uprobes attach to a file, mapped or not), then a thread wakes
every ``interval_s`` to drain the ring buffers in bulk into the store and
look for newly mapped libraries. ``stop()`` drains once more and detaches
every uprobe. The traced threads never wait for any of this.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from probing import checks
from probing.bpf import families as fam
from probing.bpf import kernel, loader
from probing.bpf.loader import program_dir  # noqa: F401  (the sampler's programs too)
from probing.bpf.pystacks import PyStacks
from probing.bpf.ringbuf import RingReader, unstage
from probing.bpf.state import TracerState
from probing.bpf.symbols import (
    ELF_ERRORS,
    Mapping,
    RuntimeNames,
    Symbolizer,
    exported,
    exported_matching,
    file_offsets,
    mapped_files,
)
from probing.errors import BPFUnavailable, ProbingError

DEFAULT_INTERVAL_S = 0.05
DRAIN_SLICE = 16384  # events decoded at a time; the GIL is let go between slices
BUSY_INTERVAL_S = 0.005  # the shortest wait between drains, for a ring filling fast
REFILL_TO = 0.25  # the next drain comes when the fastest ring may be this full again
RESCAN_EVERY_S = 0.5
FLUSH_EVERY_S = 0.5  # the timer's drain sends every CPU's staged events this often
RUNTIME_RANGES = 8  # libcudart copies the cuda program tells apart (bpf/cuda.bpf.c)


@dataclasses.dataclass
class Probe:
    """One uprobe (entry or return) as attached, or why not."""

    family: str
    library: str
    symbol: str
    kind: str  # "entry" | "return"
    attached: bool
    error: str | None = None


def require_bpf() -> None:
    """Raise ``BPFUnavailable`` naming what is missing and how to get it
    (BCC and the kernel headers only matter when a program is compiled:
    ``loader.obtain`` checks those)."""
    caps = checks.check_bpf_caps()
    if not caps.ok:
        raise BPFUnavailable(
            f"this process (pid {os.getpid()}) cannot load BPF programs: {caps.detail}",
            pid=os.getpid(),
            hint=caps.fix or "run the job as root, or grant CAP_BPF and CAP_PERFMON",
        )


def clock_offset_ns() -> int:
    """wall clock - CLOCK_MONOTONIC (what bpf_ktime_get_ns reads), from the
    tightest of a few bracketed readings."""
    best = None
    for _ in range(5):
        a = time.monotonic_ns()
        w = time.time_ns()
        b = time.monotonic_ns()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) // 2)
    assert best is not None
    return best[1]


def installed_libraries() -> list[str]:
    """Libraries this process may load later: NVIDIA wheels and torch on sys.path."""
    found = []
    for entry in sys.path:
        for pattern in (
            "nvidia/nccl/lib/libnccl.so*",
            "nvidia/cuda_runtime/lib/libcudart.so*",  # CUDA 12 wheels
            "nvidia/cu[0-9]*/lib/libcudart.so*",  # CUDA 13 wheels: nvidia/cu13/lib
            "torch/lib/libtorch_cpu.so",
        ):
            found.extend(glob.glob(os.path.join(entry, pattern)))
    return found


class _Live:
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

    def _flush_prog(self) -> int:
        if self._flush is None:
            self._flush = self.bpf.prog_fd("probing_flush", kernel.PROG_TYPE_RAW_TRACEPOINT)
        return self._flush

    def flush_on_switch(self) -> str | None:
        """A family that stages its events sends a CPU's stage when a thread
        leaves that CPU (``sched_switch``): a thread that moves to another
        CPU has its earlier events in the ring before its later ones. Why
        not, where the kernel refuses (its events may then come out of order
        across a migration, and later)."""
        if self.family.stage <= 1:
            return None
        try:
            fd = kernel.raw_tracepoint(self._flush_prog(), "sched_switch")
        except (kernel.BPFError, ProbingError) as err:
            return f"{self.family.name}: staged events not sent at a CPU switch: {err}"
        self.bpf.keep(loader.Attached("sched_switch", [fd], []))
        return None

    def flush_stages(self) -> str | None:
        """Every CPU's staged events into the ring (bpf/preamble.c:
        probing_flush), for a family that stages them; why not, where the
        kernel cannot run it (before Linux 5.10), and then never again:
        the stages go out when full, at a switch or with another event."""
        if self.family.stage <= 1 or self._flush_failed:
            return None
        try:
            for cpu in kernel.online_cpus():
                kernel.run_on_cpu(self._flush_prog(), cpu)
        except (kernel.BPFError, ProbingError) as err:
            self._flush_failed = True
            return f"{self.family.name}: staged events not sent before a drain: {err}"
        return None

    def read(self, events: int) -> np.ndarray:
        """At most about ``events`` events out of the ring."""
        if self.family.stage <= 1:
            return self.reader.read(events)
        return unstage(self.reader.read(max(1, events // self.family.stage)))


class Tracer:
    def __init__(
        self,
        families: Sequence[str] = ("nccl", "cuda", "gloo"),
        *,
        store: Any,
        output: str | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        stacks: bool = True,
        launch_stacks: bool = False,
        target: Any = None,
    ) -> None:
        unknown = [f for f in families if f not in fam.FAMILIES]
        if unknown:
            raise ProbingError(
                f"unknown probe families {unknown} (known: {', '.join(fam.FAMILIES)})"
            )
        self.store = store  # a probe's store (ProbeContext.start_trace)
        self.families = [fam.FAMILIES[f] for f in families]
        self.interval_s = interval_s
        self.stacks = stacks
        self.launch_stacks = launch_stacks
        self._py: PyStacks | None = None
        # the traced process (probing.target: this one, or a job's beside the engine)
        self.target = target
        self.pid = target.pid if target is not None else os.getpid()
        self.probes: list[Probe] = []
        self.state = TracerState.STOPPED
        self.started_ns = 0
        self.stopped_ns = 0
        self.last_error: str | None = None
        self.tick_errors = 0  # the drain thread's ticks that failed (last_error says why)
        self._live: list[_Live] = []
        self._all: list[_Live] = []  # every family loaded, for status after stop
        self._decoded = fam.Decoded(clock_offset_ns(), self.pid, self._kernel_names)
        self._symbolizer = Symbolizer(self.pid)
        self._runtime_names = RuntimeNames()
        self._runtime_ranges: list[tuple[int, ...]] = []
        self._cu_functions: dict[int, str | None] = {}
        self._kernels = KernelSlots()
        self._seen_files: set[tuple[int, int]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._drain_lock = threading.Lock()  # the timer thread, stop() and callers
        self._flushed = 0.0  # when the timer's drain last sent every CPU's stage
        self._writer = OutputWriter(output) if output else None
        # the helper process that holds this tracer's links and perf events
        self.holder = loader.Holder(self.pid)
        # how start() went: compiled or from the cache, seconds to load and to be ready
        self.load_info: dict[str, Any] = {"cached": {}}
        for f in self.families:
            self.store.table(f.table, "calls", f.schema)

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        require_bpf()
        t0 = time.perf_counter()
        py_flags: list[str] = []
        if self.stacks:
            try:
                self._py = PyStacks(self.store, target=self.target)
                py_flags = self._py.cflags(hot=self.launch_stacks)
            except ProbingError as err:  # an unsupported CPython: trace without stacks
                self.last_error = f"no Python stacks: {err}"
        started = False
        try:
            self.holder.start()  # its interpreter starts while the programs load
            multi = loader.has_uprobe_multi()
            for f in self.families:
                cflags = [
                    f"-DRINGBUF_PAGES={f.ringbuf_pages}",
                    "-Wno-unused-function",
                    *([f"-DSTAGE_EVENTS={f.stage}"] if f.stage > 1 else []),
                    *f.cflags,
                    *py_flags,
                ]
                compiled, cached = loader.obtain(f.source, f"{f.name}.h", cflags)
                self.load_info["cached"][f.name] = cached
                # the numpy mirror of the C event, field by field, before any event
                loader.check_dtype(
                    f"{f.name} event", f.dtype, loader.ctype_of(compiled.map("inflight").leaf)
                )
                if f.stage > 1:
                    loader.check_dtype(
                        f"{f.name} stage", f.record, loader.ctype_of(compiled.map("stage").leaf)
                    )
                bpf = loader.Program(compiled, multi=multi, holder=self.holder)
                reader = None
                try:
                    size = f.ringbuf_pages * mmap.PAGESIZE
                    reader = RingReader(bpf["events"].map_fd, size, f.record)
                finally:
                    if reader is None:  # it failed: this family's maps go too
                        bpf.close()
                self._live.append(_Live(f, bpf, reader))
                self._all.append(self._live[-1])
                self.last_error = self._live[-1].flush_on_switch() or self.last_error
            self.load_info["uprobe_multi"] = multi
            self.load_info["load_s"] = time.perf_counter() - t0
            self._sync_threads()
            if self._py is not None:
                self._hook_threads()
            self.attach_new_libraries()
            self.holder.sync()  # what attached is held by the helper, not in flight
            self.load_info["ready_s"] = time.perf_counter() - t0
            # the helper process that holds the links or perf events (loader.Holder)
            self.load_info["holder_pid"] = self.holder.pid
            started = True
        finally:
            if not started:  # whatever stopped it (an interrupt too): nothing stays attached
                self._detach()
                if self._writer is not None:
                    self._writer.close()
        self.state = TracerState.TRACING
        self.started_ns = time.time_ns()
        for f in self.families:  # a query sees every event committed before it
            self.store.table(f.table, "calls").add_before_read(self.drain)
        if self._py is not None:  # ... and the stacks of those events and of calls in flight
            self._py.table.add_before_read(self._resolve_stacks)
        self._thread = threading.Thread(target=self._run, name="probing-trace", daemon=True)
        self._thread.start()
        # Python stacks sampled on and off CPU meanwhile. Started here, not in a
        # thread of its own: its BCC compile beside the host's threads crashed
        # a host calling into libnccl at that moment (seen in test_trace)
        self.sampler = None
        self._start_sampler()

    def _hook_threads(self) -> None:
        """New threads get into the maps as they start: this process's by a
        hook here, a process beside us by its guest telling ``register_thread``."""
        assert self._py is not None
        if self.target is None or self.target.local:
            self._py.hook_threads(lambda: [live.bpf for live in self._live])
            return
        try:
            self.target.hook_threads(True)
        except ProbingError as err:  # picked up by the drain's sync instead
            self.last_error = f"new threads wait for the next sync: {err}"

    def _unhook_threads(self) -> None:
        assert self._py is not None
        if self.target is None or self.target.local:
            self._py.unhook_threads()
            return
        try:
            self.target.hook_threads(False)
        except ProbingError:  # gone: nothing hooked any more
            pass

    def register_thread(self, tid: int, tstate: int) -> None:
        """A new thread of the traced process, told by its guest as it starts."""
        if self._py is not None and self.state is TracerState.TRACING:
            self._py.register(tid, tstate, [live.bpf for live in self._live])

    def _start_sampler(self) -> None:
        from probing.bpf import sampler

        with self._lock:
            if self.state is not TracerState.TRACING:
                return
        started = sampler.start_for(self)
        with self._lock:
            if self.state is TracerState.TRACING:
                self.sampler = started
                return
        if started is not None:  # the trace stopped meanwhile
            started.stop()

    def stop(self) -> None:
        """Drain what is left, detach every uprobe, close the output. Safe twice."""
        with self._lock:
            if self.state is not TracerState.TRACING:
                return
            self.state = TracerState.STOPPING
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        for f in self.families:
            self.store.table(f.table, "calls").remove_before_read(self.drain)
        if self._py is not None:
            self._py.table.remove_before_read(self._resolve_stacks)
        if getattr(self, "sampler", None) is not None:
            self.sampler.stop()
        try:
            self.drain()
        finally:
            self._detach()
            for f in self.families:
                self.store.table(f.table, "calls").flush()
            if self._writer is not None:
                self._writer.close()
            self.state = TracerState.STOPPED
            self.stopped_ns = time.time_ns()

    def _detach(self) -> None:
        if self._py is not None:
            self._unhook_threads()
        with self._drain_lock:
            live_families, self._live = self._live, []
        # every family's uprobes released at once: each release waits for an
        # RCU grace period, and releases in flight together share one
        loader.close_all([fd for live in live_families for a in live.bpf.attached for fd in a.fds])
        for live in live_families:
            live.bpf.attached = []
            try:
                live.reader.close()
            except (BufferError, OSError) as err:  # a view of the ring still exported
                self.last_error = f"{live.family.name}: ring buffer: {err}"
            try:
                live.bpf.close()
            except OSError as err:
                self.last_error = f"{live.family.name}: detach: {err}"
        self.holder.close()  # it lets go of what it holds, and exits
        for p in self.probes:
            p.attached = False

    def _run(self) -> None:
        last_scan = time.monotonic()
        wait = self.interval_s
        last = time.monotonic()
        while not self._stop.wait(wait):
            try:
                self._sync_threads()
                # a ring filling fast is drained sooner: by the fill rate since
                # the last drain, before it is REFILL_TO full again
                filled, now = self._drain_backlog(), time.monotonic()
                wait = self.interval_s
                if filled > 0:
                    wait = min(self.interval_s, (now - last) * REFILL_TO / filled)
                    wait = max(BUSY_INTERVAL_S, wait)
                last = now
                if time.monotonic() - last_scan >= RESCAN_EVERY_S:
                    last_scan = time.monotonic()
                    self.attach_new_libraries()
            except Exception as err:  # noqa: BLE001
                # this thread runs inside the traced job: whatever goes wrong
                # in a tick (a bug too) must not end tracing or reach the
                # host, so it is counted and shown in status, and the next
                # tick tries again
                self.tick_errors += 1
                self.last_error = f"{type(err).__name__}: {err}"

    def _sync_threads(self) -> None:
        if self._py is not None:
            self._py.sync(live.bpf for live in self._live)

    # -- attaching --------------------------------------------------------------
    def attach_new_libraries(self) -> None:
        """Attach to every matching library not attached yet (by inode)."""
        maps = mapped_files(self.pid)
        self._mark_runtime_text(maps)
        paths = [m.path for m in maps]  # what the process has: a library it maps later
        # is found by the next scan (RESCAN_EVERY_S)
        for path in dict.fromkeys(paths):
            base = os.path.basename(path)
            wanted = [live for live in self._live if live.family.libraries.match(base)]
            if not wanted:
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in self._seen_files:
                continue
            self._seen_files.add(key)
            for live in wanted:
                self._attach_library(live, path)

    def _mark_runtime_text(self, maps: list[Mapping]) -> None:
        """Tell the cuda program where each loaded libcudart lies: the runtime
        launches through cuLaunchKernel, and that call is not a second launch."""
        spans: dict[str, list[int]] = {}
        for m in maps:
            if os.path.basename(m.path).startswith("libcudart.so"):
                lo_hi = spans.setdefault(m.path, [m.start, m.end])
                lo_hi[0], lo_hi[1] = min(lo_hi[0], m.start), max(lo_hi[1], m.end)
        ranges = sorted(tuple(v) for v in spans.values())[:RUNTIME_RANGES]
        if ranges == self._runtime_ranges:
            return
        for live in self._live:
            if live.family.name != "cuda":
                continue
            table = live.bpf["runtime_text"]
            for i in range(RUNTIME_RANGES):
                start, end = ranges[i] if i < len(ranges) else (0, 0)
                table[ctypes.c_int(i)] = table.Leaf(start, end)
        self._runtime_ranges = ranges

    def _symbols(self, f: fam.Family, path: str) -> dict[str, tuple[str, int]]:
        """Func.enum -> (the symbol to attach to in ``path``, its file offset)."""
        if f.demangled is not None:
            found = exported_matching(path, f.mangled_prefix, f.demangled)
        else:
            names = exported(path, [s for fn in f.funcs for s in fn.symbols])
            found = {}
            for fn in f.funcs:
                sym = next((s for s in fn.symbols if s in names), None)
                if sym is not None:
                    found[fn.enum] = (sym, names[sym])
        offsets = file_offsets(path, [addr for _, addr in found.values()])
        return {e: (sym, offsets[a]) for e, (sym, a) in found.items() if a in offsets}

    def _attach_library(self, live: _Live, path: str) -> None:
        f = live.family
        try:
            symbols = self._symbols(f, path)
        except ELF_ERRORS as err:
            self.probes.append(Probe(f.name, path, "*", "entry", False, f"cannot read: {err}"))
            return
        if not symbols:
            return
        wanted = []  # (handler, symbol, file offset, is a return probe)
        for fn in f.funcs:
            if fn.enum not in symbols:
                continue
            sym, offset = symbols[fn.enum]
            wanted.append((fn.entry, sym, offset, False))
            if fn.ret is not None:
                wanted.append((fn.ret, sym, offset, True))
        for sym, kind, ok, err in live.bpf.attach(path, wanted, self.pid):
            self.probes.append(Probe(f.name, path, sym, kind, ok, err))
        live.libraries.add(path)  # listed once its uprobes are in

    # -- draining ---------------------------------------------------------------
    def drain(self) -> int:
        """Move every event made so far into the store (staged ones too);
        returns how many."""
        with self._drain_lock:
            return self._drain_locked(flush=True)

    def _drain_backlog(self) -> float:
        """Drain; how full the fullest ring was before it (0 to 1). The
        stages are sent at most every FLUSH_EVERY_S here (an IPI per CPU
        each time); a query's drain sends them every time."""
        with self._drain_lock:
            full = max((live.reader.pending() / live.reader.size for live in self._live), default=0)
            now = time.monotonic()
            flush = now - self._flushed >= FLUSH_EVERY_S
            if flush:
                self._flushed = now
            self._drain_locked(flush=flush)
        return full

    def _drain_locked(self, *, flush: bool) -> int:
        total = 0
        for live in self._live:
            table = self.store.table(live.family.table, "calls")
            counts = live.bpf["dropped"]
            dropped = int(counts[ctypes.c_int(0)].value)
            live.saved = int(counts[ctypes.c_int(1)].value)
            if dropped > live.drops_seen:
                table.count_dropped(dropped - live.drops_seen)
                live.drops_seen = dropped
            if flush:  # what each CPU holds back goes in first
                self.last_error = live.flush_stages() or self.last_error
            # what the ring holds now, in slices (and no more: a producer as
            # fast as the drain never keeps a query's drain going)
            records = live.reader.pending() // live.reader.record_size
            slices = -(-records * live.family.stage // DRAIN_SLICE)
            for _ in range(slices):  # between slices a host thread waiting for
                total += self._drain_slice(live, table)  # the GIL takes it
        return total

    def _drain_slice(self, live: _Live, table: Any) -> int:
        ev = live.read(DRAIN_SLICE)
        if not len(ev):
            return 0
        if self._py is not None:  # python.stacks rows before the events that use them
            self._py.collect(live.bpf, ev["stack_id"])
        batch = fam.to_batch(live.family, ev, self._decoded, live.next_id)
        live.next_id += len(ev)
        live.events += len(ev)
        # a chunk this completes is compressed by the store's sealer thread
        table.append_batch(batch, defer_seal=True)
        if self._writer is not None:
            self._writer.write(f"{live.family.table}.calls", batch)
        return len(ev)

    def _resolve_stacks(self) -> None:
        """Before python.stacks is read: every event drained, and the stacks
        of calls still in flight (a hang's stacks) resolved."""
        self.drain()
        with self._drain_lock:
            if self._py is None:
                return
            for live in self._live:
                raw = [bytes(v) for _, v in live.bpf["inflight"].items()]
                if raw:
                    ev = np.frombuffer(b"".join(raw), dtype=live.family.dtype)
                    self._py.collect(live.bpf, ev["stack_id"])

    def inflight(self, family: str) -> pa.Table:
        """Calls entered and not returned yet (from the pairing map), as rows
        of ``<family>.calls`` with a NULL ``dur_ns``."""
        f = fam.FAMILIES[family]
        live = next((x for x in self._live if x.family is f), None)
        if live is None or self.state is not TracerState.TRACING:
            return f.schema.empty_table()
        raw = [bytes(v) for _, v in live.bpf["inflight"].items()]
        if not raw:
            return f.schema.empty_table()
        ev = np.frombuffer(b"".join(raw), dtype=f.dtype)
        ev = ev[(ev["flags"] & fam.HAS_RET) == 0]  # returned calls stay until overwritten
        ev = ev[[os.path.exists(f"/proc/{self.pid}/task/{t}") for t in ev["tid"]]]
        batch = fam.to_batch(f, ev, self._decoded, -1)
        ids = pa.nulls(len(ev), pa.int64())
        return pa.Table.from_batches([batch]).set_column(0, "event_id", ids)

    # -- kernel names -------------------------------------------------------------
    def _cuda_libraries(self) -> list[str]:
        return sorted(p for live in self._all if live.family.name == "cuda" for p in live.libraries)

    def _kernel_names(self, ev: np.ndarray, launch: np.ndarray) -> pa.Array:
        ids = {fn.enum: i for i, fn in enumerate(fam.CUDA_FUNCS)}
        got = (ev["fn"] == ids[fam.CU_GETFUNCTION]) & ((ev["flags"] & fam.HAS_RET) != 0)
        learnt = False
        for func, ptr in zip(ev["func"][got].tolist(), ev["ptr"][got].tolist(), strict=True):
            if func:
                self._cu_functions[func] = read_cstring(ptr, self.pid)
                learnt = True
        idx = np.flatnonzero(launch)
        if not idx.size:
            return pa.nulls(len(ev), pa.string())
        runtimes = [p for p in self._cuda_libraries() if "libcudart" in os.path.basename(p)]
        if learnt or runtimes != self._kernels.runtimes:  # a name may have changed
            self._kernels.clear(runtimes)
        every = idx.size == len(ev)  # a slice of launches only: no gather
        func, fn = (ev["func"], ev["fn"]) if every else (ev["func"][idx], ev["fn"][idx])
        # one key per (address, runtime or driver): addresses fit in 63 bits
        keys = func | ((fn == ids[fam.CU_LAUNCH]).astype(np.uint64) << np.uint64(63))

        def name(k: int) -> str | None:
            if k & (1 << 63):
                return self._cu_functions.get(k ^ (1 << 63))
            return self._symbolizer.name(k) or self._runtime_names.name(k, runtimes)

        found = self._kernels.lookup(keys, name)
        names = self._kernels.dictionary()  # the last entry is NULL
        if every and (found == found[0]).all():  # one kernel, launched again and again
            return pa.repeat(names[int(found[0])], len(found))
        if every:
            return names.take(pa.array(found))
        slot = np.full(len(ev), len(names) - 1, dtype=np.int32)
        slot[idx] = found
        return names.take(pa.array(slot))

    # -- status -----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        per = {}
        for live in self._all:
            per[live.family.name] = {
                "events": live.events,
                "dropped": live.drops_seen,
                "saved": live.saved,
                "libraries": sorted(live.libraries),
                "uprobes": sum(
                    1 for p in self.probes if p.family == live.family.name and p.attached
                ),
            }
        return {
            "state": self.state.value,
            "pid": self.pid,
            "started_ns": self.started_ns,
            "stopped_ns": self.stopped_ns or None,
            "families": per,
            "output": self._writer.path if self._writer else None,
            "stacks": self._py is not None,
            "launch_stacks": self._py is not None and self.launch_stacks,
            "stacks_resolved": self._py.resolved if self._py is not None else 0,
            # threads the start hook could not register (they come with the next sync)
            "stack_hook_errors": self._py.hook_errors if self._py is not None else 0,
            "last_error": self.last_error,
            "tick_errors": self.tick_errors,
            "load": self.load_info,
        }

    def probes_table(self) -> pa.Table:
        rows = [dataclasses.asdict(p) for p in self.probes]
        return pa.Table.from_pylist(rows, schema=PROBES_SCHEMA)


KERNEL_SLOTS = 4096  # KernelSlots' table: a power of two


class KernelSlots:
    """Kernel key -> name id for a whole column of launches at once.

    A direct-mapped table in numpy (slot from the key's address bits)
    answers the keys seen before; the others are named one by one, once
    (``name``), and take their slot. ``clear`` when a name may have changed.
    """

    def __init__(self) -> None:
        self.clear([])

    def clear(self, runtimes: list[str]) -> None:
        self.runtimes = runtimes  # the libcudart copies the names came from
        self.keys = np.zeros(KERNEL_SLOTS, dtype=np.uint64)
        self.ids = np.full(KERNEL_SLOTS, -1, dtype=np.int32)
        self.names: list[str | None] = []
        self._by_key: dict[int, int] = {}
        self._dictionary: pa.Array | None = None

    def lookup(self, keys: np.ndarray, name: Callable[[int], str | None]) -> np.ndarray:
        """The name id of every key (int32), naming new keys with ``name``."""
        slot = ((keys >> np.uint64(4)) ^ (keys >> np.uint64(20))) & np.uint64(KERNEL_SLOTS - 1)
        slot = slot.astype(np.intp)
        found = self.ids[slot]
        miss = (found < 0) | (self.keys[slot] != keys)
        if miss.any():
            missed = keys[miss]
            distinct = np.unique(missed)
            ids = np.empty(len(distinct), dtype=np.int32)
            for i, k in enumerate(distinct.tolist()):
                got = self._by_key.get(k)
                if got is None:
                    got = self._by_key[k] = len(self.names)
                    self.names.append(name(k))
                    self._dictionary = None
                ids[i] = got
            missed_ids = ids[np.searchsorted(distinct, missed)]
            found[miss] = missed_ids
            where = slot[miss]  # each key takes its slot; the last one wins a collision
            self.keys[where] = missed
            self.ids[where] = missed_ids
        return found

    def dictionary(self) -> pa.Array:
        """The names by id, then one NULL."""
        if self._dictionary is None:
            self._dictionary = pa.array([*self.names, None], type=pa.string())
        return self._dictionary


PROBES_SCHEMA = pa.schema(
    [
        ("family", pa.string()),
        ("library", pa.string()),
        ("symbol", pa.string()),
        ("kind", pa.string()),
        ("attached", pa.bool_()),
        ("error", pa.string()),
    ]
)


def read_cstring(addr: int, pid: int | str = "self", limit: int = 512) -> str | None:
    """A NUL-terminated string in process ``pid``'s memory, or None where it
    cannot be read (through /proc/PID/mem: a bad address is an error, not a
    crash)."""
    if not addr:
        return None
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        try:
            raw = os.pread(fd, limit, addr)
        finally:
            os.close(fd)
    except (OSError, OverflowError):
        return None
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace") or None


class OutputWriter:
    """Everything traced, into one Parquet file: a ``table`` column names the
    source table; the other columns are the union of the tables' columns."""

    ROWS_PER_GROUP = 1 << 16

    def __init__(self, path: str) -> None:
        import pyarrow.parquet as pq

        fields: dict[str, pa.Field] = {"table": pa.field("table", pa.string())}
        for f in fam.FAMILIES.values():
            for field in f.schema:
                have = fields.setdefault(field.name, field)
                assert have.type == field.type, f"{field.name}: {have.type} vs {field.type}"
        self.schema = pa.schema(list(fields.values()))
        self.path = os.path.abspath(path)
        self._pending: list[pa.Table] = []
        self._rows = 0
        self._lock = threading.Lock()
        self._drain_lock = threading.Lock()  # the timer thread, stop() and callers
        self._writer = pq.ParquetWriter(self.path, self.schema, compression="zstd")

    def write(self, table: str, batch: pa.RecordBatch) -> None:
        n = batch.num_rows
        cols = []
        for field in self.schema:
            if field.name == "table":
                cols.append(pa.array([table] * n, pa.string()))
            elif field.name in batch.schema.names:
                cols.append(batch.column(field.name))
            else:
                cols.append(pa.nulls(n, field.type))
        with self._lock:
            self._pending.append(pa.Table.from_arrays(cols, schema=self.schema))
            self._rows += n
            if self._rows >= self.ROWS_PER_GROUP:
                self._flush_locked()

    def _flush_locked(self) -> None:
        if self._pending and self._writer is not None:
            self._writer.write_table(pa.concat_tables(self._pending))
        self._pending, self._rows = [], 0

    def close(self) -> None:
        with self._lock:
            self._flush_locked()
            if self._writer is not None:
                self._writer.close()
                self._writer = None
