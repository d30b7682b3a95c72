"""Whether ``probing diagnose`` blames the real cause on real frameworks
(root; one JSON object).

Jobs from PyPI (``tests/jobs/frameworks/``: HF ``Trainer``, FSDP2, Lightning
``ddp``, a ``torch.distributed.pipelining`` GPipe, Megatron-Core TP 2 x PP 2,
DeepSpeed ZeRO-2 under its own launcher, a DDP job whose loop runs in a
worker thread while its main thread idles), 4 ranks on Gloo, each run
a fresh job started without probing and traced later on every rank. Each run
draws a rank, a size and one cause (``tests.jobs.framework.Slowed``: the
user's function sleeps or computes; a slow DataLoader worker; a CPU hog on
the rank's core; a throttled stand-in GPU; nothing).

A run is *detected* when the verdict names the drawn rank (for the pipeline,
as its slow stage), *headline right* when the cause the verdict gives after
"of its step time" names the cause (the function, "its DataLoader's worker
processes", "CPU starvation", the GPU's clocks), a *false alarm* when a
healthy run names a rank (a straggler, or a pipeline's slow stage: Megatron's
stages). ``starvation_wrong``: CPU starvation headlined for
another cause. ``per_framework`` (also printed as a table on stderr at the
end): each framework's named runs (a rank slowed), how many were detected and
had their headline right, and the false alarms among its healthy runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probing.cli.demo import trace_all  # after the path for tests.jobs
from tests.jobs.framework import CAUSES, ENV, FUNCTION, WORLD, Slowed, applies

SIZES_MS = (30, 60, 100)


def diagnose(pid: int, window: float) -> dict:  # type: ignore[type-arg]
    r = subprocess.run(
        [sys.executable, "-m", "probing", "diagnose", "--pid", str(pid), "--cluster",
         "--window", f"{window:g}", "--format", "json"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    if r.returncode not in (0, 2):
        return {"error": r.stderr.strip()[-300:], "verdict": "", "stragglers": []}
    return json.loads(r.stdout)


def named(d: dict, framework: str) -> int | None:  # type: ignore[type-arg]
    if framework == "pipeline":
        return (d.get("pipeline") or {}).get("slow")
    return d["stragglers"][0]["rank"] if d.get("stragglers") else None


def one_run(framework: str, cause: str, rng: random.Random, window: float) -> dict:  # type: ignore[type-arg]
    slow, ms = rng.randrange(WORLD), rng.choice(SIZES_MS)
    with tempfile.TemporaryDirectory() as tmp:
        job = Slowed(framework, cause, slow, ms, Path(tmp))
        try:
            ranks = job.ready()
            errors = trace_all(list(ranks.values()), job.families())
            job.traced()
            time.sleep(window + 2)
            asker = ranks[(slow + 1) % WORLD]
            d = diagnose(asker, window)
            sampled = samples_by_rank(asker, window) if d.get("stragglers") else None
        finally:
            job.stop()
    got = named(d, framework)
    stage = (d.get("pipeline") or {}).get("slow")  # a slow stage named: a rank too
    verdict = d.get("verdict", "")
    head = verdict.split(" of its step time", 1)[-1] if framework != "pipeline" else verdict
    return {
        "framework": framework, "cause": cause, "rank": slow, "ms": ms, "named": got,
        "detected": got == slow, "headline_right": got == slow and job.blamed in head,
        "false_alarm": cause == "healthy" and (got is not None or stage is not None),
        "starvation_wrong": cause != "cpu_hog" and "CPU starvation" in head,
        "verdict": verdict, "why": [w["text"] for w in d.get("why", [])][:4],
        "errors": errors or d.get("error"),
        "missing": d.get("missing"), "sampled": sampled,
    }  # fmt: skip


def samples_by_rank(pid: int, window: float) -> dict:  # type: ignore[type-arg]
    """What each rank's sampler recorded over the window (rows, seconds by kind),
    and who did not answer: a wrong headline's first question."""
    from probing.cli.client import cluster_query
    from probing.errors import ProbingError

    since = time.time_ns() - int(window * 1e9)
    sql = ("SELECT rank, kind, count(*) AS n, sum(dur_ns) AS ns FROM python.samples "
           f"WHERE ts >= {since} GROUP BY rank, kind")  # fmt: skip
    try:
        got = cluster_query(sql, pid=pid, timeout=10.0)
    except ProbingError as err:
        return {"error": str(err)}
    out: dict = {str(m.rank): m.reason for m in got.missing}  # type: ignore[type-arg]
    for row in got.table.to_pylist():
        cell = out.setdefault(str(row["rank"]), {})
        cell[row["kind"]] = [row["n"], round((row["ns"] or 0) / 1e9, 2)]
    return out


