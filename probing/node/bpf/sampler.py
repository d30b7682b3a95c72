"""Where this process's threads spend their wall-clock time, by Python stack.

``Sampler`` loads ``programs/sampler.bpf.c`` while the tracer traces, the
way the families load: compiled by BCC once per node (``loader.obtain``),
then loaded with bpf() and attached with perf_event_open and
``BPF_RAW_TRACEPOINT_OPEN``. CPU-clock perf events sample what runs on
every CPU (``SAMPLE_HZ``); the ``sched_switch`` raw tracepoint charges the
time each thread of this process spends off a CPU to the stack it left
with, and the ``sched_wakeup`` tracepoints split it: blocked (``off``) until
it was woken, then waiting for a CPU (``runq``), as is all of a preempted
thread's wait. The kernel counts per (thread, stack, kind); a thread of ours
reads and deletes the counts every ``interval_s`` and appends them
to ``python.samples``, plus one ``tick`` row per read (its ``dur_ns``: the
wall time that read covers). Stacks resolve into ``python.stacks`` like the
families' (``PyStacks``). The probe's own threads are left out (its Python
threads by name, its query engine's native ones by ``ENGINE_THREADS``). A
thread Python did not start (Gloo's, OpenMP's) is named by its kernel comm.
``PROBING_SAMPLE_HZ=0`` turns sampling off.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from probing import proc
from probing.errors import BPFUnavailable
from probing.worker import Worker, error_text

SAMPLE_HZ = 199  # per CPU; not a multiple of the kernel's tick
# a read costs ~3 ms whatever it holds (the maps' batches, the threads' sync,
# a batch of rows), and a query, ``why`` and the detector's wait for a CPU
# read first anyway (``add_before_read``): the timer's read bounds the map
# and makes the history (a row's ``ts`` is its read's)
DEFAULT_INTERVAL_S = 4.0
NAMES_S = 6.0  # a traced process's thread names, asked of its guest this often at most
KINDS = ("cpu", "off", "runq")  # sampler.h KIND_*; "tick": one row per read
SAMPLES_MAX = 16384
WAITS_S = 120.0  # each read's wait for a CPU kept this long (the detector asks of 30 s)
# threads the probe's query engine (DataFusion's tokio runtime) starts in the host:
# left out with the probe's own Python threads (a host running tokio would lose its own)
ENGINE_THREADS = frozenset({"tokio-rt-worker"})

SCHEMA = pa.schema(
    [
        ("ts", pa.int64()),  # wall ns of the read that produced the row
        ("tid", pa.int64()),
        ("thread", pa.string()),
        ("stack_id", pa.int64()),  # python.stacks; 0: no Python frame
        ("kind", pa.string()),  # cpu | off | runq | tick
        ("count", pa.int64()),  # samples, or off-CPU intervals
        ("dur_ns", pa.int64()),  # time: samples x period, or the intervals' sum
    ]
)


def sample_hz() -> int:
    """The configured rate (``PROBING_SAMPLE_HZ``: 0 no sampling, -1 ``SAMPLE_HZ``)."""
    from probing import config

    hz = int(config.load().sample_hz)
    return SAMPLE_HZ if hz < 0 else hz


class Sampler:
    def __init__(
        self,
        store: Any,
        *,
        hz: int = SAMPLE_HZ,
        interval_s: float = DEFAULT_INTERVAL_S,
        holder: Any = None,
        known: set[int] | None = None,
        target: Any = None,
    ) -> None:
        from probing.node.bpf.pystacks import PyStacks

        self.store = store
        self.holder = holder  # loader.Holder: keeps the perf events (None: we do)
        self.cached = False  # the program came from the node's cache
        self.hz = hz
        self.period_ns = 1_000_000_000 // max(hz, 1)
        self.interval_s = interval_s
        self.target = target  # the sampled process (probing.target); None: this one
        self.pid = target.pid if target is not None else os.getpid()
        self.table = store.table("python", "samples", SCHEMA)
        self.py = PyStacks(store, known, target)
        self.bpf: Any = None
        self.reads = 0
        self.dropped = 0
        self.last_error: str | None = None
        self._last_read = 0
        self._ours: set[int] = set()  # the probe's own threads, left out
        self._comms: dict[int, str | None] = {}  # threads without Python: the kernel's name
        self._named: tuple[float, dict[int, str | None]] = (0.0, {})  # (when, a guest's names)
        # each read's (wall ns, runq ns, wall ns it covers), kept WAITS_S: RUNQ_SQL's
        # sums without SQL (``waits_since``) from ``_waits_from`` on (None: not yet)
        self._waits: collections.deque[tuple[int, int, int]] = collections.deque()
        self._waits_from: int | None = None
        self._lock = threading.Lock()
        self._worker = Worker(
            "probing-sampler", self.read, interval_s, on_error=self._read_failed, shared=True
        )  # a read every interval_s, on the process's one sampler thread

    def start(self) -> None:
        """Load (from the node's cache: BCC runs once per node) and attach."""
        from probing.node.bpf import kernel, loader

        wakeup_pid = 24  # sched_wakeup's pid (its tracefs format says, where it can)
        with contextlib.suppress(kernel.BPFError):
            wakeup_pid = kernel.tracepoint_field("sched", "sched_wakeup", "pid")
        cflags = [
            f"-DSAMPLES_MAX={SAMPLES_MAX}",
            f"-DWAKEUP_PID_OFF={wakeup_pid}",
            "-Wno-unused-function",
            *self.py.cflags(),
        ]
        try:
            compiled, self.cached = loader.obtain("sampler.bpf.c", None, cflags)
        except BPFUnavailable as err:
            raise BPFUnavailable(
                str(err), pid=self.pid,
                hint="run `probing doctor`; PROBING_SAMPLE_HZ=0 traces without sampling",
            ) from err  # fmt: skip
        prog = loader.Program(compiled, multi=False, holder=self.holder)
        attached = False
        try:
            cfg = prog["config"]
            cfg[ctypes.c_int(0)] = cfg.Leaf(tgid=self.pid, sample_ns=self.period_ns)
            fds: list[int] = []
            try:
                on_cpu = prog.prog_fd("on_cpu", kernel.PROG_TYPE_PERF_EVENT)
                fds += [kernel.cpu_clock(on_cpu, c, self.period_ns) for c in kernel.online_cpus()]
            except kernel.BPFError as err:
                loader.close_all(fds)
                raise BPFUnavailable(
                    f"cannot open CPU-clock perf events: {err}",
                    pid=self.pid,
                    hint="check /proc/sys/kernel/perf_event_paranoid; PROBING_SAMPLE_HZ=0 "
                    "traces without sampling",
                ) from err
            switch = prog.prog_fd("raw_tracepoint__sched_switch", kernel.PROG_TYPE_RAW_TRACEPOINT)
            try:
                fds.append(kernel.raw_tracepoint(switch, "sched_switch"))
            except kernel.BPFError as err:
                loader.close_all(fds)
                raise BPFUnavailable(f"no off-CPU time: {err}", pid=self.pid) from err
            for name, fn in (("sched_wakeup", "on_wakeup"), ("sched_wakeup_new", "on_wakeup_new")):
                try:  # without them, the wait for a CPU after a wake-up counts as blocked
                    fd = prog.prog_fd(fn, kernel.PROG_TYPE_TRACEPOINT)
                    fds.append(kernel.tracepoint(fd, "sched", name))
                except kernel.BPFError as err:
                    self.last_error = f"no wake-ups ({name}): {err}"
            # the holder process keeps them: a tracepoint's perf event waits for
            # an RCU grace period when it goes, and neither a stop nor an exit
            # should wait for that
            prog.keep(loader.Attachment("sampler", fds, []))
            attached = True
        finally:
            if not attached:
                prog.close()
        self.bpf = prog
        self.py.sync([prog])
        self._last_read = time.monotonic_ns()
        # every row from now is a read's of ours; before, where the table held
        # none (an earlier trace's rows are the table's alone), nothing
        self._waits_from = time.time_ns() if self.table.holds_rows() else 0
        self.table.add_before_read(self.read)
        self._worker.start()

    def stop(self) -> None:
        """Read what is left and unload. Safe twice."""
        self._worker.stop(timeout=10)
        self.table.remove_before_read(self.read)
        try:
            self.read()
        finally:
            with self._lock:
                bpf, self.bpf = self.bpf, None
            if bpf is not None:
                bpf.close()

    @property
    def read_errors(self) -> int:
        """The thread's reads that failed (``last_error`` says why)."""
        return self._worker.errors

    def _read_failed(self, err: Exception) -> None:
        # this thread runs inside the traced job: a failed read (a bug too)
        # must not end sampling or reach the host; counted, shown in status
        # (not logged), and the next read tries again
        self.last_error = error_text(err)

    def read(self) -> int:
        """Append what the kernel counted since the last read; returns the rows."""
        with self._lock:
            if self.bpf is None:
                return 0
            return self._read_locked(self.bpf)

    def _read_locked(self, bpf: Any) -> int:
        self.py.sync([bpf])
        now_mono = time.monotonic_ns()
        now = time.time_ns()
        names = self._names()
        self._ours |= {tid for tid, name in names.items() if (name or "").startswith("probing")}
        ours = self._ours
        if len(self._comms) > SAMPLES_MAX:  # threads come and go: forget the old ones
            self._comms.clear()
        wall_ns, self._last_read = now_mono - self._last_read, now_mono
        # what was counted since the last read, each entry deleted as it is
        # read (a few bpf() calls): a read costs what the interval holds, not
        # every (thread, stack) a long trace ever saw. An add the kernel makes
        # to an entry just as it goes may be lost, or counted to the next key
        # that takes its place: a sample in millions.
        keys, vals = bpf["samples"].arrays(delete=True)
        tid = keys["tid"].astype(np.int64)
        for t in set(tid.tolist()) - names.keys() - ours:  # a thread Python did not start
            names[t] = self._comm(t)  # its comm
            if names[t] in ENGINE_THREADS:  # the probe's query engine
                ours.add(t)
        kind, count = keys["kind"].astype(np.int64), vals["count"].astype(np.int64)
        keep = (count > 0) & (kind < len(KINDS)) & ~np.isin(tid, list(ours))
        tids = [0, *tid[keep].tolist()]  # a "tick" row first: the wall time the read covers
        kinds = ["tick", *(KINDS[k] for k in kind[keep].tolist())]
        spans = np.r_[wall_ns, vals["ns"][keep]].astype(np.int64)
        batch = pa.RecordBatch.from_arrays(
            [
                pa.array(np.full(len(tids), now, dtype=np.int64)), pa.array(tids, pa.int64()),
                pa.array([names.get(t) for t in tids], pa.string()),
                pa.array(np.r_[0, keys["stack_id"][keep]].astype(np.int64)),
                pa.array(kinds, pa.string()), pa.array(np.r_[1, count[keep]]), pa.array(spans),
            ],
            schema=SCHEMA,
        )  # fmt: skip
        self.dropped = int(bpf["dropped"][ctypes.c_int(0)].value)
        self.py.collect_stored(bpf)  # after the counts: each of their stacks is there
        # a chunk this completes is compressed by the store's sealer thread
        self.table.append_batch(batch, defer_seal=True)
        runq = int(spans[np.array([k == "runq" for k in kinds], dtype=bool)].sum())
        self._kept_waits(now, runq, wall_ns)
        self.reads += 1
        return int(batch.num_rows)

    def _kept_waits(self, now: int, runq: int, wall_ns: int) -> None:
        """A read's wait for a CPU (its ``runq`` rows' time) and the wall time
        it covers, kept ``WAITS_S``."""
        self._waits.append((now, runq, wall_ns))
        while self._waits and self._waits[0][0] < now - WAITS_S * 1e9:
            gone = self._waits.popleft()[0]
            if self._waits_from is not None:
                self._waits_from = max(self._waits_from, gone + 1)

    def waits_since(self, since_ns: int) -> tuple[int, int] | None:
        """RUNQ_SQL's sums over this sampler's table from ``since_ns`` (wall
        ns), read first as a query reads: the time its threads waited for a
        CPU and the wall time sampled (ns); None where the reads kept do not
        reach back that far."""
        self.read()
        with self._lock:
            if self._waits_from is None or since_ns < self._waits_from:
                return None
            kept = [(runq, wall) for ts, runq, wall in self._waits if ts >= since_ns]
        return sum(r for r, _ in kept), sum(w for _, w in kept)

    def _names(self) -> dict[int, str | None]:
        """native tid -> ``threading`` name of the sampled process's threads;
        a guest's answer is kept NAMES_S (each ask wakes a thread in the job;
        a thread started meanwhile has its kernel name until then)."""
        if self.target is None or self.target.local:
            return {t.native_id: t.name for t in threading.enumerate() if t.native_id}
        at, names = self._named
        if time.monotonic() - at < NAMES_S:
            return dict(names)
        try:
            names = {t["tid"]: t["name"] for t in self.target.threads()}
        except Exception:  # a process gone or not answering: no names this read
            return {}
        self._named = (time.monotonic(), names)
        return dict(names)

    def _comm(self, tid: int) -> str | None:
        """The kernel's name of thread ``tid`` of this process (``pt_gloo_runloop``,
        an OpenMP worker's inherited ``python``), read once; None once it is gone."""
        if tid not in self._comms:
            try:
                self._comms[tid] = proc.read(self.pid, f"task/{tid}/comm").strip() or None
            except OSError:
                self._comms[tid] = None
        return self._comms[tid]

    def status(self) -> dict[str, Any]:
        return {"hz": self.hz, "reads": self.reads, "dropped": self.dropped,
                "read_errors": self.read_errors, "last_error": self.last_error,
                "cached": self.cached}  # fmt: skip


def start_for(tracer: Any) -> Sampler | None:
    """A running sampler for ``tracer``'s process, or None (sampling off, no
    Python stacks, or it could not start: the tracer's ``last_error`` says)."""
    from probing.errors import ProbingError

    hz = sample_hz()
    if not hz or not tracer.stacks or tracer._py is None:
        return None
    try:
        s = Sampler(
            tracer.store, hz=hz, holder=tracer.holder, known=tracer._py.known,
            target=tracer.target,
        )  # fmt: skip
        s.start()
        return s
    except ProbingError as err:
        tracer.last_error = f"no sampling: {err}"
        return None
