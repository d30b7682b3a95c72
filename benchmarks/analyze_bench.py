"""A detection's analysis of one window (``diagnose.analyze``), this tree's
against ``--baseline``'s, on the same rows; prints JSON, one object a case.

Each case is a window of ``comm.collectives`` rows as the detector gathers
them: a DDP job of ``--ranks`` ranks, ``--buckets`` all-reduces a step,
``--rate`` collectives a second per rank over ``--window`` s (the detector's
``WINDOW_S``), arrivals jittered by 1 ms; healthy, or with one rank 20 ms
late before each step's first all-reduce. Each tree (``--baseline REV``, a
temporary worktree, then this one) analyzes it in a process of its own
(``PYTHONPATH`` that tree), ``--repeat`` times: the least thread CPU time
(ms) is kept, and the verdict and the stragglers named are checked to be
the same for both trees.

    python benchmarks/analyze_bench.py [--ranks 4,8] [--rate 100] [--window 30]
        [--buckets 4] [--repeat 5] [--baseline REV]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from surface_diff import worktree

REPO = Path(__file__).resolve().parent.parent
T0 = 1_765_000_000 * 10**9

# run in each tree's process: the window analyzed, the best CPU time and the verdict
ANALYZE = """
import json, sys, time
import pyarrow.feather as feather
from probing.analyze.diagnose import analyze
table = feather.read_table(sys.argv[1])
now, window, repeat = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
best = None
for _ in range(repeat):
    t0 = time.thread_time()
    d = analyze(table, now_ns=now, window_s=window)
    spent = time.thread_time() - t0
    best = spent if best is None else min(best, spent)
print(json.dumps({"ms": round(best * 1e3, 1), "verdict": d.verdict,
                  "stragglers": [s.rank for s in d.stragglers]}))
"""


def window(ranks: int, rate: float, seconds: float, buckets: int, late: int | None) -> pa.Table:
    """The rows of ``seconds`` of a DDP job, as the detector's query returns them."""
    rng = np.random.default_rng(1)
    per_step_ms = 1e3 * buckets / rate
    rows: dict[str, list[Any]] = {k: [] for k in (
        "backend", "op", "comm", "seq", "comm_rank", "nranks", "bytes", "ts", "dur_ns",
        "pid", "tid", "peer", "tag", "wait_ns", "node", "rank")}  # fmt: skip
    t = float(T0)
    for k in range(int(rate * seconds)):
        first = k % buckets == 0
        gap = per_step_ms * 0.6 if first else per_step_ms * 0.4 / buckets
        arrive = t + gap * 1e6 + rng.normal(0, 1e6, ranks).clip(-3e6, 3e6)
        if late is not None and first:
            arrive[late] += 20e6
        end = arrive.max() + 0.5e6
        for r in range(ranks):
            row = ("gloo", "allreduce", 7, k, r, ranks, 1 << (20 + k % buckets), int(arrive[r]),
                   int(end - arrive[r]), 1000 + r, 1000 + r, None, None, None, "n0", r)  # fmt: skip
            for name, value in zip(rows, row, strict=True):
                rows[name].append(value)
        t = end
    return pa.table(rows)


def run(tree: Path, path: str, now: int, seconds: float, repeat: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", ANALYZE, path, str(now), str(seconds), str(repeat)],
                         env=env, capture_output=True, text=True, check=True)  # fmt: skip
    got: dict[str, Any] = json.loads(out.stdout)
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--ranks", default="4,8", help="ranks, comma-separated")
    p.add_argument("--rate", type=float, default=100.0, help="collectives a second per rank")
    p.add_argument("--window", type=float, default=30.0, help="seconds of collectives")
    p.add_argument("--buckets", type=int, default=4, help="all-reduces a step")
    p.add_argument("--repeat", type=int, default=5, help="analyses a tree, the least kept")
    p.add_argument("--baseline", default=os.environ.get("BENCH_BASELINE"),
                   help="a git revision: its analysis, side by side")  # fmt: skip
    args = p.parse_args()
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(worktree(args.baseline)) if args.baseline else None
        for ranks in (int(r) for r in args.ranks.split(",")):
            for late in (None, ranks - 2):
                print(json.dumps(case(ranks, late, args, base)), flush=True)


def case(
    ranks: int, late: int | None, args: argparse.Namespace, base: Path | None
) -> dict[str, Any]:
    rows = window(ranks, args.rate, args.window, args.buckets, late)
    now = int(rows.column("ts")[-1].as_py()) + 10**9
    with tempfile.NamedTemporaryFile(suffix=".arrow") as f:
        feather.write_feather(rows, f.name)
        after = run(REPO, f.name, now, args.window, args.repeat)
        before = run(base, f.name, now, args.window, args.repeat) if base is not None else None
    out: dict[str, Any] = {"ranks": ranks, "rows": rows.num_rows, "late_rank": late,
                           "after_ms": after["ms"], "verdict": after["verdict"][:120],
                           "stragglers": after["stragglers"]}  # fmt: skip
    if before is not None:
        out.update(
            before_ms=before["ms"],
            speedup=round(before["ms"] / max(after["ms"], 1e-9), 2),
            same=before["verdict"] == after["verdict"]
            and before["stragglers"] == after["stragglers"],
        )
    return out


if __name__ == "__main__":
    main()
