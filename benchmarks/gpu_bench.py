"""What tracing costs a real GPU job, side by side in one run (root, an
NVIDIA GPU, torch with CUDA; prints one JSON object).

A one-rank NCCL job (torch.distributed, the libnccl and libcudart torch
loads) times two loops, each ended by a device synchronise:
  launch: ``t.add_(1)`` on a 4 KiB tensor (one cudaLaunchKernel per step)
  step:   ``t.add_(1); all_reduce(t)`` (a launch and an ncclAllReduce)
untraced, traced without Python stacks, traced with them (the default), and
with --launch-stacks. The modes alternate within each repeat so drift hits
them alike; medians over the repeats.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS = 20_000
REPEATS = 5

JOB = """
import json, sys, time, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
t = torch.zeros(1024, device="cuda")

def launch(n):
    for _ in range(n):
        t.add_(1.0)

def step(n):
    for _ in range(n):
        t.add_(1.0)
        dist.all_reduce(t)

for f in (launch, step):  # warm: NCCL's communicator, the caching allocator
    f(200)
torch.cuda.synchronize()
print("ready", flush=True)
for line in sys.stdin:
    n, out = int(line), {}
    for f in (launch, step):
        t0 = time.perf_counter_ns()
        f(n)
        torch.cuda.synchronize()
        out[f.__name__] = (time.perf_counter_ns() - t0) / n
    print(json.dumps(out), flush=True)
"""

MODES = {
    "untraced": None,
    "no stacks": {"stacks": False},
    "stacks (default)": {"stacks": True},
    "launch stacks": {"stacks": True, "launch_stacks": True},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    sys.path.insert(0, str(REPO))
    from probing.cli.client import ProbeClient
    from probing.cli.doctor import check_bcc

    try:
        import torch
    except ImportError:
        raise SystemExit("needs torch") from None
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU and torch with CUDA")
    if not check_bcc().ok or os.geteuid() != 0:
        raise SystemExit("needs root and BCC (make setup)")
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, PROBING="1", PROBING_RUNTIME_DIR=d)
        job = subprocess.Popen(
            [sys.executable, "-c", JOB, str(_free_port())],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert job.stdout is not None and job.stdin is not None
            if job.stdout.readline().strip() != "ready":
                raise SystemExit("the job did not start")
            os.environ["PROBING_RUNTIME_DIR"] = d
            client = ProbeClient.for_pid(job.pid)
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
            for _ in range(REPEATS):
                for mode, opts in MODES.items():
                    if opts is not None:
                        client.trace_start(["nccl", "cuda"], **opts)
                    job.stdin.write(f"{STEPS}\n")
                    job.stdin.flush()
                    runs[mode].append(json.loads(job.stdout.readline()))
                    if opts is not None:
                        client.trace_stop()
            events = client.query(
                "SELECT (SELECT count(*) FROM cuda.calls) AS cuda, "
                "(SELECT count(*) FROM nccl.calls) AS nccl"
            ).to_pylist()[0]
        finally:
            job.kill()
            job.wait()
    base = {k: statistics.median(r[k] for r in runs["untraced"]) for k in ("launch", "step")}
    out: dict[str, object] = {
        "device": torch.cuda.get_device_name(0),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "steps": STEPS,
        "repeats": REPEATS,
        "events_recorded": events,
    }
    for mode in MODES:
        med = {k: statistics.median(r[k] for r in runs[mode]) for k in ("launch", "step")}
        out[mode] = {
            "launch_us": round(med["launch"] / 1e3, 2),
            "step_us": round(med["step"] / 1e3, 2),
            "launch_x": round(med["launch"] / base["launch"], 3),
            "step_x": round(med["step"] / base["step"], 3),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
