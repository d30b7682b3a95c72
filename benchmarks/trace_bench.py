"""What tracing costs, side by side in one run (root; prints one JSON object).

Sections (all by default; name some to run only those):

- calls: ns per call of libcudart's cudaLaunchKernel (entry probe) and
  cudaStreamSynchronize (entry + return), called from a C loop: no probe,
  a bare uprobe (an empty program on one perf-event uprobe, as BCC
  attaches), a bare multi-uprobe link, and probing's probe: without Python
  stacks (--no-stacks), with them (the default: the synchronising call
  walks, launches do not), and with --launch-stacks, the loop called from a
  Python stack of ~8 frames (as here) and of 40 (the walk stops at 32).
  ``*_stack_cost_ns``: the difference to --no-stacks; ``*_probe_vs_bare``:
  what the probe adds per call over what the bare uprobe adds;
  ``*_ratio_to_bare_uprobe``: the whole call with the probe over the whole
  call with the bare uprobe. ``*_cpu_ns``: the calling thread's CPU time per
  call (the uprobe runs there), steadier than wall time on a busy machine.
  Every set-up, the baselines too, takes turns REPEATS times
  (BENCH_REPEATS, default 3; 7 steadies the per-launch ratio).
  BENCH_CALLS_BASELINE=<git rev>: the whole section for that revision's
  probing/ and bpf/ and for this tree, each in a fresh process, taking turns
  twice (medians).
- walk: the probe's programs' own run time a call (the kernel's BPF
  stats), a launch and a synchronising call, without stacks and walked under
  ~7, ~15 and ~31 Python frames: what a Python stack's walk costs, without
  the uprobe's trap (BENCH_CALLS_BASELINE: side by side with that revision,
  REPEATS turns).
- helpers: what each thing a probe's program does costs on this host, as
  an empty uprobe's program on cudaLaunchKernel and as its own run time
  (the kernel's BPF stats): nothing, the clock, the thread id, a read of
  16 and of 104 bytes of the caller's stack (a launch reads its last two
  arguments so; a walk reads each frame so), a hash lookup, a per-CPU
  array lookup, a 104-byte ring-buffer output. The floor under the
  ``calls`` ratios: a launch's probe reads the clock, its thread and two
  arguments off the stack, whatever else it skips.
- drain: events/s drained from the ring buffer into the store (bulk numpy
  decode, Arrow batches, appends), the drain timer stopped so each round is
  timed; per wall second, per CPU second, and the CPU per event counting the
  compression left to the store's sealer. BENCH_DRAIN_BASELINE=<git rev>:
  the same for that revision's probing/ and this tree, taking turns (also
  for sustained, once each).
- sustained: launches at 1 M/s (BENCH_SUSTAIN_RATE) for 60 s
  (BENCH_SUSTAIN_S), drained by the tracer's timer; the BPF side's drops.
- gloo: a 2-rank torch Gloo all-reduce loop, untraced then traced, per rank.
- lifecycle: `probing trace --background` (empty cache, then again),
  `--stop`, and the exit after SIGTERM and SIGKILL, traced against untraced,
  with multi-uprobe links and with one perf-event uprobe per function.
- ranks: `probing trace --background` on 8 processes at once, empty cache
  and warm.
- step: a real CPU training step (2-rank Gloo DDP), untraced, traced by
  probing (defaults), by `py-spy record` and by the torch profiler, in
  interleaved phases of BENCH_STEPS steps (25), BENCH_STEP_ROUNDS times (3):
  median, p10-p90, slowdown. A tracer's start and py-spy's attach happen
  while the ranks step unmeasured ("settle").
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CALLS = 200_000
ROUNDS = 5
REPEATS = int(os.environ.get("BENCH_REPEATS", 3))  # every set-up takes turns this often


def build_loop(d: str) -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("needs a C compiler (make setup installs gcc)")
    out = f"{d}/libcall_loop.so"
    src = str(REPO / "benchmarks" / "call_loop.c")
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", out, src], check=True)
    lib = ctypes.CDLL(out)
    for suffix in ("", "_cpu"):  # wall ns per call, and the calling thread's CPU ns
        launch, sync = getattr(lib, f"launch_loop{suffix}"), getattr(lib, f"sync_loop{suffix}")
        launch.restype = sync.restype = ctypes.c_double
        launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
        sync.argtypes = [ctypes.c_void_p, ctypes.c_long]
    return lib


def cudart_path() -> str:
    sys.path.insert(0, str(REPO))  # the tests' look-up of NVIDIA's wheels
    from tests.jobs.lib_loop import installed_libraries

    for p in installed_libraries():
        if os.path.basename(p).startswith("libcudart"):
            return p
    raise SystemExit("libcudart not installed (make setup installs NVIDIA's wheels)")


def per_call(loop: ctypes.CDLL, cudart: ctypes.CDLL) -> dict[str, float]:
    """ns per call, wall (``*_ns``) and CPU time of the calling thread
    (``*_cpu_ns``: where the uprobe and its program run, and what a busy
    machine's other work does not inflate)."""
    launch = ctypes.cast(cudart.cudaLaunchKernel, ctypes.c_void_p).value
    sync = ctypes.cast(cudart.cudaStreamSynchronize, ctypes.c_void_p).value
    func = ctypes.cast(loop.launch_loop, ctypes.c_void_p).value
    return {
        "launch_ns": statistics.median(
            loop.launch_loop(launch, func, CALLS) for _ in range(ROUNDS)
        ),
        "sync_ns": statistics.median(loop.sync_loop(sync, CALLS // 4) for _ in range(ROUNDS)),
        "launch_cpu_ns": statistics.median(
            loop.launch_loop_cpu(launch, func, CALLS) for _ in range(ROUNDS)
        ),
        "sync_cpu_ns": statistics.median(
            loop.sync_loop_cpu(sync, CALLS // 4) for _ in range(ROUNDS)
        ),
    }


def bare_per_call(loop: ctypes.CDLL, cudart: ctypes.CDLL, path: str, multi: bool | None):  # type: ignore[no-untyped-def]
    """``per_call`` with no probe (``multi`` None) or an empty program's."""
    if multi is None:
        return per_call(loop, cudart)
    bare = BareUprobes(path, multi=multi)
    try:
        return per_call(loop, cudart)
    finally:
        bare.close()


def at_depth(depth: int, fn):  # type: ignore[no-untyped-def]
    """``fn()`` called with ``depth`` more Python frames on the stack."""
    if depth <= 0:
        return fn()
    return at_depth(depth - 1, fn)


def traced_per_call(  # type: ignore[no-untyped-def]
    loop: ctypes.CDLL, cudart: ctypes.CDLL, stacks: bool, launches: bool, depth: int = 0
):
    from probing.node.bpf.tracer import Tracer
    from probing.node.store import Store

    store = Store()
    tracer = Tracer(["cuda"], store=store, stacks=stacks, launch_stacks=launches)
    tracer.start()
    try:
        out = at_depth(depth, lambda: per_call(loop, cudart))
    finally:
        tracer.stop()
        store.close()
    status = tracer.status()
    out["events"] = status["families"]["cuda"]["events"]
    out["stacks_resolved"] = status["stacks_resolved"]
    return out


class BareUprobes:
    """An empty BPF program on cudaLaunchKernel and on cudaStreamSynchronize
    (entry and return): one perf-event uprobe each (what BCC attaches), or
    one multi-uprobe link per direction (what probing attaches, Linux >= 6.6)."""

    EMPTY = bytes([0xB7, 0, 0, 0, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0])  # r0 = 0; exit

    def __init__(self, path: str, multi: bool) -> None:
        from probing.node.bpf import kernel
        from probing.node.bpf.symbols import exported, file_offsets

        names = exported(path, ["cudaLaunchKernel", "cudaStreamSynchronize"])
        offs = file_offsets(path, names.values())
        launch, sync = (offs[names[n]] for n in ("cudaLaunchKernel", "cudaStreamSynchronize"))
        attach = kernel.TRACE_UPROBE_MULTI if multi else 0
        self.prog = kernel.prog_load("bare", self.EMPTY, expected_attach_type=attach)
        pid = os.getpid()
        if multi:
            self.fds = [
                kernel.uprobe_multi_link(self.prog, path, [launch, sync], [0, 0], pid, False),
                kernel.uprobe_multi_link(self.prog, path, [sync], [0], pid, True),
            ]
        else:
            self.fds = [
                kernel.perf_uprobe(self.prog, path, off, pid, ret)
                for off, ret in ((launch, False), (sync, False), (sync, True))
            ]

    def close(self) -> None:
        for fd in [*self.fds, self.prog]:
            os.close(fd)


# a program's body for each thing a probe does (``helpers``), in BCC's C
HELPERS = {
    "nothing": "return 0;",
    "clock": "return bpf_ktime_get_ns() & 0;",
    "thread": "return bpf_get_current_pid_tgid() & 0;",
    "read_16_bytes": "u64 b[2] = {}; bpf_probe_read_user(b, 16, (void *)PT_REGS_SP(ctx));"
    " return b[0] & 0;",
    "read_104_bytes": "u64 b[13] = {}; bpf_probe_read_user(b, 104, (void *)PT_REGS_SP(ctx));"
    " return b[0] & 0;",
    "hash_lookup": "u32 k = 5; return hash.lookup(&k) ? 1 : 0;",
    "percpu_array_lookup": "int z = 0; u64 *v = cpu.lookup(&z); if (v) *v += 1; return 0;",
    "ringbuf_output_104_bytes": "u64 b[13] = {}; ring.ringbuf_output(&b, 104, 1); return 0;",
}
HELPER_MAPS = (
    "BPF_RINGBUF_OUTPUT(ring, 64);\n"
    "BPF_PERCPU_ARRAY(cpu, u64, 1);\n"
    "BPF_HASH(hash, u32, u64, 8192);\n"
)
ENABLE_STATS = 32  # bpf(BPF_ENABLE_STATS): run time counted while its fd is open


class StatsAttr(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32)]  # BPF_STATS_RUN_TIME (0)


def helper_costs(loop: ctypes.CDLL, cudart: ctypes.CDLL, path: str) -> dict:  # type: ignore[type-arg]
    """Each of ``HELPERS`` as the program of a uprobe on cudaLaunchKernel:
    the launch's ns (fastest of REPEATS rounds) and the program's own ns a
    run (the kernel's BPF stats, on while measured; they add their clock
    reads, so ``nothing`` is the floor to subtract)."""
    from bcc import BPF

    from probing.node.bpf import kernel

    launch = ctypes.cast(cudart.cudaLaunchKernel, ctypes.c_void_p).value
    func = ctypes.cast(loop.launch_loop, ctypes.c_void_p).value
    out: dict = {}  # type: ignore[type-arg]
    stats = kernel.bpf(ENABLE_STATS, StatsAttr(0))
    try:
        for name, body in HELPERS.items():
            src = f"#include <uapi/linux/ptrace.h>\n{HELPER_MAPS}"
            src += f"int helper_cost(struct pt_regs *ctx) {{ {body} }}\n"
            b = BPF(text=src)
            try:
                b.attach_uprobe(name=path, sym="cudaLaunchKernel", fn_name="helper_cost",
                                pid=os.getpid())  # fmt: skip
                prog = b.load_func("helper_cost", BPF.KPROBE).fd
                before = _prog_stats(prog)
                ns = min(loop.launch_loop(launch, func, CALLS) for _ in range(REPEATS))
                after = _prog_stats(prog)
            finally:
                b.cleanup()
            runs = max(after[1] - before[1], 1)
            out[name] = {"launch_ns": ns, "program_ns": (after[0] - before[0]) / runs}
    finally:
        os.close(stats)
    for name in HELPERS:
        out[name]["program_over_nothing_ns"] = (
            out[name]["program_ns"] - out["nothing"]["program_ns"]
        )
    return out


def _prog_stats(fd: int) -> tuple[int, int]:
    """(run time ns, runs) of the BPF program ``fd``."""
    from probing.node.bpf import kernel

    class ProgInfo(ctypes.Structure):  # struct bpf_prog_info, up to run_cnt
        _fields_ = [("head", ctypes.c_uint8 * 192), ("run_time_ns", ctypes.c_uint64),
                    ("run_cnt", ctypes.c_uint64), ("tail", ctypes.c_uint8 * 256)]  # fmt: skip

    class InfoAttr(ctypes.Structure):
        _fields_ = [("fd", ctypes.c_uint32), ("len", ctypes.c_uint32), ("info", ctypes.c_uint64)]

    info = ProgInfo()
    attr = InfoAttr(fd, ctypes.sizeof(info), ctypes.addressof(info))
    kernel.bpf(kernel.OBJ_GET_INFO_BY_FD, attr)
    return info.run_time_ns, info.run_cnt


PROG_GET_NEXT_ID, PROG_GET_FD_BY_ID = 11, 13  # bpf() commands
WALK_DEPTHS = (0, 8, 24)  # Python frames added to the ~7 of the benchmark's own calls


def _prog_ids() -> set[int]:
    """The ids of every BPF program loaded now."""
    from probing.node.bpf import kernel

    ids, out = kernel.IdAttr(0, 0), set()
    while True:
        try:
            kernel.bpf(PROG_GET_NEXT_ID, ids)
        except kernel.BPFError:  # ENOENT: the last one
            return out
        ids.id = ids.next_id
        out.add(ids.id)


def walk_costs(loop: ctypes.CDLL, cudart: ctypes.CDLL) -> dict[str, float]:
    """The probe's programs' own run time a call (the kernel's BPF stats:
    not the uprobe's trap, and less of a busy machine's noise): a launch and a
    synchronising call (entry and return), without stacks, and with them
    (--launch-stacks: launches walk too) called under ~7, ~15 and ~31
    Python frames; ns a call, the median of REPEATS rounds."""
    from probing.node.bpf import kernel
    from probing.node.bpf.tracer import Tracer
    from probing.node.store import Store

    launch = ctypes.cast(cudart.cudaLaunchKernel, ctypes.c_void_p).value
    sync = ctypes.cast(cudart.cudaStreamSynchronize, ctypes.c_void_p).value
    func = ctypes.cast(loop.launch_loop, ctypes.c_void_p).value
    calls = {
        "launch": (lambda: loop.launch_loop(launch, func, CALLS), CALLS),
        "sync": (lambda: loop.sync_loop(sync, CALLS // 4), CALLS // 4),
    }
    out: dict[str, float] = {}
    stats = kernel.bpf(ENABLE_STATS, StatsAttr(0))
    try:
        for stacks in (False, True):
            before = _prog_ids()
            store = Store()
            tracer = Tracer(["cuda"], store=store, stacks=stacks, launch_stacks=stacks)
            tracer.start()
            fds = [kernel.bpf(PROG_GET_FD_BY_ID, kernel.IdAttr(i, 0)) for i in _prog_ids() - before]
            try:
                for depth in WALK_DEPTHS if stacks else (0,):
                    for name, (call, n) in calls.items():
                        runs = []
                        for _ in range(REPEATS):
                            ns = sum(_prog_stats(fd)[0] for fd in fds)
                            at_depth(depth, call)
                            runs.append((sum(_prog_stats(fd)[0] for fd in fds) - ns) / n)
                        key = f"{name}_{'walked_depth_' + str(depth) if stacks else 'no_stacks'}_ns"
                        out[key] = statistics.median(runs)
            finally:
                for fd in fds:
                    os.close(fd)
                tracer.stop()
                store.close()
    finally:
        os.close(stats)
    return out


SUSTAIN_S = float(os.environ.get("BENCH_SUSTAIN_S", 60))
SUSTAIN_RATE = int(float(os.environ.get("BENCH_SUSTAIN_RATE", 1_000_000)))
DRAIN_EVENTS = 150_000  # a round's burst: < the cuda ring (16 MiB before 46a4b85, 104 B/event)


def _launcher(loop: ctypes.CDLL, cudart: ctypes.CDLL):  # type: ignore[no-untyped-def]
    launch = ctypes.cast(cudart.cudaLaunchKernel, ctypes.c_void_p).value
    func = ctypes.cast(loop.launch_loop, ctypes.c_void_p).value
    return lambda n: loop.launch_loop(launch, func, n)


def sustained_drain(loop: ctypes.CDLL, cudart: ctypes.CDLL) -> dict:  # type: ignore[type-arg]
    """Launches at SUSTAIN_RATE/s for SUSTAIN_S seconds through the real uprobe
    and ring buffer, drained by the tracer's own timer thread: the producer
    (a C loop, called every 10 ms) makes up for a late slice in the next one,
    so it holds the rate wherever the CPU allows; drops are the BPF side's
    count (the ``dropped`` map: a full ring), events what reached the store."""
    from probing.node.bpf.tracer import Tracer
    from probing.node.store import Store

    store = Store()
    tracer = Tracer(["cuda"], store=store)
    tracer.start()
    run = _launcher(loop, cudart)
    produced, behind_max = 0, 0
    load0 = os.getloadavg()
    c0 = time.process_time()
    t0 = time.perf_counter()
    try:
        while (now := time.perf_counter() - t0) < SUSTAIN_S:
            due = int(SUSTAIN_RATE * now) - produced
            behind_max = max(behind_max, due)
            n = min(due, SUSTAIN_RATE // 20)  # at most 50 ms of events in one call
            if n > 0:
                run(n)
                produced += n
            time.sleep(0.01)
        elapsed = time.perf_counter() - t0
    finally:
        tracer.stop()
    cpu = time.process_time() - c0
    cuda = tracer.status()["families"]["cuda"]
    stats = store.table("cuda", "calls").stats()
    store.close()
    return {"target_events_per_s": SUSTAIN_RATE, "seconds": round(elapsed, 2),
            "saved_by_a_retry": cuda.get("saved"),  # None: a tree before retries
            "achieved_events_per_s": round(produced / elapsed), "launched": produced,
            "producer_most_behind_events": behind_max,
            "events": cuda["events"], "dropped": cuda["dropped"],
            "rows_in_store": stats.rows + stats.retired_rows,
            "process_cpu_s": round(cpu, 2), "loadavg_before": load0,
            "loadavg_after": os.getloadavg()}  # fmt: skip


def drain_rate(loop: ctypes.CDLL, cudart: ctypes.CDLL) -> dict:  # type: ignore[type-arg]
    """Bursts of DRAIN_EVENTS launches, each drained by one timed call (the
    timer thread idle): events/s in wall time, and per CPU second of the
    draining thread; then the sealing (compression) the drains left to the
    store, so ``all_cpu_ns_per_event`` is the whole cost of an event.
    ``host_thread_longest_wait_ms``: the longest a Python thread that wakes
    every ms waited for the GIL (and a CPU) while the drains ran."""
    from probing.node.bpf.tracer import Tracer
    from probing.node.store import Store

    store = Store()
    tracer = Tracer(["cuda"], store=store, interval_s=3600)  # we drain, timed
    tracer.start()
    run = _launcher(loop, cudart)
    rates, cpu_rates, counts = [], [], []
    ticking, done, waits = threading.Event(), threading.Event(), [0.0]

    def host_thread() -> None:  # a host's Python thread, wanting the GIL every ms
        while not done.is_set():
            if not ticking.wait(0.1):
                continue
            t = time.perf_counter()
            time.sleep(0.001)
            if ticking.is_set():
                waits[0] = max(waits[0], time.perf_counter() - t - 0.001)

    ticker = threading.Thread(target=host_thread, daemon=True)
    ticker.start()
    try:
        run(DRAIN_EVENTS)  # the first drain reads the stub's ELF symbols: not timed
        tracer.drain()
        table = store.table("cuda", "calls")
        table.flush()
        # the process's CPU from here to the last flush, less the producer's
        all_cpu = -time.process_time()
        for _ in range(ROUNDS):
            c0 = time.thread_time()
            run(DRAIN_EVENTS)
            all_cpu -= time.thread_time() - c0
            ticking.set()
            t0, c0 = time.perf_counter(), time.thread_time()
            n = tracer.drain()
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            ticking.clear()
            rates.append(n / wall)
            cpu_rates.append(n / cpu)
            counts.append(n)
        table.flush()  # and wait for the sealer thread (where there is one)
        all_cpu += time.process_time()
        dropped = tracer.status()["families"]["cuda"]["dropped"]
    finally:
        done.set()
        tracer.stop()
        store.close()
    return {"events_per_drain": statistics.median(counts),
            "host_thread_longest_wait_ms": round(waits[0] * 1e3, 1),
            "events_per_s": round(statistics.median(rates)),
            "events_per_cpu_s": round(statistics.median(cpu_rates)),
            "all_cpu_ns_per_event": round(all_cpu / sum(counts) * 1e9, 1),
            "dropped": dropped, "loadavg": os.getloadavg()}  # fmt: skip


def side_by_side(rev: str, section: str = "drain_rate", repeats: int = REPEATS) -> dict:  # type: ignore[type-arg]
    """``section`` (drain_rate, sustained_drain) of this tree and of ``rev``
    (git archive of its probing/ and bpf/), each in a fresh process, taking
    turns ``repeats`` times; medians of the numbers."""
    with tempfile.TemporaryDirectory() as d:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", rev, "probing", "bpf"],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", d], input=archive, check=True)
        code = (
            "import json, sys, tempfile, ctypes; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
            "import trace_bench as tb\n"
            "import probing; assert probing.__file__.startswith(sys.argv[1]), probing.__file__\n"
            "with tempfile.TemporaryDirectory() as d:\n"
            "    r = getattr(tb, sys.argv[3])(tb.build_loop(d), ctypes.CDLL(tb.cudart_path()))\n"
            "print(json.dumps(r))\n"
        )
        runs: dict[str, list[dict]] = {rev: [], "this tree": []}  # type: ignore[type-arg]
        for _ in range(repeats):
            for name, tree in ((rev, d), ("this tree", str(REPO))):
                out = subprocess.run(
                    [sys.executable, "-c", code, tree, str(REPO / "benchmarks"), section],
                    check=True, capture_output=True, text=True, cwd=tree,
                ).stdout  # fmt: skip
                runs[name].append(json.loads(out.splitlines()[-1]))
    return {
        name: {
            k: statistics.median(r[k] for r in rs)
            for k, v in rs[0].items()
            if isinstance(v, (int, float))
        }
        | {"runs": len(rs)}
        for name, rs in runs.items()
    } | {"loadavg": os.getloadavg()}


GLOO_RANK = """
import json, os, sys, time
import torch, torch.distributed as dist
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
t = torch.ones(1024)
def loop(n):
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    return (time.perf_counter() - t0) / n * 1e6
for _ in range(50):
    dist.all_reduce(t)
base = loop(2000)
import probing
probing.enable()  # the guest, handed to the node's engine, which traces this rank
from _probing_guest import life, wire
sock = life.current().engine["socket"]
wire.request(sock, "POST", "/trace/start", {"families": ["gloo"]}, timeout=120)
dist.barrier()
traced = loop(2000)
status = wire.request(sock, "POST", "/trace/stop", None, timeout=120)  # drained first
events = status["families"]["gloo"]["events"]
print(json.dumps({"rank": rank, "untraced_us": base, "traced_us": traced, "events": events}))
"""


def gloo_slowdown() -> list[dict]:  # type: ignore[type-arg]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GLOO_RANK, str(r), port], stdout=subprocess.PIPE, text=True
        )  # fmt: skip
        for r in range(2)
    ]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=300)
        r = json.loads(stdout.strip().splitlines()[-1])
        r["slowdown"] = r["traced_us"] / r["untraced_us"]
        out.append(r)
    return out


# -- on and off: attach, stop, exit -----------------------------------------------------

LIB_LOOP = REPO / "tests" / "jobs" / "lib_loop.py"
EXIT_REPEATS = 3


class Targets:
    """lib_loop.py processes (libcudart and libnccl mapped) with a probe each."""

    def __init__(self, env: dict[str, str]) -> None:
        self.rt = tempfile.mkdtemp(prefix="probing-bench-rt-")
        self.env = dict(env, PROBING_RUNTIME_DIR=self.rt, PYTHONPATH=str(REPO))
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(self, n: int = 1, probe: bool = True) -> list[subprocess.Popen[str]]:
        env = dict(self.env, PROBING="1" if probe else "0")
        new = [
            subprocess.Popen(
                [sys.executable, str(LIB_LOOP)], env=env, stdout=subprocess.PIPE, text=True
            )  # fmt: skip
            for _ in range(n)
        ]
        for p in new:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            sock = os.path.join(self.rt, f"probing-{os.getuid()}", f"{p.pid}.sock")
            while probe and not os.path.exists(sock):
                time.sleep(0.01)
        self.procs += new
        return new

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        shutil.rmtree(self.rt, ignore_errors=True)


def cli_s(env: dict[str, str], *args: str) -> float:
    """Wall seconds of one ``probing`` command (it must succeed)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "probing", *args], env=env, capture_output=True,
                         text=True)  # fmt: skip
    took = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"probing {' '.join(args)} failed: {out.stderr}")
    return took


def exit_s(p: subprocess.Popen[str], sig: int) -> float:
    """Seconds from ``sig`` to the process reaped."""
    t0 = time.perf_counter()
    p.send_signal(sig)
    p.wait()
    return time.perf_counter() - t0


def _med(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs)}


def lifecycle(multi: bool) -> dict:  # type: ignore[type-arg]
    """One attach mode: `probing trace --background` with an empty cache and
    again, `--stop`, and the exit after SIGTERM/SIGKILL, traced and not."""
    import signal

    from probing.node.bpf import loader

    cache = tempfile.mkdtemp(prefix="probing-bench-cache-")
    env = dict(os.environ, **{loader.ENV_CACHE: cache})
    if not multi:
        env[loader.ENV_MULTI] = "0"
    ts = Targets(env)
    fams = ("--no-gloo",)  # cuda + nccl: the libraries lib_loop.py maps
    out: dict = {}  # type: ignore[type-arg]
    try:
        (t,) = ts.spawn()
        pid = str(t.pid)
        out["trace_first_s"] = cli_s(ts.env, "trace", "--pid", pid, "--background", *fams)
        status = json.loads(subprocess.run(
            [sys.executable, "-m", "probing", "query", "--pid", pid, "-f", "json",
             "SELECT count(*) AS n FROM probing.uprobes WHERE attached"],
            env=ts.env, capture_output=True, text=True).stdout or "[{}]")  # fmt: skip
        out["uprobes"] = status[0].get("n")
        out["stop_s"] = cli_s(ts.env, "trace", "--pid", pid, "--stop")
        again, stops = [], []
        for _ in range(EXIT_REPEATS):
            again.append(cli_s(ts.env, "trace", "--pid", pid, "--background", *fams))
            stops.append(cli_s(ts.env, "trace", "--pid", pid, "--stop"))
        out["trace_again"] = _med(again)
        out["stop"] = _med(stops)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            untraced, traced = [], []
            for _ in range(EXIT_REPEATS):
                (u,) = ts.spawn()
                untraced.append(exit_s(u, sig))
                (p,) = ts.spawn()
                cli_s(ts.env, "trace", "--pid", str(p.pid), "--background", *fams)
                traced.append(exit_s(p, sig))
            out[f"exit_{sig.name}"] = {
                "untraced": _med(untraced),
                "traced": _med(traced),
                "traced_minus_untraced_s": statistics.median(traced) - statistics.median(untraced),
            }
    finally:
        ts.close()
        shutil.rmtree(cache, ignore_errors=True)
    return out


def ranks_together(n: int = 8) -> dict:  # type: ignore[type-arg]
    """`probing trace --background` on ``n`` processes at once: with an empty
    cache (one compiles, the others wait for it) and with a warm one."""
    from probing.node.bpf import loader

    cache = tempfile.mkdtemp(prefix="probing-bench-cache-")
    ts = Targets(dict(os.environ, **{loader.ENV_CACHE: cache}))
    out: dict = {"ranks": n}  # type: ignore[type-arg]
    try:
        procs = ts.spawn(n)

        def all_at_once(*args: str) -> float:
            t0 = time.perf_counter()
            running = [
                subprocess.Popen(
                    [sys.executable, "-m", "probing", "trace", "--pid", str(p.pid), *args],
                    env=ts.env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )  # fmt: skip
                for p in procs
            ]
            for r in running:
                _, err = r.communicate()
                if r.returncode != 0:
                    raise SystemExit(f"probing trace failed: {err}")
            return time.perf_counter() - t0

        out["cold_cache_ready_s"] = all_at_once("--background", "--no-gloo")
        out["stop_all_s"] = all_at_once("--stop")
        out["warm_cache_ready_s"] = all_at_once("--background", "--no-gloo")
        all_at_once("--stop")
    finally:
        ts.close()
        shutil.rmtree(cache, ignore_errors=True)
    return out


# -- the traced step ------------------------------------------------------------------

STEP_JOB = """
import os, sys, time
import torch, torch.distributed as dist
from torch import nn
rank, ctl = int(os.environ["RANK"]), sys.argv[1]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                  nn.Linear(512, 16)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 16, (64,))
prof, mode, step = None, "", 0
print("ready", flush=True)
while True:
    with open(ctl) as f:
        want = f.read().strip()
    if want == "quit":
        break
    label = want
    if want != mode:  # the step that switches is no one's
        label = "switch"
        if prof is not None:
            prof.__exit__(None, None, None)
            prof = None
        if want == "torch_profiler":
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        mode = want
    t0 = time.perf_counter()
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if prof is not None:
        prof.step()
    print(f"step {step} {label} {time.perf_counter() - t0:.6f}", flush=True)
    step += 1
