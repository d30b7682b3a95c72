"""``probing export``: time and file size per million events; prints JSON.

A scripted 4-rank job (``tests/test_export.py``'s ``DatabaseProbe``: each rank a
real probing Database over known rows, asked through the same ``Source`` the CLI
uses) holds ``--events`` events: per step one Gloo all-reduce, ``--kernels``
CUDA kernel launches and one stream sync per rank, NVML samples at 10 Hz.
With ``--probes processes`` (the default) each rank's probe is served by a
process of its own and asked over its socket, as ``probing export --pid``
asks a job's; ``inline``, all four answer in this process (their DataFusion
work then shares this process's GIL with the export's).
Measured in one run, each ``--repeat`` times (best kept):

* ``perfetto``: ``export(..., fmt="perfetto")``, the whole command's work;
* ``parquet``: the same window as Parquet files;
* ``query_only`` (the baseline): reading the same rows from the probes with
  the same chunked queries, writing nothing: what the export adds is the rest.

    python benchmarks/export_bench.py [--events 1000000] [--repeat 2] [--probes inline]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# each scripted rank's engine reads its whole table for every chunk: a million
# events need more than a probe's default 256 MiB of query memory
os.environ.setdefault("PROBING_QUERY_MEMORY_MB", "1024")

from probing.cli.export import Source, export  # noqa: E402
from probing.cli.export.window import EVENT_TABLES, ExportWindow  # noqa: E402
from probing.node.bpf import families  # noqa: E402
from probing.node.bpf.pystacks import CALLSITES_SQL  # noqa: E402
from probing.node.tables.trace import COLLECTIVES_SQL  # noqa: E402
from tests.test_export import DatabaseProbe, ScriptedJob, rank_tables  # noqa: E402

WORLD = 4


def rank_rows(rank: int, steps: int, kernels: int, base: int) -> dict[str, pa.Table]:
    """``steps`` steps of one rank, built column-wise (numpy), plus the small tables."""
    small = rank_tables(rank, base)  # stacks, groups, process info, threads, empty inflight
    step_ns = 10_000_000
    i = np.arange(steps, dtype=np.int64)
    t = base + i * step_ns
    pid, tid = 1000 + rank, 2000 + rank
    fam = families.FAMILIES

    def table(schema: pa.Schema, cols: dict[str, object], n: int) -> pa.Table:
        arrays = []
        for f in schema:
            v = cols.get(f.name)
            if v is None:
                arrays.append(pa.nulls(n, f.type))
            elif np.isscalar(v) or isinstance(v, str):
                arrays.append(pa.array([v] * n, f.type))
            else:
                arrays.append(pa.array(v, f.type))
        return pa.Table.from_arrays(arrays, schema=schema)

    gloo = table(fam["gloo"].schema, {
        "event_id": i, "ts": t + rank * 100_000, "dur_ns": np.full(steps, 2_000_000),
        "pid": pid, "tid": tid, "api": "gloo::allreduce", "stack_id": 77, "op": "allreduce",
        "comm": 0xA000 + rank, "seq": i, "rank": rank, "nranks": WORLD, "elements": 1024,
        "bytes": 4096,
    }, steps)  # fmt: skip
    k = np.repeat(i, kernels + 1)
    j = np.tile(np.arange(kernels + 1), steps)
    names = [f"gemm_kernel_{x}" if x < kernels else None for x in j.tolist()]
    apis = ["cudaLaunchKernel" if x < kernels else "cudaStreamSynchronize" for x in j.tolist()]
    cuda = table(fam["cuda"].schema, {
        "event_id": k * 100 + j, "ts": base + k * step_ns + 3_000_000 + j * 10_000,
        "dur_ns": np.where(j < kernels, 4_000, 1_000_000), "pid": pid, "tid": tid, "api": apis,
        "stack_id": 77, "kernel": names,
    }, len(k))  # fmt: skip
    samples = max(1, steps * step_ns // 100_000_000)
    s = np.arange(samples, dtype=np.int64)
    nvml = small["nvml.gpu"].schema
    gpu = table(nvml, {
        "ts": base + s * 100_000_000, "gpu": 0, "uuid": "GPU-0", "util_gpu": s % 100,
        "util_mem": 5, "mem_used": (1 << 30) + s, "mem_total": 80 << 30,
        "power_w": 100.0 + (s % 50), "temp_c": 40, "sm_clock_mhz": 1400,
    }, samples)  # fmt: skip
    return {**small, "gloo.calls": gloo, "cuda.calls": cuda, "nvml.gpu": gpu,
            "nccl.calls": fam["nccl"].schema.empty_table()}  # fmt: skip


def job(
    events: int, kernels: int, probes: list[subprocess.Popen[str]] | None
) -> tuple[Source, int]:
    """The scripted job's source and window. ``probes`` None: each rank an
    ``DatabaseProbe`` in this process; else each rank's probe served by a process
    of its own (started here, appended to ``probes``) and asked over its
    socket, as ``probing export --pid`` asks a job's."""
    per_step = 1 + kernels + 1  # all-reduce + launches + sync
    steps = max(1, events // (WORLD * per_step))
    base = time.time_ns() - steps * 10_000_000 - 5_000_000_000
    window_s = int(min(3600.0, (time.time_ns() - base) / 1e9 + 10))
    if probes is None:
        src = ScriptedJob(pids=[1000 + r for r in range(WORLD)])
        src.probes = {
            1000 + r: DatabaseProbe(rank_rows(r, steps, kernels, base)) for r in range(WORLD)
        }
        return src, window_s
    for r in range(WORLD):
        code = f"import export_bench; export_bench.serve({r}, {steps}, {kernels}, {base})"
        env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'benchmarks'}", "RANK": str(r)}
        probes.append(subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE))  # fmt: skip
    for p in probes:  # each says when it serves
        if p.stdout is None or p.stdout.readline().strip() != "serving":
            raise SystemExit(f"the probe of pid {p.pid} did not start")
    return Source(pids=[p.pid for p in probes]), window_s


