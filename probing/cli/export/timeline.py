"""``probing export --format perfetto``: every rank's window as one Perfetto trace.

What goes where (see ``perfetto.TraceWriter``): NCCL and Gloo calls, CUDA
calls (kernel launches named by their kernel, synchronisations as
``cuda.sync``) become slices on their thread's track under ``rank R @ node``;
the args carry the call's columns, the collective's cross-rank name
(``comm``) and aligned ``seq`` (``probing.analyze.collectives.matched``, as
``diagnose`` matches them), and the Python ``callsite`` and ``stack``
(``python.callsites`` / ``python.stacks``). One flow id per collective
chains it across ranks. NVML samples become counter tracks per rank. Beside
them, per rank, the training thread's Python functions from the sampler and
the spans the rank was not tracing (``flame``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from probing.analyze import columns
from probing.cli.export import flame
from probing.cli.export.perfetto import SliceChunk, ThreadTrack, TraceWriter, flow_ids
from probing.cli.export.window import COUNTER_TABLES, SLICE_TABLES, Cap, ExportWindow, Prefetched

# columns that are the slice itself, not its args
_PLACE = {"ts", "dur_ns", "pid", "tid", "node", "rank", "event_id", "stack_id", "api"}
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
    python: dict[int, int] = field(default_factory=dict)  # rank -> Python function slices
    untraced: dict[int, int] = field(default_factory=dict)  # rank -> spans not tracing
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
    """(rank, raw ts) of every collective call -> its cross-rank (comm, seq) and
    flow id, looked up a chunk at a time (per rank, a sorted array of its ts)."""

    def __init__(self, win: ExportWindow) -> None:
        from probing.analyze.collectives import matched
        from probing.analyze.gather import with_groups
        from probing.analyze.queries import queries
        from probing.errors import ProbingError

        sql = queries(win.source.remote)
        table = win.whole(sql["collectives"].format(since_ns=win.since_ns))
        try:
            table = with_groups(table, win.whole(sql["groups"]))
        except ProbingError:  # a probe without comm.groups: matched by size and order
            pass
        m = matched(table)
        self.comms = list(m.keys)  # each collective's communicator: comms[comm[i]]
        self.comm = m.key.astype(np.int32)
        self.seq = m.seq.astype(np.int64)
        self.flow = flow_ids(self.comms, self.comm, self.seq)
        # rank -> its calls' ts (sorted; a tie: the first collective first) and collective
        self._by_rank: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        order = np.lexsort((m.coll, m.ts, m.rank))
        rank, ts, which = m.rank[order], m.ts[order], m.coll[order].astype(np.int64)
        if len(rank):
            cuts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]]).tolist() + [len(rank)]
            for a, b in itertools.pairwise(cuts):
                self._by_rank[int(rank[a])] = (ts[a:b].copy(), which[a:b].copy())

    def lookup(self, rank: np.ndarray, ts: np.ndarray) -> np.ndarray:
        """Each call's collective (an index into ``comm``/``seq``/``flow``), -1: none."""
        out = np.full(len(ts), -1, dtype=np.int64)
        for r in np.unique(rank):
            known = self._by_rank.get(int(r))
            if known is None:
                continue
            mine = np.flatnonzero(rank == r)
            keys, which = known
            at = np.minimum(np.searchsorted(keys, ts[mine]), len(keys) - 1)
            hit = keys[at] == ts[mine]
            out[mine[hit]] = which[at[hit]]
        return out


