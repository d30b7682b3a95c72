"""What tracing costs, side by side in one run (root; prints one JSON object).

1. ns per call of libcudart's cudaLaunchKernel (entry probe) and
   cudaStreamSynchronize (entry + return), called from a C loop: no probe,
   a bare BCC uprobe (empty program), and probing's probe: without Python
   stacks (--no-stacks), with them (the default: the synchronising call
   walks, launches do not), and with --launch-stacks, the loop called from a
   Python stack of ~8 frames (as here) and of 40 (the walk stops at 32).
   ``*_stack_cost_ns``: the difference to --no-stacks.
2. Events/s drained from the ring buffer into the store (bulk numpy decode,
   Arrow batches, appends), the drain timer stopped so each round is timed.
3. A 2-rank torch Gloo all-reduce loop, untraced then traced, per rank.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CALLS = 200_000
ROUNDS = 5
REPEATS = 3


def build_loop(d: str) -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("needs a C compiler (make setup installs gcc)")
    out = f"{d}/libcall_loop.so"
    src = str(REPO / "benchmarks" / "call_loop.c")
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", out, src], check=True)
    lib = ctypes.CDLL(out)
    lib.launch_loop.restype = lib.sync_loop.restype = ctypes.c_double
    lib.launch_loop.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    lib.sync_loop.argtypes = [ctypes.c_void_p, ctypes.c_long]
    return lib


def cudart_path() -> str:
    from probing.bpf.tracer import installed_libraries

    for p in installed_libraries():
        if os.path.basename(p).startswith("libcudart"):
            return p
    raise SystemExit("libcudart not installed (make setup installs NVIDIA's wheels)")


def per_call(loop: ctypes.CDLL, cudart: ctypes.CDLL) -> dict[str, float]:
    launch = ctypes.cast(cudart.cudaLaunchKernel, ctypes.c_void_p).value
    sync = ctypes.cast(cudart.cudaStreamSynchronize, ctypes.c_void_p).value
    func = ctypes.cast(loop.launch_loop, ctypes.c_void_p).value
    return {
        "launch_ns": statistics.median(
            loop.launch_loop(launch, func, CALLS) for _ in range(ROUNDS)
        ),
        "sync_ns": statistics.median(loop.sync_loop(sync, CALLS // 4) for _ in range(ROUNDS)),
    }


def at_depth(depth: int, fn):  # type: ignore[no-untyped-def]
    """``fn()`` called with ``depth`` more Python frames on the stack."""
    if depth <= 0:
        return fn()
    return at_depth(depth - 1, fn)


def traced_per_call(  # type: ignore[no-untyped-def]
    loop: ctypes.CDLL, cudart: ctypes.CDLL, stacks: bool, launches: bool, depth: int = 0
):
    from probing.bpf.tracer import Tracer
    from probing.store import Store

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


def bare_uprobes(path: str):  # type: ignore[no-untyped-def]
    from bcc import BPF

    bpf = BPF(text="int empty(struct pt_regs *ctx) { return 0; }")
    pid = os.getpid()
    bpf.attach_uprobe(name=path.encode(), sym=b"cudaLaunchKernel", fn_name=b"empty", pid=pid)
    bpf.attach_uprobe(name=path.encode(), sym=b"cudaStreamSynchronize", fn_name=b"empty", pid=pid)
    bpf.attach_uretprobe(
        name=path.encode(), sym=b"cudaStreamSynchronize", fn_name=b"empty", pid=pid
    )
    return bpf


def drain_rate(loop: ctypes.CDLL, cudart: ctypes.CDLL) -> dict[str, float]:
    from probing.bpf.tracer import Tracer
    from probing.store import Store

    store = Store()
    tracer = Tracer(["cuda"], store=store, interval_s=3600)  # we drain, timed
    tracer.start()
    launch = ctypes.cast(cudart.cudaLaunchKernel, ctypes.c_void_p).value
    func = ctypes.cast(loop.launch_loop, ctypes.c_void_p).value
    rates, counts = [], []
    try:
        loop.launch_loop(launch, func, 150_000)  # first drain reads the stub's ELF symbols
        t0 = time.perf_counter()
        first = tracer.drain() / (time.perf_counter() - t0)
        for _ in range(ROUNDS):
            loop.launch_loop(launch, func, 150_000)  # < 16 MiB ring: nothing dropped
            t0 = time.perf_counter()
            n = tracer.drain()
            rates.append(n / (time.perf_counter() - t0))
            counts.append(n)
        dropped = tracer.status()["families"]["cuda"]["dropped"]
    finally:
        tracer.stop()
        store.close()
    return {"events_per_drain": statistics.median(counts), "events_per_s": statistics.median(rates),
            "first_drain_events_per_s": first, "dropped": dropped}  # fmt: skip


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
from probing.probe.context import ProbeContext
ctx = ProbeContext()
tr = ctx.start_trace(["gloo"])
dist.barrier()
traced = loop(2000)
events = tr.drain() + tr.status()["families"]["gloo"]["events"]
ctx.stop_trace()
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


def main() -> None:
    if os.geteuid() != 0:
        raise SystemExit("trace_bench needs root (BPF)")

    path = cudart_path()
    cudart = ctypes.CDLL(path)
    with tempfile.TemporaryDirectory() as d:
        loop = build_loop(d)
        result: dict = {"calls": CALLS, "rounds": ROUNDS}  # type: ignore[type-arg]
        result["no_probe"] = per_call(loop, cudart)
        bare = bare_uprobes(path)
        result["bare_uprobe"] = per_call(loop, cudart)
        bare.cleanup()
        # the three traced set-ups take turns (REPEATS times), so a noisy
        # neighbour on the machine does not land on one of them only
        configs = {  # (stacks, launch stacks, extra Python frames)
            "probing_no_stacks": (False, False, 0),
            "probing": (True, False, 0),  # the default: no walk at launches
            "probing_launch_stacks": (True, True, 0),
            "probing_launch_stacks_40_frames": (True, True, 32),
        }
        runs: dict[str, list[dict]] = {m: [] for m in configs}  # type: ignore[type-arg]
        for _ in range(REPEATS):
            for m, (stacks, launches, depth) in configs.items():
                runs[m].append(traced_per_call(loop, cudart, stacks, launches, depth))
        for m, rs in runs.items():
            result[m] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        for k in ("launch_ns", "sync_ns"):
            base, bare_ns, ours = (result[m][k] for m in ("no_probe", "bare_uprobe", "probing"))
            result[f"{k.removesuffix('_ns')}_probe_vs_bare"] = (ours - base) / max(
                bare_ns - base, 1e-9
            )
            plain = result["probing_no_stacks"][k]
            for m in configs:
                result[m][f"{k.removesuffix('_ns')}_stack_cost_ns"] = result[m][k] - plain
        result["drain"] = drain_rate(loop, cudart)
    result["gloo_allreduce"] = gloo_slowdown()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
