"""Engine soak: N short 4-rank jobs through one node engine; prints JSON.

Each job's ranks start with ``PROBING=1`` (a ``torch`` DDP job launched the
srun/mpirun way, ``tests/jobs/ddp_job.py``, or with ``--kind plain`` four
plain Python processes joined by ``PROBING_PEERS``, the same four ports
for every job: the same settings, so the same engine), are traced over the
cluster, asked two cluster queries (a live table, a stored one), and
stopped. A torch job, once traced, runs until the engine's store sealer has
sealed a chunk of its traced calls (``gloo.calls``, for one of its ranks;
``SEAL_TIMEOUT_S`` at most): the sealer thread each job starts is part of
what the engine must let go; the jobs that got one are counted. After each
job, and once every exited process was retired (``PROBING_KEEP_DEAD_S``),
the engine's RSS, threads, descriptors, listening TCP ports and the files
it keeps (sockets, state and chunk directories) are read. Printed: those
figures once the first job was retired (the baseline), after the last job,
once every job was retired, the growth per job between the baseline and
the end, and the jobs sealed.

    python benchmarks/engine_soak.py [--jobs 300] [--kind torch|plain] [--keep-dead-s 3]
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
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from probing.cli.client import ProbeClient, cluster_query  # noqa: E402
from probing.cli.demo import free_port  # noqa: E402
from probing.errors import ProbingError  # noqa: E402
from probing.node.probe.connections import Workers  # noqa: E402
from probing.node.sql.run import QueryThreads  # noqa: E402

WORLD = 4
STORED = "SELECT rank, count(*) AS n FROM python.stacks GROUP BY rank"
PLAIN = "import time\nwhile True:\n    time.sleep(0.05)\n"
JOB = REPO / "tests" / "jobs" / "ddp_job.py"
# the first collectives come a few seconds after the trace on 2 busy CPUs,
# and their rows are sealed once 2 s old (Store.seal_after_s)
SEAL_TIMEOUT_S = 60.0


def start_job(kind: str, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    """The ranks of one job, each with its probe starting (PROBING=1)."""
    procs = []
    port = free_port()
    for r in range(WORLD):
        env_r = dict(env, PROBING="1", RANK=str(r), WORLD_SIZE=str(WORLD))
        if kind == "plain":  # its rank's listed address (PROBING_PEERS, RANK) is its port
            cmd = [sys.executable, "-c", PLAIN]
        else:
            env_r.update(LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            cmd = [sys.executable, str(JOB), "--steps", "0"]
        procs.append(
            subprocess.Popen(
                cmd, env=env_r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )  # fmt: skip
    return procs


def ready(pid: int, timeout: float = 120.0) -> None:
    """Until ``pid``'s probe is in its job (bound and published)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            cluster = ProbeClient.for_pid(pid).health().get("cluster") or {}
            if cluster.get("addr") and cluster.get("published"):
                return
        except ProbingError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"pid {pid}'s probe never joined its job")


