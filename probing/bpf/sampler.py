"""Where this process's threads spend their wall-clock time, by Python stack.

``Sampler`` loads ``programs/sampler.bpf.c`` while the tracer traces: CPU-clock
perf events sample what runs on every CPU (``SAMPLE_HZ``) and the
``sched_switch`` raw tracepoint charges the time each thread of this process
spends off a CPU to the stack it left with, as blocked (``off``) or waiting
for a CPU (``runq``: it left runnable). The kernel keeps running totals per
(thread, stack, kind); a thread of ours reads them every ``interval_s`` and
appends the differences to ``python.samples``, plus one ``tick`` row per read
(its ``dur_ns``: the wall time that read covers). Stacks resolve into
``python.stacks`` like the families' (``PyStacks``). The probe's own threads
are left out. ``PROBING_SAMPLE_HZ=0`` turns sampling off.
"""

from __future__ import annotations

import ctypes
import importlib.resources
import os
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from probing.errors import BPFUnavailable

SAMPLE_HZ = 199  # per CPU; not a multiple of the kernel's tick
DEFAULT_INTERVAL_S = 0.5
KINDS = ("cpu", "off", "runq")  # sampler.h KIND_*; "tick": one row per read
SAMPLES_MAX = 16384

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
        self, store: Any, *, hz: int = SAMPLE_HZ, interval_s: float = DEFAULT_INTERVAL_S
    ) -> None:
        from probing.bpf.pystacks import PyStacks

        self.store = store
        self.hz = hz
        self.period_ns = 1_000_000_000 // max(hz, 1)
        self.interval_s = interval_s
        self.pid = os.getpid()
        self.table = store.table("python", "samples", SCHEMA)
        self.py = PyStacks(store)
        self.bpf: Any = None
        self.reads = 0
        self.dropped = 0
        self.last_error: str | None = None
        self._prev: dict[tuple[int, int, int], tuple[int, int]] = {}
        self._last_read = 0
        self._ours: set[int] = set()  # the probe's own threads, left out
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        from bcc import BPF, PerfSWConfig, PerfType  # type: ignore[import-not-found]

        ref = importlib.resources.files("probing.bpf") / "programs"  # bpf/*.bpf.c
        with importlib.resources.as_file(ref) as src:
            cflags = [
                f"-I{src}",
                f"-DTARGET_TGID={self.pid}",
                f"-DSAMPLE_NS={self.period_ns}ULL",
                f"-DSAMPLES_MAX={SAMPLES_MAX}",
                "-Wno-unused-function",
                *self.py.cflags(),
            ]
            try:
                bpf = BPF(src_file=os.path.join(src, "sampler.bpf.c").encode(), cflags=cflags)
            except Exception as err:  # BCC raises plain Exception
                raise BPFUnavailable(
                    f"BCC could not compile sampler.bpf.c: {err}",
                    pid=self.pid,
                    hint="run `probing doctor`; PROBING_SAMPLE_HZ=0 traces without sampling",
                ) from err
        import atexit

        atexit.unregister(bpf.cleanup)
        try:
            bpf.attach_perf_event(
                ev_type=PerfType.SOFTWARE,
                ev_config=PerfSWConfig.CPU_CLOCK,
                fn_name=b"on_cpu",
                sample_period=self.period_ns,
            )
        except Exception as err:
            bpf.cleanup()
            raise BPFUnavailable(
                f"cannot open CPU-clock perf events: {err}",
                pid=self.pid,
                hint="check /proc/sys/kernel/perf_event_paranoid; PROBING_SAMPLE_HZ=0 "
                "traces without sampling",
            ) from err
        self.bpf = bpf
        self.py.sync([bpf])
        self._last_read = time.monotonic_ns()
        self.table.add_before_read(self.read)
        self._thread = threading.Thread(target=self._run, name="probing-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Read what is left and unload. Safe twice."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.table.remove_before_read(self.read)
        try:
            self.read()
        finally:
            with self._lock:
                bpf, self.bpf = self.bpf, None
            if bpf is not None:
                bpf.cleanup()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.read()
            except Exception as err:  # never reaches the host; shown in status
                self.last_error = f"{type(err).__name__}: {err}"

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
        names = {t.native_id: t.name for t in threading.enumerate()}
        self._ours |= {tid for tid, name in names.items() if name.startswith("probing")}
        ours = self._ours
        m = bpf["samples"]
        rows: dict[str, list[Any]] = {f.name: [] for f in SCHEMA}

        def put(tid: int, sid: int, kind: str, count: int, ns: int) -> None:
            for k, v in zip(
                SCHEMA.names, (now, tid, names.get(tid), sid, kind, count, ns), strict=True
            ):
                rows[k].append(v)

        put(0, 0, "tick", 1, now_mono - self._last_read)
        self._last_read = now_mono
        cur = {
            (int(k.tid), int(k.stack_id), int(k.kind)): (int(v.count), int(v.ns))
            for k, v in m.items()
        }
        for key, (count, ns) in cur.items():
            pc, pn = self._prev.get(key, (0, 0))
            if count > pc and key[0] not in ours and key[2] < len(KINDS):
                put(key[0], key[1], KINDS[key[2]], count - pc, ns - pn)
        self._prev = cur
        if len(cur) > SAMPLES_MAX // 2:  # start over before the map fills
            m.clear()
            self._prev = {}
        self.dropped = int(bpf["dropped"][ctypes.c_int(0)].value)
        self.py.collect(bpf, np.array(rows["stack_id"], dtype=np.uint32))
        self.table.append_batch(pa.RecordBatch.from_pydict(rows, schema=SCHEMA))
        self.reads += 1
        return len(rows["ts"])

    def status(self) -> dict[str, Any]:
        return {"hz": self.hz, "reads": self.reads, "dropped": self.dropped,
                "last_error": self.last_error}  # fmt: skip


def start_for(tracer: Any) -> Sampler | None:
    """A running sampler for ``tracer``'s process, or None (sampling off, no
    Python stacks, or it could not start: the tracer's ``last_error`` says)."""
    from probing.errors import ProbingError

    hz = sample_hz()
    if not hz or not tracer.stacks or tracer._py is None:
        return None
    try:
        s = Sampler(tracer.store, hz=hz)
        s.start()
        return s
    except ProbingError as err:
        tracer.last_error = f"no sampling: {err}"
        return None
