"""The cause on the timeline: each rank's training thread as a track of its
Python functions, beside its collectives, from the sampler
(``python.samples``); and the spans in which a rank was not tracing
(``trace.intervals``), so that a gap does not read as idle time.

The sampler keeps no single samples: each of its reads (every 0.5 s, and
before a query) adds, per thread and Python stack, the time the thread
spent on a CPU, blocked and waiting for one since the read before; its
``tick`` row holds the wall time the read covers. The order of the stacks
within a read is not known, so each read is drawn as a flame chart of its
span, the way py-spy's and Perfetto's flame charts draw time: a slice per
frame (named by its function; args: its file and its time on a CPU, blocked
and waiting for one), nested by the stack, as long as the thread spent
under that frame. The reads are laid end to end:

* a blocked thread's time is charged when it next leaves a CPU, often in a
  later read, so the reads are packed back from the newest: each ends at
  its read time at the latest, and where the next one reaches back before
  it; a thread blocked for 5 s is drawn over those 5 s, not squeezed into
  the read that charged them (nothing goes before the sampler started);
* under each frame, the frame that ended the read before goes first (it
  goes on: one slice across the reads), then the frame's own time, then
  the other frames, the longest last (the likeliest to go on in the next);
* a read a little short of its span (``STRETCH``: the rest is charged in
  the next) is drawn up to the next; any other gap is time not accounted
  for (the thread blocked now) or not traced.

The training thread is the one that issued the rank's collectives (Gloo's
caller, whatever its name), else ``MainThread``, else the thread with the
most Python time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from probing.analyze.coverage import INTERVALS_SQL, spans_by_rank
from probing.analyze.functions import MAIN_THREAD
from probing.cli.export.perfetto import SliceChunk, TraceWriter
from probing.cli.export.window import ExportWindow
from probing.errors import ProbingError

STRETCH = 0.2  # a read short of its span by up to this share is drawn up to the next one
SEGMENT_GAP_NS = 50_000_000  # reads this far apart: the sampler stopped between (a new trace)
KINDS = ("cpu", "off", "runq")  # python.samples' kinds, the args' order
NO_FRAME = ("(no Python frame)", "")  # stack 0: the thread ran no Python
UNRESOLVED = ("(stack not resolved)", "")  # a stack python.stacks does not hold
ENDED = {"stopped": "tracing stopped", "died": "the process died"}  # trace.intervals' state
ISSUERS_SQL = (
    "SELECT tid, count(*) AS n{sel} FROM comm.collectives WHERE ts >= {since} GROUP BY tid{group}"
)
THREADS_SQL = (
    "SELECT tid, thread, sum(dur_ns) AS ns{sel} FROM python.samples WHERE ts >= {since} "
    "AND kind <> 'tick' AND stack_id <> 0 GROUP BY tid, thread{group}"
)
SAMPLES_SQL = (
    "SELECT ts, tid, stack_id, kind, dur_ns{tags} FROM python.samples "
    "WHERE ts >= {since} AND (kind = 'tick' OR tid IN ({tids}))"
)

Key = tuple[str, str]  # a frame: (function, file)


@dataclass
class Read:
    """One read of the sampler: its time, the span it covers, and the training
    thread's time per Python stack in it (ns on a CPU, blocked, waiting)."""

    end: int
    span: int
    stacks: dict[int, list[int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(sum(v) for v in self.stacks.values())


@dataclass
class Slice:
    start: int
    end: int
    depth: int
    key: Key
    kinds: list[int]  # ns on a CPU, blocked, waiting for one (its subtree's)


@dataclass
class _Frame:
    key: Key
    total: int = 0
    own: int = 0  # time in no deeper frame
    kinds: list[int] = field(default_factory=lambda: [0, 0, 0])
    children: dict[Key, _Frame] = field(default_factory=dict)


def _tree(read: Read, frames: Callable[[int], list[Key]]) -> _Frame:
    """The read's stacks as a tree of frames (the root: the thread itself)."""
    root = _Frame(("", ""))
    for sid, ns in read.stacks.items():
        t = sum(ns)
        node = root
        node.total += t
        for key in frames(sid) or [UNRESOLVED if sid else NO_FRAME]:
            node = node.children.setdefault(key, _Frame(key))
            node.total += t
            node.kinds = [a + b for a, b in zip(node.kinds, ns, strict=True)]
        node.own += t
    return root


def segments(reads: list[Read]) -> list[list[Read]]:
    """The reads (oldest first) cut where the sampler stopped between two."""
    out: list[list[Read]] = []
    for r in reads:
        if out and r.end - r.span <= out[-1][-1].end + SEGMENT_GAP_NS:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def pack(segment: list[Read]) -> list[tuple[Read, int, int]]:
    """Where each read with time is drawn, [start, end), oldest first: packed
    back from the newest, each ending at its read time at the latest and where
    the next begins, stretched up to the next when it is a little short."""
    lower = segment[0].end - segment[0].span
    placed: list[tuple[Read, int, int]] = []
    cursor: int | None = None
    for read in reversed(segment):
        total = read.total
        if total <= 0:
            continue
        at = read.end if cursor is None else min(read.end, cursor)
        start = max(lower, at - total)
        near = cursor is not None and at < cursor <= at + STRETCH * read.span
        end = cursor if near and cursor is not None else at
        if end <= start:
            continue  # no room left: the newer reads took the sampler's whole span
        placed.append((read, start, end))
        cursor = start
    placed.reverse()
    return placed


def lay_out(reads: Iterable[Read], frames: Callable[[int], list[Key]]) -> list[Slice]:
    """The slices of one thread's reads: a flame chart per read, the reads end
    to end (``pack``), a frame that goes on from one read to the next one slice."""
    out: list[Slice] = []
    for segment in segments(sorted(reads, key=lambda r: r.end)):
        chain: list[Slice] = []  # the slices at the end of the read before, by depth
        last_end: int | None = None
        for read, start, end in pack(segment):
            joined = chain if start == last_end else []
            chain = _place(_tree(read, frames), start, end, joined, out)
            last_end = end
    return out


def _order(node: _Frame, going_on: Key | None) -> list[_Frame | None]:
    """Under ``node``: the frame that goes on from the read before, its own
    time (None), the other frames, the longest last."""
    kids = sorted(node.children.values(), key=lambda c: (c.total, c.key))
    return [*(c for c in kids if c.key == going_on), None, *(c for c in kids if c.key != going_on)]


def _place(
    root: _Frame, start: int, end: int, joined: list[Slice], out: list[Slice]
) -> list[Slice]:
    """Lay ``root``'s frames over [start, end) (``_order``); a frame at the
    start that continues ``joined`` (the slices that ended the read before,
    by depth) extends that slice. Returns the slices that end at ``end``."""
    width, total = end - start, root.total

    def at(offset: int) -> int:  # integers: a child never ends past its parent
        return start + offset * width // total

    ending: list[Slice] = []

    def going_on(depth: int) -> Key | None:
        return joined[depth].key if depth < len(joined) else None

    def walk(node: _Frame, offset: int, depth: int, goes_on: bool) -> None:
        s, e = at(offset), at(offset + node.total)
        if e <= s:
            return  # too short to draw at this scale
        if goes_on:
            piece = joined[depth]
            piece.end = e
            piece.kinds = [a + b for a, b in zip(piece.kinds, node.kinds, strict=True)]
        else:
            piece = Slice(s, e, depth, node.key, list(node.kinds))
            out.append(piece)
        if e == end:
            ending.append(piece)
        below = going_on(depth + 1) if goes_on else None
        for part in _order(node, below):
            if part is None:
                offset += node.own
                continue
            walk(part, offset, depth + 1, part.key == below)
            offset += part.total

    offset = 0
    for part in _order(root, going_on(0)):
        if part is not None:
            walk(part, offset, 0, part.key == going_on(0))
            offset += part.total
    ending.sort(key=lambda p: p.depth)
    return [p for d, p in enumerate(ending) if p.depth == d]


def chunk(slices: list[Slice]) -> SliceChunk | None:
    """The slices in the order Perfetto nests them (a parent's begin before its
    children's at the same time, every slice's end right after its begin)."""
    if not slices:
        return None
    slices = sorted(slices, key=lambda p: (p.start, p.depth))
    n = len(slices)
    ms = np.round(np.array([p.kinds for p in slices], dtype=np.float64) / 1e6, 3)
    times = [(f"{k}_ms", pa.array(ms[:, j])) for j, k in enumerate(("on_cpu", "off_cpu", "runq"))]
    return SliceChunk(
        thread=np.zeros(n, np.int64), threads=[],
        ts=np.array([p.start for p in slices], np.int64),
        dur=np.array([p.end - p.start for p in slices], np.int64),
        ended=np.ones(n, bool),
        name=pa.array([p.key[0] for p in slices], pa.string()),
        category=pa.array(["python"] * n, pa.string()),
        args=[("file", pa.array([p.key[1] for p in slices], pa.string())), *times],
        flow=np.zeros(n, np.uint64),
    )  # fmt: skip


def training_threads(
    issuers: Iterable[Mapping[str, Any]], threads: Iterable[Mapping[str, Any]]
) -> dict[int, tuple[int, str | None]]:
    """rank -> (tid, name) of the thread that trains: the one that issued the
    most collectives, else ``MainThread``, else the one with the most Python
    time (ISSUERS_SQL and THREADS_SQL rows)."""
    names: dict[int, dict[int, str | None]] = defaultdict(dict)
    busiest: dict[int, tuple[int, int]] = {}
    for r in threads:
        rank, tid = int(r["rank"]), int(r["tid"])
        names[rank][tid] = r["thread"]
        if rank not in busiest or int(r["ns"] or 0) > busiest[rank][1]:
            busiest[rank] = (tid, int(r["ns"] or 0))
    most: dict[int, tuple[int, int]] = {}
    for r in issuers:
        rank, tid, n = int(r["rank"]), int(r["tid"]), int(r["n"])
        if rank not in most or n > most[rank][1]:
            most[rank] = (tid, n)
    out = {}
    for rank in set(names) | set(most):
        main = [t for t, name in names[rank].items() if name == MAIN_THREAD]
        tid = most[rank][0] if rank in most else main[0] if main else busiest[rank][0]
        out[rank] = (tid, names[rank].get(tid))
    return out


def _reads(rows: pa.Table, trains: Mapping[int, tuple[int, str | None]]) -> dict[int, list[Read]]:
    """rank -> its reads, with the training thread's time per stack."""
    by_rank: dict[int, dict[int, Read]] = defaultdict(dict)
    cols = {c: rows.column(c).to_pylist() for c in ("rank", "ts", "tid", "stack_id", "kind")}
    durs = rows.column("dur_ns").to_pylist()
    for i, kind in enumerate(cols["kind"]):
        if kind == "tick":
            rank, ts = cols["rank"][i], cols["ts"][i]
            read = by_rank[rank].setdefault(ts, Read(ts, 0))
            read.span = int(durs[i] or 0)
    for i, kind in enumerate(cols["kind"]):
        rank, tid = cols["rank"][i], cols["tid"][i]
        if kind not in KINDS or rank not in trains or tid != trains[rank][0]:
            continue
        got = by_rank[rank].get(cols["ts"][i])
        if got is None:
            continue  # (its tick row is older than the window)
        ns = got.stacks.setdefault(int(cols["stack_id"][i] or 0), [0, 0, 0])
        ns[KINDS.index(kind)] += int(durs[i] or 0)
    return {r: list(reads.values()) for r, reads in by_rank.items()}


def _frames_of(
    frames: Mapping[tuple[int, int], list[Key]], rank: int
) -> Callable[[int], list[Key]]:
    return lambda sid: frames.get((rank, sid), [])


def write_python(
    w: TraceWriter, win: ExportWindow, frames: Mapping[tuple[int, int], list[Key]]
) -> dict[int, int]:
    """Each rank's training thread as a track of its Python functions; rank ->
    the slices written (nothing where no probe sampled)."""
    src = win.source
    since = win.cap.oldest_kept_ns or win.since_ns
    sel, group = (", node, rank", ", node, rank") if src.remote else ("", "")
    try:
        issuers = src.ask(ISSUERS_SQL.format(sel=sel, group=group, since=since))
        threads = src.ask(THREADS_SQL.format(sel=sel, group=group, since=since))
    except ProbingError:  # probes without python.samples (or comm.collectives)
        return {}
    trains = training_threads(issuers.to_pylist(), threads.to_pylist())
    if not trains:
        return {}
    tids = ", ".join(str(t) for t in sorted({t for t, _ in trains.values()}))
    part, offsets = src.measured(SAMPLES_SQL.format(tags="{tags}", since=since, tids=tids))
    rows = src.align(part, offsets=offsets)
    written: dict[int, int] = {}
    for rank, reads in sorted(_reads(rows, trains).items()):
        tid, name = trains.get(rank, (0, None))
        made = chunk(lay_out(reads, _frames_of(frames, rank)))
        if made is None:
            continue
        track = w.track(rank, f"Python: {name or 'thread'} ({tid}), sampled")
        w.add_track_slices(track, made)
        written[rank] = len(made.ts)
    return written


def write_untraced(w: TraceWriter, win: ExportWindow, ranks: Iterable[int]) -> dict[int, int]:
    """Per rank, the spans of the window it was not tracing, as slices on a
    track of their own (``not tracing``); rank -> the spans written."""
    src = win.source
    try:
        part, offsets = src.measured(INTERVALS_SQL)
    except ProbingError:  # probes without trace.intervals
        return {}
    rows = src.align(src.align(part, "start_ns", offsets), "stop_ns", offsets).to_pylist()
    lo, now = win.bounds[0], max(win.now_ns, win.bounds[1])
    spans = spans_by_rank(rows, lo, now)
    states: dict[tuple[int, int], str] = {}  # (rank, stop) -> how that trace ended
    for r in rows:
        if r["stop_ns"] is not None:
            states[(int(r["rank"]), int(r["stop_ns"]))] = str(r["state"] or "stopped")
    written: dict[int, int] = {}
    for rank in sorted(set(ranks)):
        gaps, at, why = [], lo, "not traced yet"
        for start, end in spans.get(rank, []):
            if start > at:
                gaps.append((at, start, why))
            at = max(at, end)
            why = ENDED.get(states.get((rank, end), "stopped"), "tracing stopped")
        if at < now:
            gaps.append((at, now, why if rank in spans else "not traced in the window"))
        gaps = [g for g in gaps if g[1] > g[0]]
        if not gaps:
            continue
        track = w.track(rank, "not tracing")
        n = len(gaps)
        w.add_track_slices(track, SliceChunk(
            thread=np.zeros(n, np.int64), threads=[],
            ts=np.array([g[0] for g in gaps], np.int64),
            dur=np.array([g[1] - g[0] for g in gaps], np.int64), ended=np.ones(n, bool),
            name=pa.array(["not tracing"] * n, pa.string()),
            category=pa.array(["probing"] * n, pa.string()),
            args=[("why", pa.array([g[2] for g in gaps], pa.string()))],
            flow=np.zeros(n, np.uint64),
        ))  # fmt: skip
        written[rank] = n
    return written
