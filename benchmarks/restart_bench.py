"""The node's engine killed (``kill -9``) under a traced 4-rank DDP job; prints JSON.

The job (``tests/jobs/ddp_job.py``, srun/mpirun-style environment,
``PROBING=1``) is traced over the cluster; then, ``--kills`` times, its
engine is killed and nothing else is typed. Measured each time: how long
until a query of rank 0 is answered (by the new engine, which the guests
started), until every rank traces again, and until the traced rows grow;
and rank 0's step time (from its own log) in the ``--window`` seconds
before the kill, during the restart (until tracing resumed) and after,
and the job's time lost to it (its steps until 1 s after, beyond its pace
before); side by side with the same windows of the job before any kill, and with
its step while ``probing trace --cluster`` starts tracing it again after a
stop (``trace_start``: the uprobes attached anew, as a new engine does).

The ranks run with torch's default threads (an OpenMP pool per rank,
whose threads spin while they wait: 4 ranks on 2 cores are 8 spinning
threads) unless ``--omp-threads N`` sets ``OMP_NUM_THREADS`` (torchrun
sets 1 for every rank of a node with more than one).

    python benchmarks/restart_bench.py [--kills 3] [--window 8] [--omp-threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from probing import proc  # noqa: E402
from probing.cli.client import ProbeClient  # noqa: E402
from probing.cli.demo import free_port  # noqa: E402
from probing.errors import ProbingError  # noqa: E402

WORLD = 4
JOB = REPO / "tests" / "jobs" / "ddp_job.py"
COUNT = "SELECT count(*) AS n FROM gloo.calls"


def start(env: dict[str, str]) -> list[subprocess.Popen[str]]:
    port = free_port()
    procs = []
    for r in range(WORLD):
        env_r = dict(env, PROBING="1", RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, "-u", str(JOB), "--work-ms", "20"], env=env_r, text=True,
            stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
        ))  # fmt: skip
    return procs


def read_steps(proc: subprocess.Popen[str], steps: list[float]) -> None:
    """Rank 0's step ends (monotonic s), from ``rank 0 step i loss x t <wall>``."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if " step " in line:
            steps.append(time.monotonic())


def step_ms(steps: list[float], t0: float, t1: float) -> dict[str, float]:
    """Median and p95 of the steps that ended in [t0, t1)."""
    ends = [t for t in steps if t0 <= t < t1]
    d = sorted((b - a) * 1e3 for a, b in zip(ends, ends[1:], strict=False))
    if not d:
        return {"steps": 0}
    return {"steps": len(d), "median_ms": round(statistics.median(d), 1),
            "p95_ms": round(d[min(len(d) - 1, int(len(d) * 0.95))], 1),
            "max_ms": round(d[-1], 1)}  # fmt: skip


def lost_s(steps: list[float], t0: float, t1: float, pace_ms: float) -> float:
    """The job's time lost in the steps that ended in [t0, t1): what they
    took beyond ``pace_ms`` each (rank 0's median step before)."""
    ends = [t for t in steps if t < t1]
    d = [(b - a) * 1e3 for a, b in zip(ends, ends[1:], strict=False) if b >= t0]
    return round(sum(x - pace_ms for x in d) / 1e3, 3)