def serve(rank: int, steps: int, kernels: int, base: int) -> None:
    """Rank ``rank``'s probe over its rows (an ``DatabaseProbe``'s tables and
    views), served on this process's socket until stdin closes."""
    from probing.node.probe.context import ProbeContext

    tables = rank_rows(rank, steps, kernels, base)

    def install(database: Any, ctx: Any) -> None:
        for qualified, t in tables.items():
            schema, name = qualified.split(".")
            database.register_table(schema, name, lambda t=t: t)
        database.register_view("comm", "collectives", COLLECTIVES_SQL)
        database.register_view("python", "callsites", CALLSITES_SQL)

    ctx = ProbeContext(installers=(install,))  # a probe of this process, as tests build one
    ctx.serve()
    print("serving", flush=True)
    sys.stdin.read()
    ctx.stop()  # its socket removed


def query_only(src: Source, window_s: float) -> int:
    win = ExportWindow(src, window_s=window_s)
    win.count()
    return sum(item[1].num_rows for item in win.read(EVENT_TABLES))  # (table, rows, ...)


def best(fn, repeat: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--kernels", type=int, default=6, help="kernel launches per step")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--probes", choices=("processes", "inline"), default="processes",
                    help="each rank's probe a process of its own, or all in this one")  # fmt: skip
    args = ap.parse_args()
    probes: list[subprocess.Popen[str]] | None = [] if args.probes == "processes" else None
    try:
        out = measure(*job(args.events, args.kernels, probes), args.repeat)
    finally:
        for p in probes or []:
            p.communicate(timeout=30)  # stdin closed: the probe exits
    print(json.dumps({**out, "probes": args.probes, "cpus": os.cpu_count()}, indent=1))


def measure(src: Source, window_s: int, repeat: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        pf = os.path.join(d, "job.pftrace")
        pq_dir = os.path.join(d, "pq")
        q_s, rows = best(lambda: query_only(src, window_s), repeat)
        p_s, rep = best(lambda: export(src, pf, window_s=window_s), repeat)
        k_s, krep = best(lambda: export(src, pq_dir, fmt="parquet", window_s=window_s),
                         repeat)  # fmt: skip
        millions = rep.events / 1e6
        return {
            "events": rep.events,
            "ranks": rep.ranks,
            "perfetto": {
                "seconds": round(p_s, 2),
                "bytes": rep.bytes,
                "s_per_million": round(p_s / millions, 2),
                "mb_per_million": round(rep.bytes / 1e6 / millions, 1),
                "events_per_s": round(rep.events / p_s),
            },
            "parquet": {
                "seconds": round(k_s, 2),
                "bytes": krep.bytes,
                "s_per_million": round(k_s / millions, 2),
                "mb_per_million": round(krep.bytes / 1e6 / millions, 1),
            },
            "query_only": {
                "seconds": round(q_s, 2),
                "rows": rows,
                "s_per_million": round(q_s / millions, 2),
            },  # fmt: skip
            "perfetto_over_query": round(p_s / q_s, 2),
        }


if __name__ == "__main__":
    main()
