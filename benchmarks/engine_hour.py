"""The node engine's memory over a long trace; prints JSON, one object.

``jobs/paced.py`` is started as ``engine_cost.py`` starts it (one process a
rank, Gloo on CPU, in a runtime directory of its own: a fresh engine) and
traced as there (``probing trace --pid R0 --cluster --background``, stacks
and the job's watch on). Then for ``--duration`` seconds, every ``--every``
s: the engine's RSS (MB), threads, descriptors, its CPU (s/s) over the
interval and the job's collectives a second per rank (its own count, DDP
only). The summary: RSS at most over the first ``--first-s`` of tracing,
at the end and at most after; the growth (end less that first maximum);
threads and descriptors first and last. The job, the engine and the
runtime directory go at the end, on Ctrl-C (the rows so far are printed)
or SIGTERM too.

    python benchmarks/engine_hour.py [--case ddp:4] [--rate 100] [--duration 3600]
        [--every 30] [--first-s 300] [--detect-off] [--engine-env NAME=VALUE ...]

``--detect-off``: the job's watch off (what the detector holds, by
difference); ``--engine-env``: a variable set in the engine's environment
(an allocator's options, tried side by side).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_cost import PER_STEP, Job, job_env, stop, trace, with_engine_env


def sample(proc: psutil.Process) -> dict[str, Any]:
    """What the engine holds now, and its CPU seconds so far."""
    with proc.oneshot():
        mem = proc.memory_info()
        return {
            "rss_mb": round(mem.rss / 2**20, 1),
            # of which file pages (the libraries' code it ran, RssFile): the rest is anonymous
            "file_mb": round(mem.shared / 2**20, 1),
            "threads": proc.num_threads(),
            "fds": proc.num_fds(),
            "cpu_s": sum(proc.cpu_times()[:2]),
        }


def watch(proc: psutil.Process, job: Job, shape: str, duration: float, every: float,
          out: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """A row every ``every`` s for ``duration`` s; an engine that exits or a
    Ctrl-C ends it early, said in ``out``."""
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    last, n_last, t_last = sample(proc), job.counted(), t0
    try:
        for k in range(1, int(duration / every + 1e-9) + 1):
            time.sleep(max(0.0, t0 + k * every - time.monotonic()))
            now, n, t = sample(proc), job.counted(), time.monotonic()
            span = t - t_last
            rate = round((n - n_last) / len(job.pids) / span, 1) if shape == "ddp" else None
            cpu = round((now["cpu_s"] - last["cpu_s"]) / span, 4)
            rows.append({"t_s": round(t - t0, 1), "rss_mb": now["rss_mb"],
                         "file_mb": now["file_mb"], "threads": now["threads"], "fds": now["fds"],
                         "engine_cpu": cpu, "rate": rate})  # fmt: skip
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            last, n_last, t_last = now, n, t
    except psutil.Error as err:
        out["error"] = f"the engine is gone after {time.monotonic() - t0:.0f} s: {err}"
    except KeyboardInterrupt:
        out["interrupted_s"] = round(time.monotonic() - t0, 1)
    return rows


def summary(rows: list[dict[str, Any]], first_s: float) -> dict[str, Any]:
    if not rows:
        return {}
    first = [r["rss_mb"] for r in rows if r["t_s"] <= first_s]
    after = [r["rss_mb"] for r in rows if r["t_s"] > first_s]
    first5_max = max(first) if first else None
    end = rows[-1]["rss_mb"]
    return {
        "first5_max_mb": first5_max,
        "end_mb": end,
        "after5_max_mb": max(after) if after else None,
        "growth_mb": round(end - first5_max, 1) if first5_max is not None else None,
        "file_mb_first": rows[0]["file_mb"],
        "file_mb_last": rows[-1]["file_mb"],
        "threads_first": rows[0]["threads"],
        "threads_last": rows[-1]["threads"],
        "fds_first": rows[0]["fds"],
        "fds_last": rows[-1]["fds"],
    }


def interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the same cleanup


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--case", default="ddp:4", help="shape:ranks (ddp or fsdp2)")
    p.add_argument("--rate", type=float, default=100.0, help="collectives a second per rank asked")
    p.add_argument("--duration", type=float, default=3600.0, help="seconds traced and watched")
    p.add_argument("--every", type=float, default=30.0, help="seconds between rows")
    p.add_argument("--first-s", type=float, default=300.0,
                   help="seconds of tracing whose RSS maximum the growth is from")  # fmt: skip
    p.add_argument("--detect-off", action="store_true", help="PROBING_DETECT_S=0: no watch")
    p.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in the engine's environment (again for more)")  # fmt: skip
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("engine_hour: needs root (BPF)")
    shape, world = args.case.split(":")
    signal.signal(signal.SIGTERM, interrupted)
    out: dict[str, Any] = {"benchmark": "engine_hour", "case": args.case, "rate_asked": args.rate,
                           "duration_s": args.duration, "every_s": args.every,
                           "first_s": args.first_s, "detect": not args.detect_off,
                           "engine_env": args.engine_env}  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="probing-hour-")
    try:
        env, rt = job_env(tmp, detect=not args.detect_off)
        with_engine_env(env, args.engine_env)
        job = Job(shape, int(world), 1e3 * PER_STEP[shape] / args.rate, env, tmp)
        try:
            rows = watch(trace(env, job, rt), job, shape, args.duration, args.every, out)
        finally:
            stop(job, rt)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out.update(summary=summary(rows, args.first_s), rows=rows)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
