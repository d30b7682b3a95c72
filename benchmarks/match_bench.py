"""``collectives.match`` and ``export``'s ``CollectiveIndex``: before and after; prints JSON.

Two tables of ``comm.collectives`` rows:

* ``scripted_job``: the rows of ``export_bench.py``'s scripted 4-rank job
  (``--events`` events, one Gloo all-reduce per rank per step), read through
  the same queries ``CollectiveIndex`` asks (``pg`` from ``comm.groups``);
* ``gloo``: a larger Gloo-like table built here, ``--ranks`` ranks of
  ``--calls`` calls each: a world group and two halves (every other rank), each
  named by its process group, one rank's trace begun 2,000 collectives late and
  another's 500 (their seqs start at 0: offsets), a rank with calls in flight.

Measured in one run, each ``--repeat`` times (best kept): ``match`` and
``CollectiveIndex`` (built from the rows already read: the query is timed
apart as ``query_s``) of this tree (``after``) and of ``--baseline``, a git
revision (``before``; default: the row-by-row match this change replaced), whose
answers are checked to be the same.

    python benchmarks/match_bench.py [--events 1000000] [--ranks 8] [--calls 50000]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("PROBING_QUERY_MEMORY_MB", "1024")

from probing.analyze import collectives  # noqa: E402
from probing.analyze.gather import with_groups  # noqa: E402
from probing.analyze.queries import queries  # noqa: E402
from probing.cli.export import timeline  # noqa: E402
from probing.cli.export.window import ExportWindow  # noqa: E402

BASELINE = "e4fd78e"  # main before the columnar match


def load(rev: str, path: str, name: str, tmp: str) -> types.ModuleType:
    """``path`` as it was at git revision ``rev``, imported as ``name``."""
    show = ["git", "-C", str(REPO), "show", f"{rev}:{path}"]
    src = subprocess.run(show, check=True, capture_output=True, text=True).stdout
    file = Path(tmp) / f"{name}.py"
    file.write_text(src)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def swapped(mod: types.ModuleType, name: str = "probing.analyze.collectives") -> Iterator[None]:
    """Module ``name`` is ``mod`` meanwhile (the old ``CollectiveIndex`` imports
    its ``match`` when built, the old timeline its ``perfetto`` when loaded)."""
    was = sys.modules[name]
    sys.modules[name] = mod
    try:
        yield
    finally:
        sys.modules[name] = was


class Cached:
    """An ``ExportWindow`` whose ``whole`` answers from rows read once."""

    def __init__(self, win: ExportWindow, tables: dict[str, pa.Table]) -> None:
        self.source, self.since_ns, self.tables = win.source, win.since_ns, tables

    def whole(self, sql: str) -> pa.Table:
        return self.tables[sql]


def best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """The least time of ``repeat`` calls, each as in a process that keeps no
    other answer (what the collector has to walk counts), and the last answer."""
    times, out = [], None
    for _ in range(repeat):
        out = None
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def rows_of(cs: list[Any]) -> list[tuple[Any, ...]]:
    return [(c.comm, c.seq, c.op, c.nranks, c.bytes, list(c.ts.items()), list(c.end.items()))
            for c in cs]  # fmt: skip


def gloo_table(ranks: int, calls: int, seed: int = 0) -> pa.Table:
    """``ranks`` ranks' Gloo calls, ``calls`` each (see the module doc), rank by rank."""
    rng = np.random.default_rng(seed)
    half = calls // 2
    skipped = np.zeros(ranks, dtype=np.int64)
    skipped[ranks - 3], skipped[1] = 2000, 500  # traced from later
    names = ("op", "comm", "seq", "comm_rank", "nranks", "ts", "dur_ns", "pid", "node", "rank")
    cols: dict[str, list[Any]] = {c: [] for c in (*names, "pg")}
    step = 4_000_000
    for r in range(ranks):
        for g, (op, members, pg) in enumerate([
            ("allreduce", list(range(ranks)), "0"),
            ("allgather", list(range(r % 2, ranks, 2)), str(1 + r % 2)),
        ]):  # fmt: skip
            k = np.arange(skipped[r], half, dtype=np.int64)
            t = 1_763_880_000 * 10**9 + k * step + g * step // 2
            ends = t + 1_500_000 + (k * 7919 % 5000)  # the same in every rank
            ts = t + rng.integers(0, 1_000_000, len(k))
            dur: list[Any] = (ends + rng.integers(0, 3000, len(k)) - ts).tolist()
            if r == 2:
                dur[-1] = None  # still inside
            n = len(k)
            cols["op"] += [op] * n
            cols["comm"] += [0x10000 * (g + 1) + 64 * r] * n  # a local pointer per process
            cols["seq"] += (k - skipped[r]).tolist()
            cols["comm_rank"] += [members.index(r)] * n
            cols["nranks"] += [len(members)] * n
            cols["ts"] += ts.tolist()
            cols["dur_ns"] += dur
            cols["pid"] += [1000 + r] * n
            cols["node"] += [f"host{r // 4}"] * n
            cols["rank"] += [r] * n
            cols["pg"] += [pg] * n
    n = len(cols["ts"])
    return pa.table({
        "backend": pa.array(["gloo"] * n), **{c: pa.array(v) for c, v in cols.items()},
        "bytes": pa.array(np.full(n, 4096, dtype=np.int64)),
    })  # fmt: skip