dist.destroy_process_group()
"""
STEP_MODES = ("untraced", "probing", "py_spy_record", "torch_profiler")
STEPS_PER_PHASE = int(os.environ.get("BENCH_STEPS", 25))
STEP_ROUNDS = int(os.environ.get("BENCH_STEP_ROUNDS", 3))


def traced_step() -> dict:  # type: ignore[type-arg]
    """A real CPU training step (2-rank Gloo DDP, 3-layer MLP), untraced and
    traced by probing (defaults: every family, Python stacks on), by
    ``py-spy record`` (100 Hz) and by the torch profiler, in interleaved
    phases of STEPS_PER_PHASE steps, STEP_ROUNDS times; per mode the median
    step time, the spread (p10-p90) and the slowdown against untraced."""
    import queue
    import signal
    import socket
    import threading

    from probing.cli.client import ProbeClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tempfile.mkdtemp(prefix="probing-bench-step-")
    ctl = os.path.join(work, "mode")
    with open(ctl, "w") as f:
        f.write("warmup")
    rt = os.path.join(work, "rt")
    os.makedirs(rt)
    os.environ["PROBING_RUNTIME_DIR"] = rt
    lines: queue.Queue = queue.Queue()  # type: ignore[type-arg]
    ranks = []
    for r in range(2):
        env = dict(os.environ, PROBING="1", RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), LOCAL_RANK=str(r))  # fmt: skip
        p = subprocess.Popen([sys.executable, "-c", STEP_JOB, ctl], env=env,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
        ranks.append(p)

        def pump(p: subprocess.Popen = p, r: int = r) -> None:  # type: ignore[type-arg]
            assert p.stdout is not None
            for line in p.stdout:
                lines.put((r, line.split()))

        threading.Thread(target=pump, daemon=True).start()
    times: dict[str, list[float]] = {m: [] for m in STEP_MODES}

    def steps_of(label: str, n: int, record: bool) -> None:
        """``n`` steps of each rank labelled ``label`` (their times kept
        when ``record``); a line of any other label (a step of a set-up, or
        one still queued from before) is dropped."""
        seen = 0
        while seen < 2 * n:
            _, parts = lines.get(timeout=300)
            if len(parts) == 4 and parts[0] == "step" and parts[2] == label:
                if record:
                    times[label].append(float(parts[3]))
                seen += 1

    def phase(mode: str) -> None:
        """STEPS_PER_PHASE steps of each rank under ``mode``, timed."""
        with open(ctl, "w") as f:
            f.write(mode)
        steps_of(mode, STEPS_PER_PHASE, record=True)

    def settled(steps: int, setup: Callable[[], object] = lambda: None) -> None:
        """``setup`` (a tracer starting, py-spy attaching) while the ranks
        step as "settle", then ``steps`` more such steps: none of them is
        measured, and nothing measured later comes from before."""
        with open(ctl, "w") as f:
            f.write("settle")
        setup()
        steps_of("settle", steps, record=False)

    def wait_steps(n: int) -> None:
        for _ in range(n):
            lines.get(timeout=300)

    try:
        for p in ranks:
            sock = os.path.join(rt, f"probing-{os.getuid()}", f"{p.pid}.sock")
            while not os.path.exists(sock):
                time.sleep(0.05)
        wait_steps(40)  # warm up
        clients = [ProbeClient.for_pid(p.pid) for p in ranks]
        pyspy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        for _ in range(STEP_ROUNDS):
            settled(3)
            phase("untraced")
            # the tracer attached and warm (first drain, sampler) before it is timed
            settled(5, lambda: [c.trace_start(["nccl", "cuda", "gloo"]) for c in clients])
            phase("probing")
            settled(3, lambda: [c.trace_stop() for c in clients])
            if os.access(pyspy, os.X_OK):
                spies: list[subprocess.Popen] = []  # type: ignore[type-arg]

                def attach(spies: list[subprocess.Popen] = spies) -> None:  # type: ignore[type-arg]
                    spies.extend(
                        subprocess.Popen([pyspy, "record", "--pid", str(p.pid), "--rate", "100",
                                          "--format", "raw", "-o",
                                          os.path.join(work, f"{p.pid}.txt")],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        for p in ranks
                    )  # fmt: skip
                    time.sleep(2)  # py-spy attached and sampling

                settled(3, attach)
                phase("py_spy_record")

                def detach(spies: list[subprocess.Popen] = spies) -> None:  # type: ignore[type-arg]
                    for spy in spies:
                        spy.send_signal(signal.SIGINT)
                        spy.wait(timeout=60)

                settled(3, detach)
            phase("torch_profiler")
        with open(ctl, "w") as f:
            f.write("quit")
        for p in ranks:
            p.wait(timeout=60)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(times["untraced"])
    out: dict = {"ranks": 2, "steps_per_phase_per_rank": STEPS_PER_PHASE, "rounds": STEP_ROUNDS}  # type: ignore[type-arg]
    for mode, xs in times.items():
        if not xs:
            out[mode] = None  # py-spy missing: pip install the bench extra
            continue
        qs = statistics.quantiles(xs, n=10)
        out[mode] = {
            "median_ms": statistics.median(xs) * 1e3,
            "p10_ms": qs[0] * 1e3,
            "p90_ms": qs[-1] * 1e3,
            "steps": len(xs),
            "slowdown": statistics.median(xs) / base,
        }
    return out


SECTIONS = ("calls", "walk", "helpers", "drain", "sustained", "gloo", "lifecycle", "ranks", "step")


def main() -> None:
    if os.geteuid() != 0:
        raise SystemExit("trace_bench needs root (BPF)")
    only = sys.argv[1:] or SECTIONS  # e.g. `trace_bench.py lifecycle ranks`
    unknown = set(only) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)} (known: {', '.join(SECTIONS)})")
    from probing.node.bpf import loader

    result: dict = {"uprobe_multi_available": loader.has_uprobe_multi()}  # type: ignore[type-arg]
    path = cudart_path()
    cudart = ctypes.CDLL(path)
    with tempfile.TemporaryDirectory() as d:
        loop = build_loop(d)
        if "calls" in only:
            baseline = os.environ.get("BENCH_CALLS_BASELINE")  # a git revision
            if baseline:
                result["calls_side_by_side"] = side_by_side(baseline, "calls_flat", 2)
            else:
                result.update(calls_section(loop, cudart, path))
        if "walk" in only:
            baseline = os.environ.get("BENCH_CALLS_BASELINE")
            if baseline:
                result["walk_side_by_side"] = side_by_side(baseline, "walk_costs")
            else:
                result["walk"] = walk_costs(loop, cudart)
        if "helpers" in only:
            result["helpers"] = helper_costs(loop, cudart, path)
        if "drain" in only:
            baseline = os.environ.get("BENCH_DRAIN_BASELINE")  # a git revision
            if baseline:
                result["drain_side_by_side"] = side_by_side(baseline)
            else:
                result["drain"] = drain_rate(loop, cudart)
        if "sustained" in only:
            baseline = os.environ.get("BENCH_DRAIN_BASELINE")
            if baseline:
                result["sustained_side_by_side"] = side_by_side(baseline, "sustained_drain", 1)
            else:
                result["drain_sustained"] = sustained_drain(loop, cudart)
    if "gloo" in only:
        result["gloo_allreduce"] = gloo_slowdown()
    if "lifecycle" in only:
        result["lifecycle_multi_uprobe_links"] = lifecycle(True)
        result["lifecycle_single_uprobes"] = lifecycle(False)
    if "ranks" in only:
        result["eight_ranks_together"] = ranks_together(8)
    if "step" in only:
        result["traced_step"] = traced_step()
    print(json.dumps(result, indent=1))


def calls_section(loop: ctypes.CDLL, cudart: ctypes.CDLL, path: str) -> dict:  # type: ignore[type-arg]
    from probing.node.bpf import loader

    result: dict = {"calls": CALLS, "rounds": ROUNDS}  # type: ignore[type-arg]
    # every set-up takes turns (REPEATS times), the baselines too, so a noisy
    # neighbour on the machine does not land on one of them only
    bare = {"no_probe": None, "bare_uprobe": False}  # multi: None = no probe
    if loader.has_uprobe_multi():
        bare["bare_multi_uprobe_link"] = True
    configs = {  # (stacks, launch stacks, extra Python frames)
        "probing_no_stacks": (False, False, 0),
        "probing": (True, False, 0),  # the default: no walk at launches
        "probing_launch_stacks": (True, True, 0),
        "probing_launch_stacks_40_frames": (True, True, 32),
    }
    runs: dict[str, list[dict]] = {m: [] for m in [*bare, *configs]}  # type: ignore[type-arg]
    for _ in range(REPEATS):
        for m, multi in bare.items():
            runs[m].append(bare_per_call(loop, cudart, path, multi))
        for m, (stacks, launches, depth) in configs.items():
            runs[m].append(traced_per_call(loop, cudart, stacks, launches, depth))
    for m, rs in runs.items():
        result[m] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    for k in ("launch_ns", "sync_ns", "launch_cpu_ns", "sync_cpu_ns"):
        name = k.removesuffix("_ns")
        base, bare_ns, ours = (result[m][k] for m in ("no_probe", "bare_uprobe", "probing"))
        # per call, what the probe adds over no probe, against what an empty uprobe adds
        result[f"{name}_probe_vs_bare"] = (ours - base) / max(bare_ns - base, 1e-9)
        # the whole call with the probe, against the whole call with an empty uprobe
        # (the "per-launch cost <= 1.2x a bare uprobe")
        result[f"{name}_ratio_to_bare_uprobe"] = ours / max(bare_ns, 1e-9)
        plain = result["probing_no_stacks"][k]
        for m in configs:
            result[m][f"{name}_stack_cost_ns"] = result[m][k] - plain
    return result


def calls_flat(loop: ctypes.CDLL, cudart: ctypes.CDLL) -> dict[str, float]:
    """``calls_section``'s numbers in one level ("probing.sync_cpu_ns"), for
    ``side_by_side``."""
    out: dict[str, float] = {}
    for k, v in calls_section(loop, cudart, cudart_path()).items():
        if isinstance(v, dict):
            out.update({f"{k}.{name}": x for name, x in v.items()})
        else:
            out[k] = v
    return out


if __name__ == "__main__":
    main()
