"""How well ``probing diagnose`` finds a straggler, and how fast (root; one JSON object).

A real 4-rank DDP job (Gloo, CPU; ``probing/cli/demo/job.py``) started
without probing and traced with ``probing trace`` on every rank. Its slow
rank is read from a file every step, so one job serves every run: each run
draws a rank (or none, for a healthy run) and a delay, waits for the job to
settle, and diagnoses only the last ``--window`` seconds. ``--fresh-jobs N``
adds N runs that start a new job each (the demo's path, end to end).

Side by side, a naive baseline on the same data: the rank with the largest
mean arrival lag is the straggler when that lag exceeds 2 ms (no robust
statistics, no test of how often it is last).

Figures: straggler detection accuracy, false positives on healthy runs (for
both detectors), and the time from ``probing diagnose`` (the command, a new
process; over the 4 local pids, and ``--pid P --cluster``) to its verdict,
and the gathering and analysis alone, for 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from probing.analyze.collectives import match
from probing.cli.asking import diagnose
from probing.cli.demo import DemoJob, trace_all

WORLD = 4


def naive(table) -> int | None:  # type: ignore[no-untyped-def]
    """The rank with the largest mean lag behind the first arrival, if > 2 ms."""
    lags: dict[int, list[float]] = {}
    for c in match(table):
        if c.complete:
            for r, lag in c.lags_ns().items():
                lags.setdefault(r, []).append(lag / 1e6)
    if not lags:
        return None
    rank = max(lags, key=lambda r: statistics.fmean(lags[r]))
    return rank if statistics.fmean(lags[rank]) > 2.0 else None


def one_run(pids: list[int], truth: int | None, window: float) -> dict:  # type: ignore[type-arg]
    from probing.cli.client import JobClient

    d, table = diagnose(JobClient(pids=pids), window_s=window, hang_after_s=3600)
    named = [s.rank for s in d.stragglers]
    return {
        "truth": truth,
        "named": named,
        "naive": naive(table),
        "analysis_s": d.elapsed_s,
        "verdict": d.verdict,
    }


def cli_seconds(pids: list[int], window: float, cluster: bool = False) -> float:
    args = [a for p in pids for a in ("--pid", str(p))]
    if cluster:  # one rank's probe asks its peers
        args = ["--pid", str(pids[0]), "--cluster"]
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "probing", "diagnose", *args, "--window", f"{window}s"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if r.returncode:
        raise SystemExit(f"probing diagnose failed: {r.stderr.strip()}")
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--straggler-runs", type=int, default=20)
    p.add_argument("--healthy-runs", type=int, default=10)
    p.add_argument("--fresh-jobs", type=int, default=0)
    p.add_argument("--window", type=float, default=2.5, help="seconds diagnosed per run")
    p.add_argument("--settle", type=float, default=0.7, help="seconds after a change")
    noise_args(p)
    args = p.parse_args()
    if args.noise:
        print(json.dumps(noise_bench(args), indent=1))
        return
    rng = random.Random()
    plan = [rng.randrange(WORLD) for _ in range(args.straggler_runs)]
    plan += [None] * args.healthy_runs
    rng.shuffle(plan)
    runs = []
    with tempfile.TemporaryDirectory() as d:
        ctl = Path(d) / "slow"
        ctl.write_text("-1 0")
        job = DemoJob(WORLD, job_args=["--slow-file", str(ctl)])
        try:
            job.wait_ready(timeout=120)
            errors = trace_all(job.pids, ["gloo"])
            if errors:
                raise SystemExit(f"tracing failed: {errors}")
            for truth in plan:
                ms = rng.uniform(15, 60)
                ctl.write_text(f"{truth if truth is not None else -1} {ms:.1f}")
                time.sleep(args.settle + args.window)
                runs.append({**one_run(job.pids, truth, args.window), "slow_ms": round(ms, 1)})
            ctl.write_text("-1 0")
            time.sleep(args.window)
            cli = [cli_seconds(job.pids, args.window) for _ in range(5)]
            cli_cluster = [cli_seconds(job.pids, args.window, cluster=True) for _ in range(5)]
        finally:
            job.stop()
    for _ in range(args.fresh_jobs):
        truth = rng.randrange(WORLD)
        job = DemoJob(WORLD, job_args=["--slow-rank", str(truth), "--slow-ms", "40"])
        try:
            job.wait_ready(timeout=120)
            trace_all(job.pids, ["gloo"])
            time.sleep(4)
            runs.append({**one_run(job.pids, truth, 60.0), "slow_ms": 40.0, "fresh": True})
        finally:
            job.stop()
    print(json.dumps(summarize(runs, cli, cli_cluster), indent=1))


def summarize(runs: list[dict], cli: list[float], cli_cluster: list[float]) -> dict:  # type: ignore[type-arg]
    strag = [r for r in runs if r["truth"] is not None]
    healthy = [r for r in runs if r["truth"] is None]

    def acc(key: str) -> float | None:
        ok = [r for r in strag if (r[key] == [r["truth"]] if key == "named" else
                                   r[key] == r["truth"])]  # fmt: skip
        return round(len(ok) / len(strag), 4) if strag else None

    def false_pos(key: str) -> int:
        return sum(1 for r in healthy if (r[key] if key == "named" else r[key] is not None))

    analysis = sorted(r["analysis_s"] for r in runs)
    return {
        "ranks": WORLD,
        "straggler_runs": len(strag),
        "healthy_runs": len(healthy),
        "probing": {"accuracy": acc("named"), "false_positives": false_pos("named")},
        "naive_baseline": {"accuracy": acc("naive"), "false_positives": false_pos("naive")},
        "diagnose_cli_s": {"median": round(statistics.median(cli), 3), "max": round(max(cli), 3)},
        "diagnose_cli_cluster_s": {
            "median": round(statistics.median(cli_cluster), 3),
            "max": round(max(cli_cluster), 3),
        },
        "analysis_s": {"median": round(statistics.median(analysis), 3), "max": analysis[-1]},
        "misses": [
            {k: r[k] for k in ("truth", "named", "slow_ms", "verdict")}
            for r in strag
            if r["named"] != [r["truth"]]
        ]
        + [{k: r[k] for k in ("truth", "named", "verdict")} for r in healthy if r["named"]],
    }


# -- under noise: a busy and a quiet machine ----------------------------------------------

MACHINES = {
    # torch's default threads on every rank, a bigger model, 20 ms of other work a
    # step, and background processes spinning on the CPUs
    "busy": {"job": ["--hidden", "1024", "--work-ms", "20"], "spinners": 2},
    "quiet": {"job": ["--threads", "1", "--hidden", "256", "--work-ms", "5"], "spinners": 0},
}
CAUSE = {"loader": "load_batch", "compute": "augment"}  # injected kind -> the function


def noise_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--noise", action="store_true", help="the noise benchmark (below)")
    p.add_argument("--machines", default="busy,quiet")
    p.add_argument("--sizes", default="0.05,0.1,0.2,0.4,0.6", help="slowdown / step time")
    p.add_argument("--runs-per-size", type=int, default=4)
    p.add_argument("--noise-healthy-runs", type=int, default=20)
    p.add_argument(
        "--noise-window", default="busy=30,quiet=10",
        help="seconds diagnosed per run: one for every machine, or MACHINE=S pairs",
    )  # fmt: skip
    p.add_argument("--spinners", type=int, default=None, help="override the machine's")


def diagnose_json(pids: list[int], window: float) -> dict:  # type: ignore[type-arg]
    """``probing diagnose --format json`` over the local pids, as a user runs it."""
    args = [a for p in pids for a in ("--pid", str(p))]
    r = subprocess.run(
        [sys.executable, "-m", "probing", "diagnose", *args, "--window", f"{window:g}s",
         "--hang-after", "3600s", "--format", "json"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    if r.returncode:
        return {"error": r.stderr.strip()[-300:], "stragglers": [], "why": []}
    return json.loads(r.stdout)


def noise_bench(args: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    """Stragglers of 5-60 % of the step time on a random rank (a slow loader or
    extra CPU work in one function, at random) and healthy runs, each diagnosed
    over the last ``--noise-window`` s of one traced ``tests/jobs/noisy_job.py``
    job per machine: detection rate per size, false alarms, why named the cause."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.jobs.noisy import NoisyJob

    rng = random.Random()
    sizes = [float(x) for x in args.sizes.split(",")]
    windows = noise_windows(args.noise_window)
    out: dict[str, object] = {"ranks": WORLD}
    for machine in args.machines.split(","):
        conf = MACHINES[machine]
        window = windows.get(machine, windows.get("", 10.0))
        load_before = os.getloadavg()
        t_start = time.monotonic()
        spinners = conf["spinners"] if args.spinners is None else args.spinners
        hogs = [
            subprocess.Popen([sys.executable, "-c", "while 1: pass"], start_new_session=True)
            for _ in range(spinners)  # type: ignore[call-overload]
        ]
        plan: list[tuple[float | None, str | None]] = [
            (size, rng.choice(sorted(CAUSE))) for size in sizes for _ in range(args.runs_per_size)
        ]
        plan += [(None, None)] * args.noise_healthy_runs
        rng.shuffle(plan)
        runs = []
        with tempfile.TemporaryDirectory() as d:
            job = NoisyJob(Path(d), *conf["job"])  # type: ignore[arg-type]
            try:
                job.wait_ready(timeout=180)
                errors = trace_all(job.pids, ["gloo"])
                if errors:
                    raise SystemExit(f"tracing failed: {errors}")
                time.sleep(window)
                base = diagnose_json(job.pids, window)
                step_ms = float(base.get("summary", {}).get("step_ms") or 100.0)
                for size, kind in plan:
                    rank = rng.randrange(WORLD) if size is not None else -1
                    ms = (size or 0.0) * step_ms
                    job.slow(rank, kind or "none", ms)
                    time.sleep(window + 2.0)  # every rank past the change
                    got = diagnose_json(job.pids, window)
                    named = [s["rank"] for s in got["stragglers"]]
                    funcs = [w["what"] for w in got["why"] if w["kind"] == "function"]
                    runs.append({
                        "size": size, "kind": kind, "rank": rank, "ms": round(ms, 1),
                        "named": named, "why_top": funcs[0] if funcs else None,
                        "why_ok": bool(kind and funcs and funcs[0] == CAUSE[kind]),
                        "why": [w["text"] for w in got["why"]][:4],
                        "starved": sorted({w["rank"] for w in got["why"]
                                           if w["kind"] == "cpu_starvation"}),
                        "late_pct": late_pct(got, rank),
                        "late_all": {r: late_pct(got, r) for r in range(WORLD)},
                        "step_ms": (got.get("summary") or {}).get("step_ms"),
                        "load": round(os.getloadavg()[0], 1),
                        "verdict": got.get("verdict") or got.get("error"),
                    })  # fmt: skip
                    print(json.dumps({"machine": machine, **runs[-1]}), file=sys.stderr,
                          flush=True)  # fmt: skip
            finally:
                job.stop()
                for h in hogs:
                    h.kill()
                    h.wait()
        out[machine] = {
            "window_s": window,
            **noise_summary(runs, sizes, step_ms, spinners, conf["job"]),  # type: ignore[arg-type]
            "load_average_before": [round(x, 1) for x in load_before],
            "load_average_after": [round(x, 1) for x in os.getloadavg()],
            "wall_s": round(time.monotonic() - t_start),
        }
    return out