class StackIndex:
    """Each rank's Python stacks: ``stack_id`` -> (callsite, stack text), and
    its frames as (function, file), outermost first (``frames``)."""

    def __init__(self, win: ExportWindow) -> None:
        from probing.errors import ProbingError

        frames: dict[tuple[int, int], list[tuple[int, str, tuple[str, str]]]] = {}
        self.callsites: dict[tuple[int, int], str] = {}
        try:
            for r in win.whole(STACKS_SQL).to_pylist():
                line = f"{r['func']} ({r['file']}:{r['line']})"
                frames.setdefault((r["rank"], r["stack_id"]), []).append(
                    (r["depth"], line, (str(r["func"]), str(r["file"])))
                )
            for r in win.whole(CALLSITES_SQL).to_pylist():
                self.callsites[(r["rank"], r["stack_id"])] = r["callsite"]
        except ProbingError:  # a probe without python.stacks (traced without stacks)
            pass
        self.text = {k: "\n".join(f[1] for f in sorted(v)) for k, v in frames.items()}
        self.frames = {k: [f[2] for f in sorted(v, reverse=True)] for k, v in frames.items()}


def _column(part: pa.Table, name: str) -> pa.Array:
    """A text column as one array (all null where the table has none)."""
    return columns.column(part, name, pa.string())


def _ints(part: pa.Table, name: str) -> np.ndarray:
    """An integer column as int64 (null: 0, as the slice's ``or 0`` did)."""
    return columns.ints(columns.column(part, name))[0]


def _said(values: pa.Array) -> tuple[np.ndarray, list[str]]:
    """A dictionary-encoded string column as its indices (-1: null or empty, what
    Python's ``or`` skips) and its dictionary."""
    words = values.dictionary.to_pylist()
    unsaid = np.array([not w for w in words] + [True], dtype=bool)  # [-1]: the null's
    index = values.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    return np.where(unsaid[index], -1, index), words


