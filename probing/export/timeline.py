"""``probing export --format perfetto``: every rank's window as one Perfetto trace.

What goes where (see ``perfetto.TraceWriter``): NCCL and Gloo calls, CUDA
calls (kernel launches named by their kernel, synchronisations as
``cuda.sync``) become slices on their thread's track under ``rank R @ node``;
the args carry the call's columns, the collective's cross-rank name
(``comm``) and aligned ``seq`` (``probing.analyze.collectives.match``, as
``diagnose`` matches them), and the Python ``callsite`` and ``stack``
(``python.callsites`` / ``python.stacks``). One flow id per collective
chains it across ranks. NVML samples become counter tracks per rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from probing.export.perfetto import TraceWriter, flow_id
from probing.export.window import COUNTER_TABLES, SLICE_TABLES, Cap, Window

# columns that are the slice itself, not its args
_PLACE = {"ts", "dur_ns", "pid", "tid", "node", "rank", "event_id", "stack_id", "api"}
_ROW = ("rank", "ts", "dur_ns", "tid", "node", "pid", "api", "stack_id", "op", "kernel")
NVML_COUNTERS = (  # column, track name, unit
    ("util_gpu", "util %", "%"),
    ("util_mem", "mem util %", "%"),
    ("mem_used", "mem used", "bytes"),
    ("power_w", "power W", "W"),
    ("temp_c", "temp C", "C"),
    ("sm_clock_mhz", "SM clock MHz", "MHz"),
)
STACKS_SQL = "SELECT stack_id, depth, func, file, line{tags} FROM python.stacks"
CALLSITES_SQL = "SELECT stack_id, callsite{tags} FROM python.callsites"
THREADS_SQL = "SELECT tid, name{tags} FROM process.threads"
INFLIGHT = {"nccl.calls": "nccl.inflight", "gloo.calls": "gloo.inflight"}


@dataclass
class ExportReport:
    path: str
    format: str
    ranks: int
    events: int
    seconds: float
    bytes: int
    cap: Cap
    slices: dict[int, int] = field(default_factory=dict)  # rank -> slices
    flows: dict[int, int] = field(default_factory=dict)  # rank -> slices in a flow
    counters: dict[int, int] = field(default_factory=dict)  # rank -> counter values
    tables: dict[str, int] = field(default_factory=dict)  # parquet: table -> rows
    missing: list[str] = field(default_factory=list)

    def summary(self) -> str:
        mb = self.bytes / 1e6
        out = (
            f"wrote {self.path}: {self.events} events from {self.ranks} rank(s), "
            f"{mb:.1f} MB in {self.seconds:.1f} s"
        )
        if self.missing:
            out += "\nnot heard from: " + "; ".join(self.missing)
        if self.cap.cut:
            out += "\n" + self.cap.message()
        return out


class CollectiveIndex:
    """(rank, raw ts) of every collective call -> its cross-rank (comm, seq)."""

    def __init__(self, win: Window) -> None:
        from probing.analyze.collectives import match
        from probing.analyze.diagnose import queries, with_groups
        from probing.errors import ProbingError

        sql = queries(win.source.remote)
        table = win.whole(sql["collectives"].format(since_ns=win.since_ns))
        try:
            table = with_groups(table, win.whole(sql["groups"]))
        except ProbingError:  # a probe without comm.groups: matched by size and order
            pass
        self.keys: dict[tuple[int, int], tuple[str, int]] = {}
        for c in match(table):
            for rank, ts in c.ts.items():
                self.keys[(rank, ts)] = (c.comm, c.seq)

    def get(self, rank: int, ts: int) -> tuple[str, int] | None:
        return self.keys.get((rank, ts))


class Stacks:
    """Each rank's Python stacks: ``stack_id`` -> (callsite, stack text)."""

    def __init__(self, win: Window) -> None:
        from probing.errors import ProbingError

        frames: dict[tuple[int, int], list[tuple[int, str]]] = {}
        self.callsites: dict[tuple[int, int], str] = {}
        try:
            for r in win.whole(STACKS_SQL).to_pylist():
                line = f"{r['func']} ({r['file']}:{r['line']})"
                frames.setdefault((r["rank"], r["stack_id"]), []).append((r["depth"], line))
            for r in win.whole(CALLSITES_SQL).to_pylist():
                self.callsites[(r["rank"], r["stack_id"])] = r["callsite"]
        except ProbingError:  # a probe without python.stacks (traced without stacks)
            pass
        self.text = {k: "\n".join(line for _, line in sorted(v)) for k, v in frames.items()}