def noise_windows(text: str) -> dict[str, float]:
    """``--noise-window``: ``10`` (every machine; key "") or ``busy=30,quiet=10``."""
    if "=" not in text:
        return {"": float(text)}
    pairs = (item.split("=", 1) for item in text.split(","))
    return {name.strip(): float(sec) for name, sec in pairs}


def late_pct(got: dict, rank: int) -> float | None:  # type: ignore[type-arg]
    """How late ``rank`` arrived after the others' median, in % of the step: what
    the injected slowdown cost in this run (an off-CPU delay on a saturated CPU
    is partly or wholly absorbed: the others use the CPU meanwhile)."""
    step = (got.get("summary") or {}).get("step_ms")
    row = next((r for r in got.get("ranks") or [] if r["rank"] == rank), None)
    if rank < 0 or not step or row is None or row.get("excess_ms_median") is None:
        return None
    return round(100 * row["excess_ms_median"] / step, 1)


def noise_summary(
    runs: list[dict],
    sizes: list[float],
    step_ms: float,
    spinners: int,
    job: list[str],  # type: ignore[type-arg]
) -> dict:  # type: ignore[type-arg]
    curve = {}
    for size in sizes:
        at = [r for r in runs if r["size"] == size]
        hit = [r for r in at if r["named"] == [r["rank"]]]
        late = sorted(r["late_pct"] for r in at if r.get("late_pct") is not None)
        curve[f"{size:g}"] = {
            "runs": len(at),
            "named": len(hit),
            "rate": round(len(hit) / len(at), 3) if at else None,
            "why_right": sum(r["why_ok"] for r in hit),
            "by_kind": {
                kind: f"{sum(r['named'] == [r['rank']] for r in at if r['kind'] == kind)}"
                f"/{sum(r['kind'] == kind for r in at)}"
                for kind in sorted(CAUSE)
            },
            # what the slowdown cost: the slowed rank's lateness, % of the step
            "late_pct_median": late[len(late) // 2] if late else None,
            "late_pct_range": [late[0], late[-1]] if late else None,
        }
    healthy = [r for r in runs if r["size"] is None]
    hits = [r for r in runs if r["size"] is not None and r["named"] == [r["rank"]]]
    # by what the lateness cost (the rule: a rank costing >= 10 % of the
    # step is always named), whatever made it late: an injected slowdown or the machine
    costly = [(r, q) for r in runs for q, pct in r["late_all"].items() if (pct or 0) >= 10]
    by_cost = {}
    for lo, hi in ((-1e9, 5), (5, 10), (10, 20), (20, 1e9)):  # below 5 %: early too
        at = [r for r in runs if r["size"] is not None and lo <= (r["late_pct"] or 0) < hi]
        label = f"<{hi}%" if lo < 0 else f"{lo}-{hi}%" if hi < 1e9 else f">={lo}%"
        by_cost[label] = f"{sum(r['named'] == [r['rank']] for r in at)}/{len(at)}"
    from_10 = [r for r in runs if r["size"] is not None and r["size"] >= 0.1]
    return {
        "job": job,
        "background_spinners": spinners,
        "healthy_step_ms": round(step_ms, 1),
        "detection_by_size": curve,
        "detection_rate_from_10pct": round(
            sum(r["named"] == [r["rank"]] for r in from_10) / len(from_10), 3
        )
        if from_10
        else None,  # fmt: skip
        "detection_by_cost": by_cost,  # slowed rank's lateness, % of the step
        "named_when_costing_10pct": f"{sum(q in r['named'] for r, q in costly)}/{len(costly)}",
        "healthy_runs": len(healthy),
        "false_alarms": sum(1 for r in healthy if r["named"]),
        # of those, a rank the background load really starved: named as CPU starvation
        # and late by >= 10 % of a step by its own figures (the rule above names it)
        "false_alarms_but_starved": sum(
            1
            for r in healthy
            if r["named"]
            and all(q in r["starved"] and (r["late_all"].get(q) or 0) >= 10 for q in r["named"])
        ),
        # a healthy run's named rank: how late it really was, and why (the machine?)
        "false_alarm_detail": [
            {"named": q, "late_pct": r["late_all"].get(q), "why": r["why"][:2]}
            for r in healthy
            for q in r["named"]
        ],
        "why_accuracy": round(sum(r["why_ok"] for r in hits) / len(hits), 3) if hits else None,
        "misses": [
            r
            for r in runs
            if (r["size"] is None) == bool(r["named"])
            or (r["size"] is not None and r["named"] != [r["rank"]])
        ],  # fmt: skip
    }


if __name__ == "__main__":
    main()