def summary(runs: list[dict]) -> dict:  # type: ignore[type-arg]
    out: dict[str, dict] = {}  # type: ignore[type-arg]
    for r in runs:
        cell = out.setdefault(r["framework"], {}).setdefault(
            r["cause"], {"runs": 0, "detected": 0, "headline_right": 0, "false_alarms": 0,
                         "starvation_wrong": 0}
        )  # fmt: skip
        cell["runs"] += 1
        cell["detected"] += r["detected"]
        cell["headline_right"] += r["headline_right"]
        cell["false_alarms"] += r["false_alarm"]
        cell["starvation_wrong"] += r["starvation_wrong"]
    return out


def per_framework(runs: list[dict]) -> dict[str, dict[str, int]]:  # type: ignore[type-arg]
    """framework -> named runs (a rank slowed), detected, headline right;
    healthy runs and their false alarms."""
    out: dict[str, dict[str, int]] = {}
    keys = ("named_runs", "detected", "headline_right", "healthy_runs", "false_alarms")
    for r in runs:
        cell = out.setdefault(r["framework"], dict.fromkeys(keys, 0))
        if r["cause"] == "healthy":
            cell["healthy_runs"] += 1
            cell["false_alarms"] += r["false_alarm"]
        else:
            cell["named_runs"] += 1
            cell["detected"] += r["detected"]
            cell["headline_right"] += r["headline_right"]
    return out


def table(cells: dict[str, dict[str, int]]) -> str:
    """``per_framework`` as text: one line a framework."""
    lines = [f"{'framework':<14} {'named':>5} {'detected':>9} {'headline':>10} {'healthy':>7} "
             f"{'false alarms':>12}"]  # fmt: skip
    for name, c in cells.items():
        n = c["named_runs"]
        right = f"{c['headline_right']} ({100 * c['headline_right'] / n:.0f} %)" if n else "-"
        lines.append(f"{name:<14} {n:>5} {c['detected']:>9} {right:>10} "
                     f"{c['healthy_runs']:>7} {c['false_alarms']:>12}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frameworks", default=",".join(FUNCTION))
    ap.add_argument("--causes", default=",".join(CAUSES))
    ap.add_argument("--runs", type=int, default=1, help="runs per framework and cause")
    ap.add_argument("--window", type=float, default=12.0)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    if not (ENV / "bin" / "python").exists():
        sys.exit("the frameworks job environment is missing: run .ci/jobenvs.sh\n")
    rng = random.Random(args.seed)
    ours = "PROBING_RUNTIME_DIR" not in os.environ  # then its engine is stopped at the end
    os.environ.setdefault("PROBING_RUNTIME_DIR", tempfile.mkdtemp(prefix="why-bench-"))
    cells = [(f, c) for f in args.frameworks.split(",") for c in args.causes.split(",")
             if applies(f, c)]  # fmt: skip
    runs = []
    t0 = time.monotonic()
    try:
        for _ in range(args.runs):
            for f, c in rng.sample(cells, len(cells)):
                runs.append(one_run(f, c, rng, args.window))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    finally:  # the engine of the runtime directory made here (a node service) goes too
        if ours:
            subprocess.run([sys.executable, "-m", "probing", "engine", "stop"],
                           capture_output=True, timeout=60, check=False)  # fmt: skip
    by_framework = per_framework(runs)
    print(table(by_framework), file=sys.stderr)
    print(json.dumps({"window_s": args.window, "sizes_ms": SIZES_MS, "ranks": WORLD,
                      "elapsed_s": round(time.monotonic() - t0), "summary": summary(runs),
                      "per_framework": by_framework, "runs": runs}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