def measure(
    table: pa.Table, win: Any, old: types.ModuleType, old_timeline: types.ModuleType, repeat: int
) -> dict[str, Any]:
    before, cs = best(lambda: old.match(table), repeat)
    want, cs = rows_of(cs), None
    after, cs = best(lambda: collectives.match(table), repeat)
    assert rows_of(cs) == want, "the matches differ"
    n, want, cs = len(cs), None, None
    with swapped(old):
        i_before, old_ix = best(lambda: old_timeline.CollectiveIndex(win), repeat)
    i_after, new_ix = best(lambda: timeline.CollectiveIndex(win), repeat)
    gc.collect()
    comm = [new_ix.comms[k] for k in new_ix.comm.tolist()]
    assert old_ix.comm == comm and (old_ix.seq == new_ix.seq).all()
    # the flow ids are hashed another way since (``flow_ids``): one per collective still
    assert len(np.unique(new_ix.flow)) == len(set(zip(comm, new_ix.seq.tolist(), strict=True)))
    assert old_ix._by_rank.keys() == new_ix._by_rank.keys()
    for r, (ts, which) in old_ix._by_rank.items():
        assert (ts == new_ix._by_rank[r][0]).all() and (which == new_ix._by_rank[r][1]).all()
    m_s, _ = best(lambda: collectives.matched(table), repeat)
    return {
        "rows": table.num_rows,
        "collectives": n,
        "match_s": {"before": round(before, 4), "after": round(after, 4)},
        "match_speedup": round(before / after, 1),
        "matched_s": round(m_s, 4),  # the columnar match alone (no Collective objects)
        "index_s": {"before": round(i_before, 4), "after": round(i_after, 4)},
        "index_speedup": round(i_before / i_after, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--kernels", type=int, default=6)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--calls", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the 'before'")
    args = ap.parse_args()
    from export_bench import job

    with tempfile.TemporaryDirectory() as tmp:
        old = load(args.baseline, "probing/analyze/collectives.py", "old_collectives", tmp)
        old_perfetto = load(args.baseline, "probing/cli/export/perfetto.py", "old_perfetto", tmp)
        with swapped(old_perfetto, "probing.cli.export.perfetto"):
            old_timeline = load(
                args.baseline, "probing/cli/export/timeline.py", "old_timeline", tmp
            )
        src, window_s = job(args.events, args.kernels)
        win = ExportWindow(src, window_s=window_s)
        sql = queries(win.source.remote)
        coll_sql = sql["collectives"].format(since_ns=win.since_ns)
        t0 = time.perf_counter()
        read = {coll_sql: win.whole(coll_sql), sql["groups"]: win.whole(sql["groups"])}
        query_s = time.perf_counter() - t0
        g_s, table = best(lambda: with_groups(read[coll_sql], read[sql["groups"]]), args.repeat)
        scripted = measure(table, Cached(win, read), old, old_timeline, args.repeat)
        scripted.update(events=args.events, query_s=round(query_s, 3),
                        with_groups_s=round(g_s, 4))  # fmt: skip
        big = gloo_table(args.ranks, args.calls)
        cached = Cached(win, {coll_sql: big, sql["groups"]: pa.table({})})
        gloo = measure(big, cached, old, old_timeline, args.repeat)
        gloo.update(ranks=args.ranks, calls_per_rank=args.calls)
    out = {"scripted_job": scripted, "gloo": gloo, "baseline": args.baseline,
           "cpus": os.cpu_count()}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
