"""What the probe costs the job, guest and engine against the tree before the
split, side by side in one run (root; prints one JSON object).

BENCH_BASELINE=<git rev> (default: the tree before the split, 8661f14) is
checked out into a temporary worktree and run through the same steps, taking
turns with this tree (BENCH_REPEATS rounds, default 3):

- rss: a 2-rank torch Gloo job (probing/cli/demo/job.py) attached later: rank
  0's RSS before the inject, after it (idle), tracing, and after 5 queries;
  the engine's own RSS next to it (this tree only: the old probe had none).
- cpu: rank 0's CPU seconds per second over 5 s untraced, then 5 s traced;
  the difference is what tracing costs the job. The engine's CPU per second
  while tracing (outside the job) is given apart.
- inject: `probing inject` then the first answered `probing query`, wall
  seconds, on an idle Python loop (an engine started cold each time).
- cluster: a 4-rank job started with PROBING=1 (no engine running): from
  the moment every rank's socket exists, the first `probing query
  --cluster` (CLI wall seconds) and the same query again.

``python benchmarks/guest_bench.py --cold-cluster 10``: that last one alone,
this tree only, 10 times (a new engine each time).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BASELINE = os.environ.get("BENCH_BASELINE", "8661f14")
REPEATS = int(os.environ.get("BENCH_REPEATS", 3))
IDLE = "import time\nwhile True: time.sleep(0.05)\n"
CLUSTER_SQL = "SELECT rank, count(*) AS n FROM process.threads GROUP BY rank ORDER BY rank"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Tree:
    """One probing tree: this one, or the baseline's worktree (its probing
    first on PYTHONPATH, for the CLI and for jobs that import it)."""

    def __init__(self, name: str, root: Path, runtime: Path) -> None:
        self.name, self.root, self.runtime = name, root, runtime

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PROBING"}
        env["PYTHONPATH"] = str(self.root)
        env["PROBING_RUNTIME_DIR"] = str(self.runtime)
        env["PROBING_ENGINE_IDLE_S"] = "2"
        env["PROBING_KEEP_DEAD_S"] = "2"
        env.update(extra)
        return env

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        # from the tree's root: `-m` puts the working directory first on sys.path
        return subprocess.run([sys.executable, "-m", "probing", *args], env=self.env(),
                              cwd=self.root, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip

    def engines(self) -> list[int]:
        out = []
        for lock in (self.runtime / f"probing-{os.getuid()}").glob("engine-*.lock"):
            from probing.guest.place import is_engine

            try:
                pid = int(lock.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            if is_engine(pid):
                out.append(pid)
        return out

    def stop_engines(self) -> None:
        for pid in self.engines():
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while self.engines() and time.monotonic() < deadline:
            time.sleep(0.05)

    def job(self, world: int, **env: str) -> object:
        from probing.cli.demo import DemoJob

        return DemoJob(world, job_args=["--work", "4"], env=self.env(**env))


def ok(r: subprocess.CompletedProcess[str]) -> str:
    if r.returncode:
        raise RuntimeError(f"{r.args}: {r.stderr.strip()[-400:]}")
    return r.stdout


def bench_rss_cpu(tree: Tree) -> dict[str, float]:
    job = tree.job(2)
    try:
        job.wait_ready(timeout=120)
        pid = job.pids[0]
        time.sleep(2)
        out = {"rss_before_mb": rss_mb(pid)}
        c0, t0 = cpu_s(pid), time.monotonic()
        time.sleep(5)
        untraced = (cpu_s(pid) - c0) / (time.monotonic() - t0)
        ok(tree.cli("inject", "--pid", str(pid)))
        time.sleep(2)
        out["rss_idle_mb"] = rss_mb(pid)
        ok(tree.cli("trace", "--pid", str(pid), "--background", "--no-nccl", "--no-cuda"))
        time.sleep(2)
        engines = tree.engines()
        e0 = sum(cpu_s(e) for e in engines)
        c0, t0 = cpu_s(pid), time.monotonic()
        time.sleep(5)
        wall = time.monotonic() - t0
        traced = (cpu_s(pid) - c0) / wall
        out["engine_cpu_per_s"] = (sum(cpu_s(e) for e in engines) - e0) / wall if engines else 0
        out["rss_tracing_mb"] = rss_mb(pid)
        for sql in ("SELECT count(*) FROM gloo.calls", "SELECT * FROM process.stacks",
                    "SELECT count(*) FROM python.samples", "SELECT * FROM process.info",
                    "SELECT op, count(*) FROM comm.collectives GROUP BY op"):  # fmt: skip
            ok(tree.cli("query", "--pid", str(pid), sql))
        out["rss_queried_mb"] = rss_mb(pid)
        out["engine_rss_mb"] = sum(rss_mb(e) for e in engines) if engines else 0
        out["job_cpu_untraced_per_s"] = untraced
        out["job_cpu_traced_per_s"] = traced
        ok(tree.cli("trace", "--pid", str(pid), "--stop"))
        return out
    finally:
        job.stop()  # type: ignore[attr-defined]
        tree.stop_engines()


def bench_inject(tree: Tree) -> float:
    proc = subprocess.Popen([sys.executable, "-c", IDLE], env=tree.env(), cwd=tree.root)
    try:
        time.sleep(1)
        t0 = time.monotonic()
        ok(tree.cli("inject", "--pid", str(proc.pid)))
        ok(tree.cli("query", "--pid", str(proc.pid), "SELECT count(*) FROM process.threads"))
        return time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()
        tree.stop_engines()


def bench_cluster(tree: Tree) -> dict[str, float]:
    job = tree.job(4, PROBING="1")
    try:
        sockets = [tree.runtime / f"probing-{os.getuid()}" / f"{p}.sock" for p in job.pids]  # type: ignore[attr-defined]
        deadline = time.monotonic() + 120
        while not all(s.exists() for s in sockets):
            if time.monotonic() > deadline:
                raise RuntimeError("the ranks' probes never served")
            time.sleep(0.01)
        job.wait_ready(timeout=120)  # type: ignore[attr-defined]
        times = []
        for _ in range(2):
            t0 = time.monotonic()
            out = ok(tree.cli("query", "--pid", str(job.pids[0]), "--cluster", CLUSTER_SQL))  # type: ignore[attr-defined]
            times.append(time.monotonic() - t0)
            if out.count("\n") < 5:
                raise RuntimeError(f"not every rank answered: {out}")
        return {"first_s": times[0], "second_s": times[1]}
    finally:
        job.stop()  # type: ignore[attr-defined]
        tree.stop_engines()


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def cold_cluster_only(runs: int) -> None:
    """``--cold-cluster N``: only the cold 4-rank cluster query, N times, this tree."""
    tmp = Path(tempfile.mkdtemp(prefix="guest-bench-"))
    firsts, seconds = [], []
    for i in range(runs):
        got = bench_cluster(Tree("now", REPO, tmp / f"rt-{i}"))  # a new engine each time
        firsts.append(round(got["first_s"], 3))
        seconds.append(round(got["second_s"], 3))
    out = {"benchmark": "cold_cluster_query", "runs": runs, "first_s": sorted(firsts),
           "under_1s": sum(t <= 1.0 for t in firsts), "second_s": sorted(seconds),
           "load_avg_1m": round(os.getloadavg()[0], 1)}  # fmt: skip
    print(json.dumps(out))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--cold-cluster":
        cold_cluster_only(int(sys.argv[2]))
        return
    tmp = Path(tempfile.mkdtemp(prefix="guest-bench-"))
    base = tmp / "baseline"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), BASELINE],
                   check=True, capture_output=True)  # fmt: skip
    trees = [Tree("before", base, tmp / "rt-before"), Tree("now", REPO, tmp / "rt-now")]
    results: dict[str, dict[str, list[float]]] = {t.name: {} for t in trees}
    try:
        for _ in range(REPEATS):
            for tree in trees:  # taking turns
                got = results[tree.name]
                for k, v in bench_rss_cpu(tree).items():
                    got.setdefault(k, []).append(v)
                got.setdefault("inject_first_answer_s", []).append(bench_inject(tree))
                for k, v in bench_cluster(tree).items():
                    got.setdefault(f"cluster_query_{k}", []).append(v)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)],
                       capture_output=True)  # fmt: skip
    out = {
        "baseline": BASELINE,
        "repeats": REPEATS,
        **{name: {k: median(v) for k, v in got.items()} for name, got in results.items()},
        "raw": results,
    }
    for name in results:
        m = out[name]
        m["rss_added_idle_mb"] = round(m["rss_idle_mb"] - m["rss_before_mb"], 1)
        m["rss_added_tracing_mb"] = round(m["rss_tracing_mb"] - m["rss_before_mb"], 1)
        m["rss_added_queried_mb"] = round(m["rss_queried_mb"] - m["rss_before_mb"], 1)
        m["job_cpu_for_tracing_per_s"] = round(
            m["job_cpu_traced_per_s"] - m["job_cpu_untraced_per_s"], 4
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
