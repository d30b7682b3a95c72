"""Whether ``probing diagnose`` blames the real cause on real frameworks
(root; one JSON object).

Jobs from PyPI (``tests/jobs/frameworks/``: HF ``Trainer``, FSDP2, Lightning
``ddp``, a ``torch.distributed.pipelining`` GPipe), 4 ranks on Gloo, each run
a fresh job started without probing and traced later on every rank. Each run
draws a rank and a size and one cause:

* ``off_cpu``: the user's function sleeps (a slow collate, a slow read);
* ``cpu``: the user's function does extra CPU work (in forward);
* ``loader_worker``: the collate sleeps in the DataLoader's worker processes
  (HF with 2 workers a rank);
* ``cpu_hog``: a busy process shares the rank's core (``taskset``), in a
  job that leaves CPUs free (Lightning, every rank waiting 30 ms a step);
* ``healthy``: nothing.

A run is *detected* when the verdict names the drawn rank (for the pipeline,
as its slow stage), *headline right* when the cause the verdict gives after
"of its step time" names the cause (the function, "its DataLoader's worker
processes", "CPU starvation"), a *false alarm* when a healthy run names a
rank. ``starvation_wrong``: CPU starvation headlined for another cause.
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

from probing.demo import trace_all  # noqa: E402 - after the path for tests.jobs
from tests.jobs.framework import ENV, WORLD, start, starve  # noqa: E402

FUNCTION = {"hf_trainer": "collate_tokens", "fsdp2": "heavy_features",
            "lightning_ddp": "heavy_features", "pipeline": "stage_work"}  # fmt: skip
CAUSES = ("off_cpu", "cpu", "loader_worker", "cpu_hog", "healthy")
SIZES_MS = (30, 60, 100)


def blamed(framework: str, cause: str) -> str:
    if cause == "loader_worker":
        return "its DataLoader's worker processes"
    if cause == "cpu_hog":
        return "CPU starvation"
    return FUNCTION[framework]


ONLY = {"loader_worker": "hf_trainer", "cpu_hog": "lightning_ddp"}  # the jobs that have it


def applies(framework: str, cause: str) -> bool:
    return ONLY.get(cause, framework) == framework


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
    slow = rng.randrange(WORLD)
    ms = rng.choice(SIZES_MS)
    env = {"SLOW_MS": "0" if cause in ("healthy", "cpu_hog") else str(ms)}
    env["SLOW_KIND"] = "cpu" if cause == "cpu" else "sleep"
    if cause == "loader_worker":  # 2 workers prefetch: a batch must take longer to show
        env.update(WORKERS="2", SLOW_MS=str(4 * ms))
    if cause == "cpu_hog":  # every rank waits 30 ms a step: CPUs are free but one
        env["PACE_MS"] = "30"
    with tempfile.TemporaryDirectory() as tmp:
        job = start(framework, str(ENV / "bin" / "python"), Path(tmp), False, slow, **env)
        hogs = []
        try:
            ranks = job.wait_ready()
            errors = trace_all(list(ranks.values()), ["gloo"])
            if cause == "cpu_hog":
                hogs = [starve(ranks[slow], 1)]
            time.sleep(window + 2)
            d = diagnose(ranks[(slow + 1) % WORLD], window)
        finally:
            for h in hogs:
                h.kill()
                h.wait(timeout=10)
            job.stop()
    got = named(d, framework)
    verdict = d.get("verdict", "")
    head = verdict.split(" of its step time", 1)[-1] if framework != "pipeline" else verdict
    return {
        "framework": framework, "cause": cause, "rank": slow, "ms": ms, "named": got,
        "detected": got == slow, "headline_right": got == slow and blamed(framework, cause) in head,
        "false_alarm": cause == "healthy" and got is not None,
        "starvation_wrong": cause != "cpu_hog" and "CPU starvation" in head,
        "verdict": verdict, "errors": errors or d.get("error"),
    }  # fmt: skip


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
    os.environ.setdefault("PROBING_RUNTIME_DIR", tempfile.mkdtemp(prefix="why-bench-"))
    cells = [(f, c) for f in args.frameworks.split(",") for c in args.causes.split(",")
             if applies(f, c)]  # fmt: skip
    runs = []
    t0 = time.monotonic()
    for _ in range(args.runs):
        for f, c in rng.sample(cells, len(cells)):
            runs.append(one_run(f, c, rng, args.window))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"window_s": args.window, "sizes_ms": SIZES_MS, "ranks": WORLD,
                      "elapsed_s": round(time.monotonic() - t0), "summary": summary(runs),
                      "runs": runs}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
