"""Soak: 4 clients x N mixed queries against a traced 4-rank job; prints JSON.

The job is ``tests/jobs/ddp_job.py`` launched the srun/mpirun way (rank 0
hosts the store) with ``PROBING=1``, every rank traced (Gloo). Four client
threads each send ``--queries`` queries, drawn in turn from store tables,
views, ``python.`expr``` and cluster queries, to the ranks' probes (over
their unix sockets, as the CLI does). Printed: errors (target 0, each kind
with an example), queries per second, and the job's median step time under
the soak, traced with nobody asking, and the same job untraced. The two runs are interleaved in
rounds (untraced, traced, untraced, traced, ...), the queries split
across the traced rounds, so both see the same machine.

    python benchmarks/soak_bench.py [--queries 2500] [--clients 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from probing.cli.client import ProbeClient  # noqa: E402
from probing.cli.demo import trace_all  # noqa: E402
from tests.jobs.launch import WORLD, Launch  # noqa: E402

QUERIES = [
    ("store", "SELECT count(*) AS n FROM gloo.calls"),
    ("store", "SELECT op, count(*) AS n, avg(dur_ns) AS d FROM gloo.calls GROUP BY op"),
    ("store", "SELECT count(*) AS n FROM python.stacks"),
    ("view", "SELECT count(*) AS n FROM comm.collectives"),
    ("view", "SELECT callsite, count(*) AS n FROM python.callsites GROUP BY callsite"),
    ("static", "SELECT count(*) AS n FROM process.threads"),
    ("static", "SELECT rows, retired_rows FROM probing.tables"),
    ("expr", "SELECT * FROM python.`len(sys.modules)`"),
    ("expr", "SELECT * FROM python.`torch.distributed.get_rank()`"),
    ("cluster", "SELECT rank, count(*) AS n FROM gloo.calls GROUP BY rank"),
    ("cluster", "SELECT rank, count(*) AS n FROM process.threads GROUP BY rank"),
]


def median_step_ms(job: Launch, t0: float, t1: float) -> float | None:
    """The median step time (ms) of every rank's steps that ended in [t0, t1]."""
    gaps = []
    for ends in job.step_times().values():
        inside = [t for t in ends if t0 <= t <= t1]
        gaps += [(b - a) * 1e3 for a, b in zip(inside, inside[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def soak(pids: list[int], per_client: int, clients: int) -> dict:  # type: ignore[type-arg]
    errors: Counter[str] = Counter()
    examples: dict[str, str] = {}
    lat: list[float] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for i in range(per_client):
            kind, sql = QUERIES[(i * clients + k) % len(QUERIES)]
            pid = pids[(i + k) % len(pids)]
            t = time.perf_counter()
            try:
                c = ProbeClient.for_pid(pid, timeout=30)
                if kind == "cluster":
                    c.cluster_query(sql, timeout=10, strict=True)
                else:
                    c.query(sql)
                c.close()
            except Exception as err:  # counted and reported
                with lock:
                    errors[f"{kind}: {type(err).__name__}"] += 1
                    examples.setdefault(f"{kind}: {type(err).__name__}", str(err)[:200])
                continue
            with lock:
                lat.append(time.perf_counter() - t)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    lat.sort()
    return {
        "queries": per_client * clients,
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
        "error_examples": examples,
        "seconds": round(took, 1),
        "qps": round(per_client * clients / took, 1),
        "latency_ms_p50": round(lat[len(lat) // 2] * 1e3, 1) if lat else None,
        "latency_ms_p99": round(lat[int(len(lat) * 0.99)] * 1e3, 1) if lat else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=2500, help="per client, over all rounds")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--untraced-s", type=float, default=20.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    per_round = args.queries // args.rounds
    rounds = []
    for r in range(args.rounds):
        base = Launch("env", tmp, probe=False)
        try:
            base.wait_steps(3)
            t0 = time.time()
            time.sleep(args.untraced_s)
            untraced = median_step_ms(base, t0, time.time())
        finally:
            base.stop()
        job = Launch("env", tmp)
        try:
            job.wait_steps(3)
            pids = [p for _, p in sorted(job.ranks().items())]
            assert len(pids) == WORLD, pids
            trace_errors = trace_all(pids, ["gloo"])
            t0 = time.time()
            time.sleep(args.untraced_s / 2)  # traced, nobody asking
            quiet = median_step_ms(job, t0, time.time())
            t0 = time.time()
            result = soak(pids, per_round, args.clients)
            traced = median_step_ms(job, t0, time.time())
            alive = all(p.poll() is None for p in job.procs)
        finally:
            job.stop()
        rounds.append(
            {
                "round": r,
                "untraced_step_ms": round(untraced, 2) if untraced else None,
                "traced_quiet_step_ms": round(quiet, 2) if quiet else None,
                "traced_soaked_step_ms": round(traced, 2) if traced else None,
                "trace_errors": trace_errors,
                "job_alive": alive,
                **result,
            }
        )
    out = {
        "bench": "soak",
        "ranks": WORLD,
        "clients": args.clients,
        "queries": sum(r["queries"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds) + sum(len(r["trace_errors"]) for r in rounds),
        "untraced_step_ms_median": statistics.median(
            r["untraced_step_ms"] for r in rounds if r["untraced_step_ms"]
        ),
        "traced_quiet_step_ms_median": statistics.median(
            r["traced_quiet_step_ms"] for r in rounds if r["traced_quiet_step_ms"]
        ),
        "traced_soaked_step_ms_median": statistics.median(
            r["traced_soaked_step_ms"] for r in rounds if r["traced_soaked_step_ms"]
        ),
        "rounds": rounds,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