def until(what, timeout: float = 30.0) -> float | None:  # type: ignore[no-untyped-def]
    """Seconds until ``what()`` is true (None: not within ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if what():
                return time.monotonic() - t0
        except ProbingError:
            pass
        time.sleep(0.05)
    return None


def engine_pid(runtime: Path) -> int:
    """The engine's pid; 0 while a new one writes its lock file."""
    [lock] = (runtime / f"probing-{os.getuid()}").glob("engine-*.lock")
    try:
        return int(lock.read_text().split()[0])
    except (ValueError, IndexError):
        return 0


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` so far; 0 once it is gone."""
    try:
        fields = proc.stat(pid)  # utime and stime: fields 14 and 15
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def job_cpu_s(pids: list[int]) -> float:
    return sum(cpu_s(p) for p in pids)


def count(pid: int) -> int:
    return int(ProbeClient.for_pid(pid).query(COUNT).column(0)[0].as_py())


def all_tracing(pids: list[int]) -> bool:
    return all(ProbeClient.for_pid(p).trace_status()["state"] == "tracing" for p in pids)


def one_kill(runtime: Path, pids: list[int], steps: list[float], window: float) -> dict:
    """Kill the engine; how long until it answers, traces and records again."""
    before = count(pids[0])
    old = engine_pid(runtime)
    job0 = job_cpu_s(pids)
    t_kill = time.monotonic()
    os.kill(old, signal.SIGKILL)
    answered = until(lambda: engine_pid(runtime) != old and count(pids[0]) >= 0)
    tracing = until(lambda: all_tracing(pids))
    t_back = time.monotonic()
    engine_cpu, job = cpu_s(engine_pid(runtime)), job_cpu_s(pids) - job0
    grown = until(lambda: count(pids[0]) > before)
    time.sleep(window)  # the window after
    t_end = time.monotonic()
    pace = step_ms(steps, t_kill - window, t_kill).get("median_ms", 0.0)
    return {
        "query_answered_s": None if answered is None else round(answered, 2),
        "tracing_again_s": None if tracing is None else round(t_back - t_kill, 2),
        "rows_growing_s": None if grown is None else round(t_back - t_kill + grown, 2),
        "rows_kept": count(pids[0]) >= before,
        # the new engine's CPU from its start until every rank traced again,
        # and the job's (4 ranks) over the same time
        "engine_cpu_s_until_tracing": round(engine_cpu, 2),
        "job_cpu_s_during_restart": round(job, 2),
        "step_before": step_ms(steps, t_kill - window, t_kill),
        "step_during_restart": step_ms(steps, t_kill, t_back),
        "step_after": step_ms(steps, t_back, t_end),
        # the job's time lost to the restart, against its pace before (the
        # steps until 1 s after every rank traced again)
        "job_lost_s": lost_s(steps, t_kill, t_back + 1.0, pace),
    }


def trace_start(env: dict[str, str], pids: list[int], steps: list[float], window: float) -> dict:
    """The baseline a restart is held to: the same job's step while ``probing
    trace --cluster`` starts tracing it again (stopped for ``window`` first),
    the uprobes attached anew, as a new engine does."""

    def trace(*how: str) -> None:
        subprocess.run([sys.executable, "-m", "probing", "trace", "--pid", str(pids[0]),
                        "--cluster", *how], env=env, check=True, capture_output=True)  # fmt: skip

    trace("--stop")
    time.sleep(window)
    engine = engine_pid(Path(os.environ["PROBING_RUNTIME_DIR"]))
    engine0, job0 = cpu_s(engine), job_cpu_s(pids)
    t0 = time.monotonic()
    trace("--background", "--no-nccl", "--no-cuda")
    tracing = until(lambda: all_tracing(pids))
    t_on = time.monotonic()
    engine_cpu, job = cpu_s(engine) - engine0, job_cpu_s(pids) - job0
    time.sleep(window)
    pace = step_ms(steps, t0 - window, t0).get("median_ms", 0.0)
    return {
        "tracing_s": None if tracing is None else round(t_on - t0, 2),
        "engine_cpu_s_until_tracing": round(engine_cpu, 2),
        "job_cpu_s_during_start": round(job, 2),
        "step_untraced": step_ms(steps, t0 - window, t0),
        "step_during_start": step_ms(steps, t0, t_on),
        "step_after": step_ms(steps, t_on, t_on + window),
        "job_lost_s": lost_s(steps, t0, t_on + 1.0, pace),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--window", type=float, default=8.0)
    ap.add_argument("--omp-threads", type=int, default=0, help="OMP_NUM_THREADS (0: torch's)")
    args = ap.parse_args()
    runtime = Path(tempfile.mkdtemp(prefix="probing-restart-"))
    env = dict(os.environ, PROBING_RUNTIME_DIR=str(runtime), PROBING_TOKEN="restart-bench")
    env.pop("OMP_NUM_THREADS", None)
    if args.omp_threads:
        env["OMP_NUM_THREADS"] = str(args.omp_threads)
    os.environ.update(PROBING_RUNTIME_DIR=str(runtime))
    procs = start(env)
    steps: list[float] = []
    threading.Thread(target=read_steps, args=(procs[0], steps), daemon=True).start()
    pids = [p.pid for p in procs]
    try:
        assert until(lambda: ProbeClient.for_pid(pids[0]).health(), 60) is not None
        subprocess.run([sys.executable, "-m", "probing", "trace", "--pid", str(pids[0]),
                        "--cluster", "--background", "--no-nccl", "--no-cuda"],
                       env=env, check=True, capture_output=True)  # fmt: skip
        assert until(lambda: len(steps) > 3, 120) is not None, "the job does not step"
        time.sleep(args.window)  # the job traced, undisturbed: the reference window
        t_ref = time.monotonic()
        start_again = trace_start(env, pids, steps, args.window)
        kills = [one_kill(runtime, pids, steps, args.window) for _ in range(args.kills)]
        print(json.dumps({
            "benchmark": "engine_restart", "ranks": WORLD, "cpus": os.cpu_count(),
            "omp_threads": args.omp_threads or "torch's default",
            "load_avg_1m": round(os.getloadavg()[0], 1),
            "step_reference": step_ms(steps, t_ref - args.window, t_ref),
            # the same sum over quiet 2 s spans of the reference window: its noise
            "reference_lost_s_per_2s": [
                lost_s(steps, t, t + 2.0, step_ms(steps, t_ref - args.window, t_ref)["median_ms"])
                for t in [t_ref - args.window + 2.0 * i for i in range(int(args.window // 2))]
            ],
            "trace_start": start_again,
            "kills": kills,
        }, indent=1))  # fmt: skip
    finally:
        for p in procs:
            p.kill()
            p.wait()
        try:
            os.kill(engine_pid(runtime), signal.SIGTERM)
        except (OSError, ValueError):
            pass


if __name__ == "__main__":
    main()
