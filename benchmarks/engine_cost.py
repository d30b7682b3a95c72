"""The node engine's own cost while it traces a job; prints JSON, one object a case.

For each case (a shape, a number of ranks, a pace): ``jobs/paced.py``
is started the srun/mpirun way (one process a rank, Gloo on CPU,
``OMP_NUM_THREADS=1``), in a runtime directory of its own (so a fresh
engine). Over ``--window`` seconds untraced, then over the same span once
``probing trace --pid R0 --cluster --background`` traces every rank (stacks
and the job's watch on, as a user starts it) and ``--settle`` s have passed:

- the job's CPU (every rank's, CPU s/s), untraced and traced;
- the engine's CPU (CPU s/s), its share of the job's untraced CPU, and per
  traced collective (µs; the collectives ``comm.collectives`` holds for the
  window, every rank's);
- its RSS (MB) at the end, and the most threads it had at once over the
  window (polled every 0.1 s; the benchmark's own asks come before and after);
- a breakdown of its CPU by part, from the kernel's name of each of its
  threads (``probing.worker.os_name``): ``drain`` (``probing-trace``),
  ``sampler``, ``detector`` (``probing-watch``, ``probing-detect``),
  ``sql`` (``probing-query``, ``probing-request``, ``probing-server``),
  ``cluster``, ``seal``, ``nvml``, ``main`` (the engine's own loop),
  ``other``. Threads that end in the window (a request's, a sealer or a
  beat that went idle) count by their name as last seen (the threads are
  polled every 0.1 s); ``gone``: what is left, threads born and ended
  between two polls.

Shapes: ``ddp`` (DDP, each of ``--layers`` layers its own bucket: that many
all-reduces a step), ``fsdp2`` (``fully_shard`` per layer: ~3 collectives a
layer a step). A case's pace (``--rates``) is the collectives a second per
rank it asks for; the step is paced to it (``--step-ms`` = per step / rate),
and what it got is printed (a 2-CPU machine cannot give 4 ranks 1,000).

    python benchmarks/engine_cost.py [--cases ddp:4,fsdp2:4,ddp:8] [--rates 10,100,1000]
        [--window 20] [--settle 5] [--detect-off] [--baseline REV] [--profile DIR]
        [--engine-env NAME=VALUE ...]

``--baseline REV`` (or ``BENCH_BASELINE``) runs each case on that revision's
tree first (a temporary worktree: its CLI, guest and engine), then on this one.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "jobs" / "paced.py"
LAYERS = 4
PER_STEP = {"ddp": LAYERS, "fsdp2": 3 * LAYERS + 2}  # the pacing's guess; the trace counts
PARTS = {
    "probing-trace": "drain",
    "probing-sampler": "sampler",
    "probing-watch": "detector",
    "probing-detect": "detector",
    "probing-query": "sql",
    "probing-request": "sql",
    "probing-server": "sql",
    "probing-cluster": "cluster",
    "probing-seal": "seal",
    "probing-nvml": "nvml",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def probing(
    env: dict[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    # from the tree's root (PYTHONPATH: this one, or the baseline's worktree)
    return subprocess.run([sys.executable, "-m", "probing", *args], env=env,
                          cwd=env.get("PYTHONPATH", REPO), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


class Job:
    def __init__(self, shape: str, world: int, step_ms: float, env: dict[str, str], tmp: str):
        port = free_port()
        self.status = os.path.join(tmp, "status")
        self.procs = []
        for r in range(world):
            e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                     LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                     OMP_NUM_THREADS="1")  # fmt: skip
            cmd = [sys.executable, str(JOB), "--shape", shape, "--layers", str(LAYERS),
                   "--step-ms", f"{step_ms:.3f}", "--status", self.status]  # fmt: skip
            # from the tree's root: the engine a guest starts runs there, and
            # `-m` puts its working directory first on sys.path
            self.procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, text=True,
                                               cwd=env.get("PYTHONPATH"),
                                               start_new_session=True))  # fmt: skip
        self.pids = []
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line.startswith("ready"):
                self.stop()  # the ranks that did start
                raise RuntimeError(f"a rank did not start: {line!r} (exit {p.poll()})")
            self.pids.append(p.pid)

    def cpu(self) -> float:
        total = 0.0
        for pid in self.pids:
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
        return total

    def counted(self) -> int:
        n = 0
        for path in glob.glob(self.status + ".rank*"):
            with contextlib.suppress(OSError, ValueError), open(path) as f:
                n += max(0, int(json.load(f)["collectives"]))
        return n

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=30)


def engine_pid(rt: str) -> int:
    for lock in glob.glob(os.path.join(rt, "probing-*", "engine-*.lock")):
        with contextlib.suppress(OSError, ValueError), open(lock) as f:
            pid = int(f.read().split()[0])
            if psutil.pid_exists(pid):
                return pid
    return 0


def job_env(tmp: str, tree: Path = REPO, detect: bool = True) -> tuple[dict[str, str], str]:
    """The environment of a job and of the CLI that traces it, and their
    runtime directory: ``tmp``/rt, of its own (so a fresh engine)."""
    rt = os.path.join(tmp, "rt")
    os.mkdir(rt, 0o700)
    os.environ["PROBING_RUNTIME_DIR"] = rt  # the probes this process asks (detections)
    # the tree's probing for the CLI, the guest it injects and the engine
    env = dict(os.environ, PYTHONPATH=str(tree), PROBING_ENGINE_ENV="PYTHONPATH")
    env.pop("PROBING", None)
    if not detect:  # the job's watch off: what the detector costs, by difference
        env["PROBING_DETECT_S"] = "0"
    return env, rt


def with_engine_env(env: dict[str, str], pairs: list[str]) -> None:
    """``NAME=VALUE`` each set in ``env`` and passed on to the engine (the
    names ``PROBING_ENGINE_ENV`` lists), over what it sets itself."""
    for pair in pairs:
        name, _, value = pair.partition("=")
        env[name] = value
        env["PROBING_ENGINE_ENV"] += f",{name}"


def trace(env: dict[str, str], job: Job, rt: str) -> psutil.Process:
    """``probing trace --pid R0 --cluster --background``, as a user starts
    it (stacks and the job's watch on); the engine that traces."""
    r = probing(env, "trace", "--pid", str(job.pids[0]), "--cluster", "--background")
    if r.returncode != 0:
        raise RuntimeError(f"trace failed: {r.stderr.strip()}")
    return psutil.Process(engine_pid(rt))


def stop(job: Job, rt: str) -> None:
    """The job's ranks killed, and the engine stopped (SIGTERM; SIGKILL
    after 30 s)."""
    job.stop()
    engine = engine_pid(rt)
    if engine:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(engine)
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except psutil.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


TICK = os.sysconf("SC_CLK_TCK")


def threads_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (its kernel name, its CPU seconds)."""
    out = {}
    for task in glob.glob(f"/proc/{pid}/task/*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            comm = Path(task, "comm").read_text().strip()
            fields = Path(task, "stat").read_text().rsplit(")", 1)[1].split()
            out[int(os.path.basename(task))] = (comm, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def watch_threads(
    pid: int, seconds: float, every: float = 0.1
) -> tuple[dict[int, tuple[str, float]], int]:
    """Each thread's name and CPU seconds when last seen, polled every
    ``every`` s for ``seconds``: what the threads that end meanwhile used;
    and the most threads seen at once."""
    last: dict[int, tuple[str, float]] = {}
    most = 0
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        now = threads_cpu(pid)
        last.update(now)
        most = max(most, len(now))
        time.sleep(min(every, left))
    return last, most


def breakdown(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
              total: float, main_tid: int, span: float) -> dict[str, float]:  # fmt: skip
    parts: dict[str, float] = {}
    seen = 0.0
    for tid, (comm, cpu) in after.items():
        used = cpu - before.get(tid, (comm, 0.0))[1]
        part = "main" if tid == main_tid else PARTS.get(comm, "other")
        parts[part] = parts.get(part, 0.0) + used
        seen += used
    parts["gone"] = max(0.0, total - seen)  # threads born and ended between two polls
    return {k: round(v / span, 4) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}


def detections(pids: list[int]) -> int:
    """Detections run so far (full ones and the asks between them), by every
    rank's probe (one is the job's detector): ``probing_detections_total``."""
    from probing.cli.client import ProbeClient

    n = 0
    for pid in pids:
        try:
            _, body = ProbeClient.for_pid(pid, timeout=10)._call("GET", "/metrics")
        except Exception:
            continue
        for line in body.decode().splitlines():
            if line.startswith("probing_detections_total "):
                n += int(float(line.split()[1]))
    return n


def traced_collectives(env: dict[str, str], pid: int, t0: float, t1: float) -> int:
    sql = (f"SELECT count(*) AS n FROM comm.collectives WHERE ts >= {int(t0 * 1e9)} "
           f"AND ts < {int(t1 * 1e9)}")  # fmt: skip
    r = probing(env, "query", "--pid", str(pid), "--cluster", "--format", "json",
                "--timeout", "30", sql)  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"query failed: {r.stderr.strip()}")
    return sum(int(row["n"]) for row in json.loads(r.stdout))


def case(
    shape: str,
    world: int,
    rate: float,
    window: float,
    settle: float,
    detect: bool = True,
    tree: Path = REPO,
    profile: str | None = None,
    engine_env: list[str] | None = None,
) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="probing-cost-")
    env, rt = job_env(tmp, tree, detect)
    with_engine_env(env, engine_env or [])
    step_ms = 1e3 * PER_STEP[shape] / rate
    job = Job(shape, world, step_ms, env, tmp)
    out: dict[str, Any] = {"tree": "this" if tree == REPO else "baseline", "shape": shape,
                           "ranks": world, "rate_asked": rate, "detect": detect}  # fmt: skip
    try:
        time.sleep(settle)
        c0, n0, t0 = job.cpu(), job.counted(), time.monotonic()
        time.sleep(window)
        c1, n1, t1 = job.cpu(), job.counted(), time.monotonic()
        out["job_cpu_untraced"] = round((c1 - c0) / (t1 - t0), 4)
        if shape == "ddp":
            out["rate_untraced"] = round((n1 - n0) / world / (t1 - t0), 1)
        proc = trace(env, job, rt)
        engine = proc.pid
        # detections counted from before the settle: the threads answering
        # this ask (one a rank) are gone before the window
        d0, dt0 = detections(job.pids), time.monotonic()
        time.sleep(settle)
        e0, th0 = sum(proc.cpu_times()[:2]), threads_cpu(engine)
        c0, w0, t0 = job.cpu(), time.time(), time.monotonic()
        spy = record(engine, window, profile, f"{out['tree']}-{shape}-{world}-{rate:g}")
        last, most = watch_threads(engine, window)
        if spy is not None:
            spy.wait(timeout=window + 30)
        e1, th1 = sum(proc.cpu_times()[:2]), threads_cpu(engine)
        c1, w1, t1 = job.cpu(), time.time(), time.monotonic()
        d1 = detections(job.pids)
        span = t1 - t0
        n = traced_collectives(env, job.pids[0], w0, w1)
        engine_cpu = (e1 - e0) / span
        out.update(
            job_cpu_traced=round((c1 - c0) / span, 4),
            rate_traced=round(n / world / span, 1),
            engine_cpu=round(engine_cpu, 4),
            engine_pct_of_job=round(100 * engine_cpu / max(out["job_cpu_untraced"], 1e-9), 1),
            engine_us_per_collective=round(1e6 * (e1 - e0) / max(n, 1), 1),
            engine_rss_mb=round(proc.memory_info().rss / 2**20, 1),
            engine_threads=most,
            detections_per_s=round((d1 - d0) / (time.monotonic() - dt0), 2),
            parts=breakdown(th0, {**last, **th1}, e1 - e0, engine, span),
        )
    finally:
        stop(job, rt)
        shutil.rmtree(tmp, ignore_errors=True)  # its runtime directory, the engine's chunks
    return out


def record(pid: int, window: float, profile: str | None, name: str) -> subprocess.Popen | None:
    """With ``--profile DIR``: py-spy samples the engine over the window (100
    Hz, every thread while it runs) into DIR/name.txt, folded stacks
    (one line a stack, its count last). Its own sampling costs the machine
    CPU: a profiled run's figures are not the benchmark's."""
    if profile is None:
        return None
    os.makedirs(profile, exist_ok=True)
    out = os.path.join(profile, f"{name}.txt")
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(int(window)),
                             "--rate", "100", "--format", "raw", "--threads",
                             "--nonblocking", "--output", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--cases", default="ddp:4,fsdp2:4,ddp:8", help="shape:ranks, comma-separated")
    p.add_argument("--rates", default="10,100,1000", help="collectives a second per rank asked")
    p.add_argument("--window", type=float, default=20.0, help="seconds measured, each way")
    p.add_argument("--settle", type=float, default=5.0, help="seconds before each window")
    p.add_argument("--detect-off", action="store_true", help="PROBING_DETECT_S=0: no watch")
    p.add_argument("--profile", help="a folder: py-spy's folded stacks of the engine, a case each")
    p.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in the engine's environment (again for more)")  # fmt: skip
    p.add_argument("--baseline", default=os.environ.get("BENCH_BASELINE"),
                   help="a git revision: each case on its tree too, first")  # fmt: skip
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("engine_cost: needs root (BPF)")
    trees = [REPO]
    base = Path(tempfile.mkdtemp(prefix="probing-cost-base-")) / "tree"
    if args.baseline:
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base),
                        args.baseline], check=True, capture_output=True)  # fmt: skip
        trees = [base, REPO]
    try:
        for spec in args.cases.split(","):
            shape, world = spec.split(":")
            for rate in args.rates.split(","):
                for tree in trees:
                    try:
                        got = case(shape, int(world), float(rate), args.window, args.settle,
                                   detect=not args.detect_off, tree=tree,
                                   profile=args.profile, engine_env=args.engine_env)  # fmt: skip
                    except Exception as err:
                        got = {"tree": str(tree), "shape": shape, "ranks": int(world),
                               "rate_asked": float(rate), "error": str(err)}  # fmt: skip
                    print(json.dumps(got), flush=True)
    finally:
        if args.baseline:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)],
                           capture_output=True)  # fmt: skip
        shutil.rmtree(base.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
