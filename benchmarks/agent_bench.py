"""``probing agent``'s own cost, on an idle node and with a 4-rank job it
watches (root; prints JSON).

The agent runs with its defaults (attach by launcher variables, trace the
collectives, every 2 s) on a free port and a runtime directory of its own.
Measured, each over ``--seconds``: the agent's CPU (user + system) per
second and its RSS on an idle node; then a 4-rank Gloo job
(``tests/jobs/slowable.py``, srun/mpirun-style environment, no ``PROBING``)
is started: the seconds until every rank traces (attach latency, from the
job's start), and the agent's CPU and RSS while it watches it, next to the
node's engine's and each rank's CPU (what tracing and the watch cost,
outside the agent).

    python benchmarks/agent_bench.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from probing.cli.client import ProbeClient  # noqa: E402
from probing.cli.demo import free_port  # noqa: E402
from probing.errors import ProbingError  # noqa: E402

WORLD = 4
JOB = REPO / "tests" / "jobs" / "slowable.py"


def cost(pids: list[int], seconds: float) -> list[dict[str, float]]:
    """CPU s/s and RSS MB of each of ``pids`` over ``seconds``."""
    procs = [psutil.Process(p) for p in pids]
    c0 = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(seconds)
    return [
        {
            "cpu_s_per_s": round((sum(p.cpu_times()[:2]) - c) / seconds, 4),
            "rss_mb": round(p.memory_info().rss / 2**20, 1),
        }
        for p, c in zip(procs, c0, strict=True)
    ]


def tracing(pid: int) -> bool:
    try:
        return ProbeClient.for_pid(pid).trace_status()["state"] == "tracing"
    except ProbingError:
        return False


def engines(runtime: Path) -> list[int]:
    out = []
    for lock in (runtime / f"probing-{os.getuid()}").glob("engine-*.lock"):
        try:
            out.append(int(lock.read_text().split()[0]))
        except (ValueError, IndexError):
            pass
    return [p for p in out if psutil.pid_exists(p)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    runtime = Path(tempfile.mkdtemp(prefix="probing-agent-bench-"))
    port = free_port()
    env = dict(os.environ, PROBING_RUNTIME_DIR=str(runtime))
    env.pop("PROBING", None)
    os.environ["PROBING_RUNTIME_DIR"] = str(runtime)
    agent = subprocess.Popen([sys.executable, "-m", "probing", "agent", "--port", str(port)],
                             env=env, stderr=subprocess.DEVNULL)  # fmt: skip
    ranks: list[subprocess.Popen[bytes]] = []
    try:
        url = f"http://127.0.0.1:{port}/health"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                time.sleep(0.2)
        out: dict = {"benchmark": "agent", "cpus": os.cpu_count(),
                     "load_avg_1m": round(os.getloadavg()[0], 1)}  # fmt: skip
        out["idle_node"] = cost([agent.pid], args.seconds)[0]
        master = free_port()
        t0 = time.monotonic()
        for r in range(WORLD):
            env_r = dict(env, RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r),
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master))  # fmt: skip
            ranks.append(  # its end (killed) is Gloo's noise, not the bench's
                subprocess.Popen([sys.executable, str(JOB)], env=env_r, stderr=subprocess.DEVNULL)
            )
        while not all(tracing(p.pid) for p in ranks):
            if time.monotonic() - t0 > 120:
                raise SystemExit("the job was not traced in 120 s")
            time.sleep(0.1)
        out["every_rank_traced_s"] = round(time.monotonic() - t0, 2)
        time.sleep(5)  # the watch's first detections
        [engine] = engines(runtime)
        got = cost([agent.pid, engine, *(p.pid for p in ranks)], args.seconds)
        out["with_4_rank_job"] = {"agent": got[0], "engine": got[1], "ranks": got[2:]}
        print(json.dumps(out, indent=1))
    finally:
        for p in ranks:
            p.kill()
            p.wait()
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
        for pid in engines(runtime):
            os.kill(pid, signal.SIGTERM)


if __name__ == "__main__":
    main()