def _numbered(key: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's number among the distinct keys (all in [0, size)), and those keys:
    counted where they fit a small array, else hashed."""
    if size > 4 * len(key) + 1024:
        number = columns.codes(key)[0]
        return number, key[columns.firsts(number)]
    used = np.flatnonzero(np.bincount(key, minlength=size))
    numbers = np.zeros(size, dtype=np.int64)
    numbers[used] = np.arange(len(used))
    return numbers[key], used


class Names(NamedTuple):
    """Each call's slice name, category (dictionary arrays) and whether it names an op."""

    name: pa.Array
    category: pa.Array
    op: np.ndarray  # bool


def _names(table: str, api: pa.Array, op: pa.Array, kernel: pa.Array) -> Names:
    """The name is the op, else the kernel, else the API call, else the table;
    the category ``cuda.sync`` (a synchronisation), ``cuda.kernel`` (a
    launch), else the family. Worked out once per distinct (op, kernel, api)."""
    (o, ops), (k, kernels), (a, apis) = _said(op), _said(kernel), _said(api)
    size = (len(kernels) + 1) * (len(apis) + 1)
    key = (o + 1) * size + (k + 1) * (len(apis) + 1) + (a + 1)
    combo, used = _numbered(key, size * (len(ops) + 1))
    family = table.split(".")[0]
    names, categories = [], []
    for u in used.tolist():
        i, j, m = u // size - 1, u % size // (len(apis) + 1) - 1, u % (len(apis) + 1) - 1
        said = (ops[i] if i >= 0 else None, kernels[j] if j >= 0 else None,
                apis[m] if m >= 0 else None)  # fmt: skip
        names.append(next((w for w in said if w), table))
        if family != "cuda":
            categories.append(family)
        elif said[2] and "Synchronize" in said[2]:
            categories.append("cuda.sync")
        else:
            categories.append("cuda.kernel" if said[1] else "cuda")
    index = pa.array(combo.astype(np.int32))
    return Names(
        pa.DictionaryArray.from_arrays(index, pa.array(names, pa.string())),
        pa.DictionaryArray.from_arrays(index, pa.array(categories, pa.string())),
        o >= 0,
    )


def _threads(part: pa.Table, rank: np.ndarray) -> tuple[np.ndarray, list[ThreadTrack]]:
    """Each row's thread (an index into the threads, numbered as first met)."""
    tid = _ints(part, "tid")
    thread = columns.codes((rank << 32) | (tid & 0xFFFFFFFF))[0]
    nodes, pids = _column(part, "node"), _ints(part, "pid")
    first = columns.firsts(thread).tolist()
    return thread, [
        ThreadTrack(int(rank[i]), int(tid[i]), nodes[i].as_py(), int(pids[i])) for i in first
    ]


def _null_where(values: pa.Array, where: np.ndarray) -> pa.Array:
    return pc.if_else(pa.array(where), pa.scalar(None, values.type), values)


def _set(args: dict[str, list[tuple[str, pa.Array]]], name: str, value: pa.Array) -> None:
    """``args[name] = value`` in the rows where ``value`` is not null: the arg
    keeps its place, the value it had stays in the other rows."""
    where = value.is_valid().to_numpy(zero_copy_only=False)
    before = [(k, _null_where(v, where)) for k, v in args.get(name, [])]
    args[name] = [*before, (name, value)]


def _collectives(
    part: pa.Table, rank: np.ndarray, ts: np.ndarray, has_op: np.ndarray,
    colls: CollectiveIndex, offsets: dict[str, int],
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Each call's collective (index into ``colls``, -1: none) and flow id (0: none)."""
    which = np.full(len(ts), -1, dtype=np.int64)
    called = np.flatnonzero(has_op)
    if len(called) and len(colls.seq):
        nodes = pc.dictionary_encode(_column(part, "node").take(pa.array(called)))
        shift = np.array([offsets.get(n, 0) for n in nodes.dictionary.to_pylist()] + [0])
        index = nodes.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        which[called] = colls.lookup(rank[called], ts[called] + shift[index])  # probe ts
    flow = colls.flow[np.maximum(which, 0)] if len(colls.seq) else np.zeros(len(ts), np.uint64)
    return which, np.where(which >= 0, flow, np.uint64(0))


def _callsites(part: pa.Table, rank: np.ndarray, stacks: StackIndex) -> tuple[pa.Array, pa.Array]:
    """Each call's callsite and stack text (null: no stack id, or none known)."""
    sid, sids = columns.codes(columns.column(part, "stack_id"))  # a null: a code of its own
    pairs = columns.pair(rank - rank.min(), sid)
    keys = [(int(rank[i]), sids[sid[i]]) for i in columns.firsts(pairs).tolist()]
    index = pairs.astype(np.int32)

    def each(known: dict[tuple[int, int], str]) -> pa.Array:
        # a dictionary array: each distinct text once (interned once, not per call)
        texts = [known.get(k) for k in keys]
        unknown = np.array([t is None for t in texts], dtype=bool)
        return pa.DictionaryArray.from_arrays(
            pa.array(index, mask=unknown[pairs]), pa.array(texts, pa.string())
        )

    return each(stacks.callsites), each(stacks.text)


def slices(
    table: str, part: pa.Table, colls: CollectiveIndex, stacks: StackIndex, offsets: dict[str, int]
) -> SliceChunk | None:
    """One slice per row of a calls table (ts already moved by ``offsets``)."""
    n = part.num_rows
    if not n:
        return None
    rank, ts = _ints(part, "rank"), _ints(part, "ts")
    # the names, dictionary-encoded once: each distinct one worked out and interned once
    said = {c: pc.dictionary_encode(_column(part, c)) for c in ("api", "op", "kernel")}
    api, op, kernel = said["api"], said["op"], said["kernel"]
    # args: the columns that say something in this chunk (all-NULL ones left out)
    extra = [c for c in part.column_names if c not in _PLACE and part.column(c).null_count < n]
    args = {c: [(c, said[c] if c in said else _column(part, c))] for c in extra}
    args["api"] = [("api", api)]
    names = _names(table, api, op, kernel)
    which, flow = _collectives(part, rank, ts, names.op, colls, offsets)
    if (which >= 0).any():
        miss, which = which < 0, np.maximum(which, 0)
        comm = pa.array(colls.comm[which], mask=miss)
        _set(args, "comm", pa.DictionaryArray.from_arrays(comm, pa.array(colls.comms, pa.string())))
        _set(args, "seq", pa.array(colls.seq[which], mask=miss))
    if columns.column(part, "stack_id").null_count < n:
        site, text = _callsites(part, rank, stacks)
        _set(args, "callsite", site)
        _set(args, "stack", text)
    dur = columns.column(part, "dur_ns")
    thread, threads = _threads(part, rank)
    return SliceChunk(
        thread=thread, threads=threads, ts=ts,
        ended=dur.is_valid().to_numpy(zero_copy_only=False),
        dur=dur.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64),
        name=names.name, category=names.category,
        args=[a for group in args.values() for a in group], flow=flow,
    )  # fmt: skip


def write_counters(w: TraceWriter, part: pa.Table) -> None:
    """NVML samples: one counter track per (rank, GPU, metric), row by row."""
    have = [c for c in NVML_COUNTERS if c[0] in part.column_names]
    n, m = part.num_rows, len(have)
    if not n or not m:
        return
    rank, ts = _ints(part, "rank"), _ints(part, "ts")
    gpu = columns.column(part, "gpu")
    values = np.stack([
        _column(part, c).fill_null(0).to_numpy(zero_copy_only=False).astype(np.float64)
        for c, _, _ in have], axis=1)  # fmt: skip
    valid = np.stack([_column(part, c).is_valid().to_numpy(zero_copy_only=False)
                      for c, _, _ in have], axis=1)  # fmt: skip
    # (row, metric) in row-major order, where a value was sampled
    row, metric = (x.reshape(-1)[valid.reshape(-1)] for x in np.indices((n, m)))
    # one int64 per (rank, GPU, no GPU, metric)
    no_gpu = gpu.is_null().to_numpy(zero_copy_only=False)[row].astype(np.int64)
    key = (rank[row] << 32) | ((_ints(part, "gpu")[row] & 0xFFFFFF) << 8) | (no_gpu << 7) | metric
    track = columns.codes(key)[0]
    first = columns.firsts(track)
    uuids = np.zeros(len(first), dtype=np.int64)
    for k, j in enumerate(first.tolist()):
        i, (_, label, unit) = int(row[j]), have[metric[j]]
        uuids[k] = w.counter_track(int(rank[i]), f"gpu{gpu[i].as_py()} {label}", unit)
    w.add_counters(rank[row], uuids[track], ts[row], values[row, metric])


def export_perfetto(win: ExportWindow, path: str) -> ExportReport:
    t0 = time.perf_counter()
    src = win.source
    ranks = src.ranks()
    win.count()
    # calls still in flight (where a hang shows): open slices, kept first; each
    # moved by the clock offsets its own query measured
    inflight = []
    for table, view in INFLIGHT.items():
        part, offsets = src.measured(f"SELECT * FROM {view}")
        inflight.append((table, src.align(part, offsets=offsets), offsets))
        win.cap.kept += inflight[-1][1].num_rows
    # the window's chunks are read on a thread of their own (the probes answer,
    # no GIL held) from now on, while the collectives, stacks and threads are
    # asked and each chunk read before is written
    with Prefetched(win.read(SLICE_TABLES + COUNTER_TABLES)) as chunks, open(path, "wb") as f:
        colls, stacks = CollectiveIndex(win), StackIndex(win)
        w = TraceWriter(f)
        w.thread_names = {
            (r["rank"], r["tid"]): r["name"] for r in win.whole(THREADS_SQL).to_pylist()
        }
        w.clock(win.bounds[0])
        for r in ranks:
            w.process(r.rank, r.node, r.pid)
        for table, part, offsets in itertools.chain(inflight, chunks):
            if table in COUNTER_TABLES:
                write_counters(w, part)
                continue
            chunk = slices(table, part, colls, stacks, offsets)
            if chunk is not None:
                w.add_slices(chunk)
        python = flame.write_python(w, win, stacks.frames)
        untraced = flame.write_untraced(w, win, [r.rank for r in ranks])
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
        python=python,
        untraced=untraced,
        missing=list(src.missing),
    )