def engine_pid(directory: Path) -> int | None:
    for lock in directory.glob("engine-*.lock"):
        try:
            pid = int(lock.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if psutil.pid_exists(pid):
            return pid
    return None


def retired(directory: Path, timeout: float = 120.0) -> None:
    """Until the engine serves no process (every exited one retired), and
    the threads that stopped their tracing have ended."""
    from probing.guest import wire

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        [sock] = directory.glob("engine-*.sock")
        if not wire.request(str(sock), "GET", "/health", None, 10)["processes"]:
            break
        time.sleep(0.2)
    else:
        raise RuntimeError(f"processes still served after {timeout:g} s")
    # the threads of what was retired end within a few seconds, and request
    # threads linger after their last request and query (Workers.LINGER_S,
    # QueryThreads.LINGER_S): until the count has stood still for longer
    engine = engine_pid(directory)
    assert engine is not None
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = psutil.Process(engine).num_threads()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= max(Workers.LINGER_S, QueryThreads.LINGER_S) + 1.0:
            return
        time.sleep(0.25)


def sealed(directory: Path, chunks: Path, pids: list[int]) -> bool:
    """Whether the engine's sealer wrote a chunk of ``gloo.calls`` (the
    drain's table, sealed by the store's ``probing-seal`` thread; samples
    and stacks are sealed by their writer) for one of ``pids`` within
    ``SEAL_TIMEOUT_S``; waits until it did."""
    engine = engine_pid(directory)
    deadline = time.monotonic() + SEAL_TIMEOUT_S
    while engine and time.monotonic() < deadline:
        for pid in pids:
            # chunks-<engine>-p<pid>s<start>-*/gloo/calls/__probing_chunk=<id>/<id>.<ext>
            for path in chunks.glob(f"chunks-{engine}-p{pid}s*/gloo/calls/*/*"):
                if not path.name.endswith(".tmp"):  # written aside, then renamed
                    return True
        time.sleep(0.2)
    return False


def figures(pid: int, directory: Path, chunks: Path) -> dict[str, float]:
    """What the engine holds now."""
    p = psutil.Process(pid)
    listening = [c for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    from probing.guest import wire

    try:
        [sock] = directory.glob("engine-*.sock")
        arrow_mb = wire.request(str(sock), "GET", "/health", None, 10)["arrow_bytes"] / 2**20
    except (ValueError, OSError, KeyError):
        arrow_mb = -1.0
    return {
        "rss_mb": round(p.memory_info().rss / 2**20, 1),
        "arrow_mb": round(arrow_mb, 1),
        "threads": p.num_threads(),
        "fds": p.num_fds(),
        "tcp_listening": len(listening),
        "files": len(os.listdir(directory)),
        "chunk_dirs": len(os.listdir(chunks)) if chunks.exists() else 0,
    }


def one_job(kind: str, env: dict[str, str], directory: Path, chunks: Path) -> bool:
    """One job through the engine; whether the sealer sealed a chunk of it
    (a torch job's; a plain one traces no calls)."""
    procs = start_job(kind, env)
    try:
        for p in procs:
            ready(p.pid)
        rows = ProbeClient.for_pid(procs[0].pid).cluster_trace("start", families=["gloo"])
        if not all(r["ok"] for r in rows):
            raise RuntimeError(f"not every rank traced: {rows}")
        got_chunk = kind == "torch" and sealed(directory, chunks, [p.pid for p in procs])
        got = cluster_query("SELECT rank FROM process.info", pid=procs[1].pid, timeout=30)
        if got.table.num_rows != WORLD:
            raise RuntimeError(f"{got.table.num_rows} of {WORLD} ranks answered")
        # a stored table: the engine's ranks answer together (share.Together)
        got = cluster_query(STORED, pid=procs[1].pid, timeout=30)
        if got.missing:
            raise RuntimeError(f"ranks missing from a query of a stored table: {got.missing}")
    finally:
        for p in procs:
            with_group = os.getpgid(p.pid) if p.poll() is None else None
            if with_group is not None:
                os.killpg(with_group, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        seen_dead(env, [p.pid for p in procs])
    return got_chunk


def seen_dead(env: dict[str, str], pids: list[int], timeout: float = 30.0) -> None:
    """Until the engine has seen ``pids`` exit: the next job's ranks take
    their peer ports (``PROBING_PEERS``) from the dead ones, as a job
    started again does."""
    from probing.guest import wire

    directory = Path(env["PROBING_RUNTIME_DIR"]) / f"probing-{os.getuid()}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            [sock] = directory.glob("engine-*.sock")
            procs = wire.request(str(sock), "GET", "/health", None, 10)["processes"]
        except (ValueError, OSError, KeyError):
            return  # no engine (yet): nothing holds them
        if all(not procs.get(str(p), {}).get("alive") for p in pids):
            return
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--kind", choices=("torch", "plain"), default="torch")
    ap.add_argument("--keep-dead-s", type=float, default=3.0)
    ap.add_argument("--every", type=int, default=10, help="a row of figures every N jobs")
    args = ap.parse_args()
    runtime = Path(tempfile.mkdtemp(prefix="probing-soak-"))
    directory = runtime / f"probing-{os.getuid()}"
    chunks = Path("/dev/shm") / f"probing-{os.getuid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBING")}
    env.update(PROBING_RUNTIME_DIR=str(runtime), PROBING_KEEP_DEAD_S=str(args.keep_dead_s),
               PROBING_ENGINE_IDLE_S="3600", PROBING_TOKEN="soak",
               # this tree's probing in the jobs and their engine (a worktree's too)
               PYTHONPATH=str(REPO), PROBING_ENGINE_ENV="PYTHONPATH")  # fmt: skip
    if args.kind == "plain":  # one peer list for every job: ranks started again on their ports
        env["PROBING_PEERS"] = ",".join(f"127.0.0.1:{free_port()}" for _ in range(WORLD))
    os.environ.update({k: v for k, v in env.items() if k.startswith("PROBING")})
    rows, t0, engine, n_sealed = [], time.monotonic(), None, 0
    first: dict[str, float] = {}
    for n in range(1, args.jobs + 1):
        n_sealed += one_job(args.kind, env, directory, chunks)
        engine = engine or engine_pid(directory)
        if engine is None:
            raise RuntimeError("no engine ran the jobs")
        if n == 1:  # the baseline: the first job's processes retired
            retired(directory)
            first = figures(engine, directory, chunks)
            rows.append({"jobs": n, "s": round(time.monotonic() - t0, 1), "sealed": n_sealed,
                         **first})  # fmt: skip
        elif n % args.every == 0 or n == args.jobs:
            rows.append({"jobs": n, "s": round(time.monotonic() - t0, 1), "sealed": n_sealed,
                         **figures(engine, directory, chunks)})  # fmt: skip
        else:
            continue
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    retired(directory)
    assert engine is not None
    at_end = figures(engine, directory, chunks)
    per_job = {
        k: round((at_end[k] - first[k]) / max(1, args.jobs - 1), 3)
        for k in ("rss_mb", "threads", "fds", "tcp_listening", "files")
    }
    os.kill(engine, signal.SIGTERM)
    print(json.dumps({
        "benchmark": "engine_soak", "kind": args.kind, "jobs": args.jobs,
        "seconds": round(time.monotonic() - t0, 1), "after_first_job_retired": first,
        "jobs_sealed": n_sealed if args.kind == "torch" else None,
        "after_last_job": {k: v for k, v in rows[-1].items() if k not in ("jobs", "s", "sealed")},
        "after_all_retired": at_end, "growth_per_job": per_job, "rows": rows,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
