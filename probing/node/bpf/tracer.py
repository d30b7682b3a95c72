"""The tracer inside the probe: compile, attach, drain, detach.

One ``Tracer`` per process at a time. ``start()`` compiles each family's
BPF program (BCC), attaches its uprobes to the libraries this process has
mapped, then a thread wakes every ``RESCAN_EVERY_S`` to attach to the
libraries mapped since (torch loads ``libnccl`` when a job makes its first
NCCL group: its calls until the next scan are not seen) and, every
``interval_s`` (sooner for a ring filling fast), to drain the ring buffers
in bulk into the store. ``stop()`` drains once more and detaches every
uprobe. The traced threads never wait for any of this.

The tracer owns the lifecycle (its state, the timer thread, the helper
process holding what is attached, the threads' hook, the sampler) and the
status it reports; the parts it runs have their own modules:

* ``drain``: the families loaded (``Live``) and their rings drained into
  the store (``Drainer``);
* ``attach``: the uprobes on the mapped libraries (``Uprobes``, ``UprobeAttempt``);
* ``cuda``: the cuda family's kernel names (``KernelNames``);
* ``output``: the trace's Parquet copy (``OutputWriter``).

What goes wrong in a part that must not end the trace (a family's stages
that cannot be sent, a tick of the timer) is kept in ``last_error``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from probing import checks
from probing.errors import BPFUnavailable, ProbingError
from probing.node.bpf import families as fam
from probing.node.bpf import loader
from probing.node.bpf.attach import UprobeAttempt, Uprobes
from probing.node.bpf.cuda import KernelNames
from probing.node.bpf.drain import Drainer, Live, compile_family
from probing.node.bpf.output import OutputWriter
from probing.node.bpf.pystacks import PyStacks
from probing.node.bpf.state import TracerState
from probing.worker import Worker, error_text

if TYPE_CHECKING:
    from probing.node.bpf.sampler import Sampler

# a drain costs about the same for 1 event as for 100 (its columns' set-up):
# every 2 s, sooner for a ring filling fast; a query, a peer's ask and the
# detector's look at its rank's arrivals drain first anyway
DEFAULT_INTERVAL_S = 2.0
BUSY_INTERVAL_S = 0.005  # the shortest wait between drains, for a ring filling fast
REFILL_TO = 0.25  # the next drain comes when the fastest ring may be this full again
RESCAN_EVERY_S = 1.0


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


class Waiting:
    """The families compiled and not loaded: none of their libraries is mapped
    yet (a CPU job's ``cuda``: its 64 MiB ring is never made). Each is loaded
    (``Tracer._load_wanted``) at the look that finds one of its libraries."""

    def __init__(self) -> None:
        self.compiled: dict[str, tuple[fam.Family, Any]] = {}
        self.multi = False  # the kernel attaches uprobes as one multi link

    def due(self, maps: list[Any]) -> list[tuple[fam.Family, Any]]:
        """The families waiting whose library ``maps`` holds."""
        names = {os.path.basename(m.path) for m in maps}
        return [(f, c) for f, c in list(self.compiled.values())
                if any(f.libraries.match(b) for b in names)]  # fmt: skip


def families_status(loaded: list[Live], uprobes: Uprobes, waiting: Waiting) -> dict[str, Any]:
    """Each family's events, drops, libraries and uprobes; one waiting for a
    library is ``loaded: False`` (no ring yet)."""
    per = {
        live.family.name: {
            "loaded": True, "events": live.events, "dropped": live.drops_seen,
            "saved": live.saved, "libraries": sorted(live.libraries),
            "uprobes": uprobes.attached(live.family.name),
            "refused": uprobes.refused(live.family.name),
        }
        for live in loaded
    }  # fmt: skip
    for name in list(waiting.compiled):
        per.setdefault(name, {"loaded": False, "events": 0, "dropped": 0, "saved": 0,
                              "libraries": [], "uprobes": 0, "refused": []})  # fmt: skip
    return per


@dataclasses.dataclass
class DrainPace:
    """When the drain thread drains next: ``interval_s`` after the last
    drain, sooner for a ring filling fast (before it is ``REFILL_TO`` full
    again), at once for one that would be by the next tick."""

    interval_s: float
    last: float = 0.0  # monotonic s of the last drain
    at: float = 0.0  # ... and of the next

    def start(self, now: float) -> None:
        self.last, self.at = now, now + self.interval_s

    def due(self, filled: float, now: float) -> bool:
        """Whether to drain now, the fullest ring ``filled`` (0 to 1)."""
        rising = filled * (1 + RESCAN_EVERY_S / max(now - self.last, BUSY_INTERVAL_S))
        return now >= self.at or rising >= REFILL_TO

    def drained(self, filled: float, now: float) -> None:
        """A drain found the fullest ring ``filled``: the next by its fill rate."""
        wait = self.interval_s
        if filled > 0:
            wait = min(wait, max(BUSY_INTERVAL_S, (now - self.last) * REFILL_TO / filled))
        self.last, self.at = now, now + wait


class Tracer:
    """Trace ``families`` of process ``target`` (this one by default) into
    ``store``: ``start()``, ``stop()``, ``status()``."""

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
        self.state = TracerState.STOPPED
        self.started_ns = 0
        self.stopped_ns = 0
        self.last_error: str | None = None
        self._uprobes = Uprobes(self.pid)
        self._kernel_names = KernelNames(self.pid, lambda: self._drainer.loaded)
        self._writer = OutputWriter(output) if output else None
        decoded = fam.Decoded(clock_offset_ns(), self.pid, self._kernel_names)
        self._drainer = Drainer(store, decoded, self._writer, self._note_error)
        # the drain thread: a look for new libraries every RESCAN_EVERY_S, a
        # drain every interval_s, sooner for a ring filling fast (_tick)
        self._pace = DrainPace(interval_s)
        self._worker = Worker(
            "probing-trace", self._tick, min(interval_s, RESCAN_EVERY_S),
            sooner=lambda: self._pace.at - time.monotonic(), on_error=self._tick_failed,
            shared=True,
        )  # fmt: skip
        self._last_scan = 0.0  # monotonic s
        self._lock = threading.Lock()
        self.holder = loader.Holder(self.pid)  # holds this tracer's links and perf events
        # how start() went: compiled or from the cache, seconds to load and to be ready
        self.load_info: dict[str, Any] = {"cached": {}}
        self._waiting = Waiting()  # families compiled, loaded once a library of theirs is
        for f in self.families:
            self.store.table(f.table, "calls", f.schema)

    @property
    def probes(self) -> list[UprobeAttempt]:
        """Every uprobe tried, attached or with why not."""
        return self._uprobes.probes

    @property
    def tick_errors(self) -> int:
        """The drain thread's ticks that failed (``last_error`` says why)."""
        return self._worker.errors

    def _note_error(self, msg: str) -> None:
        self.last_error = msg

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
        self._drainer.stacks = self._py
        started = False
        try:
            self.holder.start()  # its interpreter starts while the programs load
            self._waiting.multi = loader.has_uprobe_multi()
            for f in self.families:  # compiled now (or cached), loaded where a library is
                compiled, cached = compile_family(f, py_flags)
                self.load_info["cached"][f.name] = cached
                self._waiting.compiled[f.name] = (f, compiled)
            self.load_info["uprobe_multi"] = self._waiting.multi
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
            self._py.table.add_before_read(self._drainer.resolve_stacks)
        self._last_scan = time.monotonic()
        self._pace.start(self._last_scan)
        self._worker.start()
        # Python stacks sampled on and off CPU meanwhile. Started here, not in a
        # thread of its own: its BCC compile beside the host's threads crashed
        # a host calling into libnccl at that moment (seen in test_trace)
        self.sampler: Sampler | None = None
        self._start_sampler()

    def _load(self, live: Live) -> None:
        """A family loaded: drained from now on, its stages sent at a switch."""
        self._drainer.add(live)
        try:
            live.flush_on_switch()
        except BPFUnavailable as err:  # it traces all the same
            self.last_error = str(err)

    def _hook_threads(self) -> None:
        """New threads get into the maps as they start: this process's by a
        hook here, a process beside us by its guest telling ``register_thread``."""
        assert self._py is not None
        if self.target is None or self.target.local:
            self._py.hook_threads(self._drainer.programs)
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
            self._py.register(tid, tstate, self._drainer.programs())

    def _start_sampler(self) -> None:
        from probing.node.bpf import sampler

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
        self._worker.stop(timeout=10)
        for f in self.families:
            self.store.table(f.table, "calls").remove_before_read(self.drain)
        if self._py is not None:
            self._py.table.remove_before_read(self._drainer.resolve_stacks)
        sampler = getattr(self, "sampler", None)  # absent before start()
        if sampler is not None:
            sampler.stop()
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
        self._waiting.compiled.clear()
        if self._py is not None:
            self._unhook_threads()
        live_families = self._drainer.release()
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
        self._uprobes.detached()

    def _tick(self) -> None:
        """One turn of the drain thread: where a drain is due, threads synced
        and the rings' backlog drained; every ``RESCAN_EVERY_S`` the libraries
        mapped since."""
        if self._pace.due(self._drainer.filled(), time.monotonic()):
            self._sync_threads()
            self._pace.drained(self._drainer.backlog(), time.monotonic())
        if time.monotonic() - self._last_scan >= RESCAN_EVERY_S:
            self._last_scan = time.monotonic()
            self.attach_new_libraries(always=False)

    def _tick_failed(self, err: Exception) -> None:
        # this thread runs inside the traced job: whatever goes wrong in a
        # tick (a bug too) must not end tracing or reach the host, so it is
        # counted and shown in status (not logged), and the next tick tries again
        self.last_error = error_text(err)

    def _sync_threads(self) -> None:
        if self._py is not None:
            self._py.sync(self._drainer.programs())

    def attach_new_libraries(self, *, always: bool = True) -> None:
        """Attach to every matching library not attached yet (by inode),
        where the process maps a file it did not (``Uprobes.look``)."""
        maps = self._uprobes.look(self.pid, always=always)
        if maps is None:
            return
        self._load_wanted(maps)
        self._kernel_names.mark_runtime_text(maps, self._drainer.live)
        # what the process has: a library it maps later is found by the next
        # scan (RESCAN_EVERY_S)
        self._uprobes.attach_new(maps, self._drainer.live)

    def _load_wanted(self, maps: list[Any]) -> None:
        """Load each family compiled and waiting whose library ``maps`` holds."""
        for f, compiled in self._waiting.due(maps):
            try:
                live = Live.load(f, compiled, multi=self._waiting.multi, holder=self.holder)
                self._load(live)
                if self._py is not None:  # the threads synced before it was there
                    self._py.fill(live.bpf)
            finally:  # tried once; status saw it waiting until now
                self._waiting.compiled.pop(f.name, None)

    # -- reading ---------------------------------------------------------------------
    def drain(self) -> int:
        """Move every event made so far into the store (staged ones too);
        returns how many."""
        return self._drainer.drain()

    def drained(self) -> Drainer | None:
        """What it drained and keeps for the detector (``Drainer.arrivals``,
        ``Drainer.collectives_since``); None when it does not trace."""
        return self._drainer if self.state is TracerState.TRACING else None

    def inflight(self, family: str) -> pa.Table:
        """Calls entered and not returned yet (from the pairing map), as rows
        of ``<family>.calls`` with a NULL ``dur_ns``."""
        if self.state is not TracerState.TRACING:
            return fam.FAMILIES[family].schema.empty_table()
        return self._drainer.inflight(family, self.pid)

    # -- status -----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "pid": self.pid,
            "started_ns": self.started_ns,
            "stopped_ns": self.stopped_ns or None,
            "families": families_status(self._drainer.loaded, self._uprobes, self._waiting),
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
        return self._uprobes.table()