def _arg(v: Any) -> Any:
    if isinstance(v, list):
        return "x".join(str(x) for x in v)
    return v


def write_slices(
    w: TraceWriter,
    table: str,
    part: pa.Table,
    colls: CollectiveIndex,
    stacks: Stacks,
    offsets: dict[str, int],
) -> None:
    """One slice per row of a calls table (ts already aligned)."""
    n = part.num_rows
    if not n:
        return
    # args: the columns that say something in this chunk (all-NULL ones left out)
    extra = [c for c in part.column_names if c not in _PLACE and part.column(c).null_count < n]
    cols = {c: part.column(c).to_pylist() for c in (*_ROW, *extra) if c in part.column_names}
    none = [None] * n
    ranks, tss, durs, tids = cols["rank"], cols["ts"], cols["dur_ns"], cols["tid"]
    nodes, pids = cols["node"], cols["pid"]
    apis, sids = cols.get("api", none), cols.get("stack_id", none)
    ops, kernels = cols.get("op", none), cols.get("kernel", none)
    category = table.split(".")[0]
    named: dict[tuple[int, int], tuple[str | None, str | None]] = {}
    for i in range(n):
        rank, ts = ranks[i], tss[i]
        w.process(rank, nodes[i], pids[i] or 0)
        track = w.thread(rank, tids[i] or 0)
        args = {c: _arg(cols[c][i]) for c in extra}
        api, op = apis[i], ops[i]
        args["api"] = api
        flow = None
        if op:
            key = colls.get(rank, ts + offsets.get(nodes[i], 0))  # the index holds probe ts
            if key is not None:
                args["comm"], args["seq"] = key
                flow = flow_id(*key)
        sid = sids[i]
        if sid is not None:
            site = named.get((rank, sid))
            if site is None:
                site = named[(rank, sid)] = (
                    stacks.callsites.get((rank, sid)),
                    stacks.text.get((rank, sid)),
                )
            args["callsite"], args["stack"] = site
        kernel = kernels[i]
        if category == "cuda":
            cat = "cuda.sync" if api and "Synchronize" in api else (
                "cuda.kernel" if kernel else "cuda")  # fmt: skip
        else:
            cat = category
        w.slice(rank, track, ts, durs[i], op or kernel or api or table, cat, args, flow)


def write_counters(w: TraceWriter, part: pa.Table) -> None:
    """NVML samples: one counter track per (rank, GPU, metric)."""
    have = [c for c in NVML_COUNTERS if c[0] in part.column_names]
    rows = part.select(["ts", "rank", "gpu"] + [c[0] for c in have]).to_pylist()
    for row in rows:
        for col, label, unit in have:
            v = row[col]
            if v is None:
                continue
            track = w.counter_track(row["rank"], f"gpu{row['gpu']} {label}", unit)
            w.counter(row["rank"], track, row["ts"], v)


def export_perfetto(win: Window, path: str) -> ExportReport:
    t0 = time.perf_counter()
    src = win.source
    ranks = src.ranks()
    win.count()
    colls = CollectiveIndex(win)
    stacks = Stacks(win)
    threads = win.whole(THREADS_SQL).to_pylist()
    with open(path, "wb") as f:
        w = TraceWriter(f)
        w.thread_names = {(r["rank"], r["tid"]): r["name"] for r in threads}
        w.clock(win.bounds[0])
        for r in ranks:
            w.process(r.rank, r.node, r.pid)
        # calls still in flight (where a hang shows): open slices, kept first
        for table, inflight in INFLIGHT.items():
            part = src.align(win.whole(f"SELECT * FROM {inflight}"))
            write_slices(w, table, part, colls, stacks, src.offsets)
            win.cap.kept += part.num_rows
        for table, part in win.read(SLICE_TABLES + COUNTER_TABLES):
            if table in COUNTER_TABLES:
                write_counters(w, part)
            else:
                write_slices(w, table, part, colls, stacks, src.offsets)
        if win.cap.cut:
            note = w.note_track(f"probing export: {sum(win.cap.dropped.values())} events dropped")
            at = win.cap.oldest_kept_ns or win.bounds[0]
            w.instant(note, at, "events dropped before this", {"why": win.cap.message()})
        w.flush()
        f.flush()
        size = f.tell()
    return ExportReport(
        path=path,
        format="perfetto",
        ranks=len(ranks),
        events=win.cap.kept,
        seconds=round(time.perf_counter() - t0, 3),
        bytes=size,
        cap=win.cap,
        slices=dict(w.slices),
        flows=dict(w.flow_slices),
        counters=dict(w.counter_values),
        missing=list(src.missing),
    )
