"""Collectives matched across ranks (``match``, ``matched``) and the figures
of a job's health over them (``summarize``); the stragglers found in them
are ``probing.analyze.stragglers`` (the evidence against a rank:
``probing.analyze.evidence``), its slow links ``probing.analyze.links``.

Pure functions over the gathered ``comm.collectives`` rows (a pyarrow Table
with ``node`` and ``rank`` tags, see ``probing.analyze.gather``).

Comm identity across processes: NCCL rows carry the unique-id hash when the
communicator's init was traced, the same number in every rank. A Gloo
context (and an NCCL comm traced only after its init) is a local pointer;
those communicators are named by their torch process group where the
rank's ``comm.groups`` knows it (``pg``: ``gloo/pg1``, the same name in every
rank, so two groups of one size never mix), else by backend, size and their
order of first use in each process (``gloo/n4#0``: the first 4-rank Gloo
group). Sequence numbers count from when tracing started in each process,
so per process an offset is found that lines its calls up with a reference
rank's: for synchronous calls (Gloo, durations known) the calls' *ends*
coincide across ranks, otherwise their arrivals.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from probing.analyze import columns
from probing.analyze import steps as st

P2P_OPS = ("send", "recv")
MIN_COLLECTIVES = 5  # fewer complete collectives than this: no verdict
NOISY_SKEW = 0.35  # arrival skew above this share of a step with no straggler: noisy


@dataclasses.dataclass
class Collective:
    """The k-th collective of one communicator, as every rank saw it."""

    comm: str
    seq: int
    op: str
    nranks: int
    bytes: int | None
    ts: dict[int, int]  # rank -> arrival (wall ns)
    end: dict[int, int | None]  # rank -> return (None: still inside)

    # worked out once, as it is made (a window's analysis asks each several
    # times; ``match`` works them out for every collective at once, ``made``):
    # ``ts`` and ``end`` are never changed after
    complete: bool = dataclasses.field(init=False, repr=False, compare=False)
    first_ns: int = dataclasses.field(init=False, repr=False, compare=False)  # its first arrival
    skew_ns: int = dataclasses.field(init=False, repr=False, compare=False)  # last arrival - first
    last_rank: int = dataclasses.field(init=False, repr=False, compare=False)  # of a tie, the first
    # the last return, where every rank there returned (None: one is still inside)
    released_ns: int | None = dataclasses.field(init=False, repr=False, compare=False)
    _transfer: int | None = dataclasses.field(init=False, repr=False, compare=False)
    _lags: dict[int, int] | None = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ts, ends = self.ts, [e for e in self.end.values() if e is not None]
        back = len(ends) == len(self.end)  # every rank there returned
        self.complete = len(ts) >= self.nranks and back
        self._lags = None
        self.released_ns = max(ends) if ends and back else None
        if not ts:  # nobody arrived: nothing to say (never one ``match`` makes)
            self.last_rank, self.first_ns, self.skew_ns, self._transfer = -1, 0, 0, None
            return
        self.last_rank = max(ts, key=ts.__getitem__)
        self.first_ns = min(ts.values())
        self.skew_ns = ts[self.last_rank] - self.first_ns
        self._transfer = max(0, min(ends) - ts[self.last_rank]) if ends and back else None

    @classmethod
    def made(cls, fields: dict[str, Any]) -> Collective:
        """One with its figures given (``match``'s, worked out in numpy for a
        window's thousands at once): every field but ``_lags``, by name."""
        c = cls.__new__(cls)
        c.__dict__.update(fields, _lags=None)
        return c

    def lags_ns(self) -> dict[int, int]:
        """Each rank's arrival after the first's (the same dict each call:
        read it, never change it)."""
        if self._lags is None:
            first = min(self.ts.values(), default=0)
            self._lags = {r: t - first for r, t in self.ts.items()}
        return self._lags

    def transfer_ns(self) -> int | None:
        """Time from the last arrival to the first return: what the wire took."""
        return self._transfer


def iso(ns: int) -> str:
    import datetime as dt

    t = dt.datetime.fromtimestamp(ns / 1e9, tz=dt.timezone.utc)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def global_rank(r: dict[str, Any]) -> int:
    rank = r.get("rank")
    if rank is None or rank < 0:
        rank = r.get("comm_rank")
    return -1 if rank is None else int(rank)


def seq_offset(seq: np.ndarray, t: np.ndarray, ref_seq: np.ndarray, ref_t: np.ndarray) -> int:
    """The shift of ``seq`` that lines its times up with the reference's (the mode)."""
    if len(t) == 0 or len(ref_t) == 0:
        return 0
    order = np.argsort(ref_t)
    return _offset(seq, t, ref_seq[order], ref_t[order])


def _offset(seq: np.ndarray, t: np.ndarray, rs: np.ndarray, rt: np.ndarray) -> int:
    """``seq_offset`` against a reference already in time order (``rt`` sorted)."""
    if len(t) == 0 or len(rt) == 0:
        return 0
    if len(rt) > 1:  # each call's nearest reference call (a tie: the later one)
        j = np.clip(np.searchsorted(rt, t), 1, len(rt) - 1)
        left_closer = np.abs(t - rt[j - 1]) < np.abs(t - rt[j])
        j = np.where(left_closer, j - 1, j)
    else:
        j = np.zeros(len(t), dtype=np.intp)
    # the most common shift; of equally common ones, the one met first
    shifts, first, counts = np.unique(rs[j] - seq, return_index=True, return_counts=True)
    best = np.flatnonzero(counts == counts.max())
    return int(shifts[best[np.argmin(first[best])]])


@dataclasses.dataclass
class Matched:
    """Every matched collective call, column by column (``match`` builds its
    ``Collective`` objects from it; ``probing export`` looks calls up in it).

    Per call, in ``match``'s order (communicator by communicator, first seen
    first; in each, collective by collective by aligned seq; in each, rank by
    rank, first seen first): ``row``, its index in the table; ``rank``, ``ts``,
    ``end`` (ts + dur_ns; meaningful where ``done``, False: still in flight),
    and ``coll``, its collective. Per collective: ``key`` (an index into
    ``keys``, the communicators' cross-process names), aligned ``seq``, ``op``,
    ``nranks``, ``bytes`` (the first call's), and ``first``, the index of its
    first call (one more: the number of calls)."""

    keys: list[str]
    row: np.ndarray
    rank: np.ndarray
    ts: np.ndarray
    end: np.ndarray
    done: np.ndarray
    coll: np.ndarray
    key: np.ndarray
    seq: np.ndarray
    op: list[str]
    nranks: np.ndarray
    bytes: list[int | None]
    first: np.ndarray

    @classmethod
    def empty(cls, keys: list[str] | None = None) -> Matched:
        none = np.zeros(0, dtype=np.int64)
        return cls(
            keys or [], none, none, none, none, none.astype(bool), none, none, none,
            [], none, [], np.zeros(1, dtype=np.int64),
        )  # fmt: skip

    def __len__(self) -> int:
        """The number of collectives."""
        return len(self.seq)


def _comm_keys(
    backend: np.ndarray, backends: list[Any], comm: np.ndarray, comms: list[Any],
    pg: np.ndarray, pgs: list[Any], proc: np.ndarray, ts: np.ndarray, nranks: np.ndarray,
) -> tuple[np.ndarray, list[str]]:  # fmt: skip
    """A cross-process name for every row's communicator (see the module doc):
    each row's key, numbered in the order keys first appear, and the keys."""
    bc = columns.pair(backend, comm)  # a communicator as its processes name it
    k = columns.pair(proc, bc)  # ... in one process
    nk = int(k.max()) + 1
    procs = np.bincount(columns.per(k, bc))  # processes that name each (backend, comm)
    first_ts = np.full(nk, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first_ts, k, ts)
    said = np.flatnonzero(nranks != 0)  # the last row's nranks that says one
    last = np.full(nk, -1, dtype=np.int64)
    np.maximum.at(last, k[said], said)
    size = np.where(last >= 0, nranks[np.maximum(last, 0)], 0)
    # each process's comms of one backend and size, numbered by their first use
    # (a tie: the one first in the table, as k is numbered)
    group = columns.pair(
        columns.pair(columns.per(k, proc), columns.per(k, backend)), columns.codes(size)[0]
    )
    order = np.lexsort((first_ts, group))
    ranked = group[order]
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    ordinal = np.empty(nk, dtype=np.int64)
    ordinal[order] = np.arange(nk) - np.repeat(starts, np.diff(np.r_[starts, nk]))

    names: dict[str, int] = {}
    label = np.zeros(len(k), dtype=np.int64)

    def name(rows: np.ndarray, code: np.ndarray, text: Callable[[int], str]) -> None:
        if len(rows):
            dense = columns.codes(code[rows])[0]
            ids = [names.setdefault(text(int(rows[i])), len(names)) for i in columns.firsts(dense)]
            label[rows] = np.array(ids, dtype=np.int64)[dense]

    has_pg = np.array([v is not None for v in pgs])[pg]
    shared = ~has_pg & (procs[bc] > 1) & np.array([v is not None for v in comms])[comm]
    name(np.flatnonzero(has_pg), columns.pair(backend, pg),
         lambda i: f"{backends[backend[i]]}/pg{pgs[pg[i]]}")  # fmt: skip
    name(np.flatnonzero(shared), bc, lambda i: f"{backends[backend[i]]}:{int(comms[comm[i]]):x}")
    name(np.flatnonzero(~has_pg & ~shared), k,
         lambda i: f"{backends[backend[i]]}/n{int(size[k[i]])}#{int(ordinal[k[i]])}")  # fmt: skip
    key, seen = columns.codes(label)
    text = list(names)
    return key, [text[i] for i in seen]


@dataclasses.dataclass
class _Calls:
    """The calls ``matched`` matches, column by column over the rows it keeps:
    ``row``, each one's index in the table; ``end``, ts + dur_ns (meaningful
    where ``done``); ``rank``, the global rank, else the rank in its
    communicator, else -1; ``op`` and ``backend`` numbered (their values in
    ``ops`` and ``backends``); ``key``, its communicator's cross-process name
    (an index into ``keys``, see ``_comm_keys``)."""

    row: np.ndarray
    ts: np.ndarray
    end: np.ndarray
    done: np.ndarray
    seq: np.ndarray
    has_seq: np.ndarray
    nranks: np.ndarray
    rank: np.ndarray
    op: np.ndarray
    ops: list[Any]
    backend: np.ndarray
    backends: list[Any]
    key: np.ndarray
    keys: list[str]


def matched(table: pa.Table) -> Matched:
    """Every collective call matched across ranks by communicator and aligned
    sequence, column by column (see ``Matched``; ``match`` for the rules)."""
    calls = _read_calls(table)
    if calls is None:
        return Matched.empty()
    order, aligned = _align(calls)
    return _group(table, calls, order, aligned)


def _read_calls(table: pa.Table) -> _Calls | None:
    """The rows of collective calls (an op, not a point-to-point one, and a ts),
    their columns read and their communicators named; None: no such row."""
    op_all = columns.column(table, "op").cast(pa.string())
    # point-to-point transfers pair two ranks, not a group: analyze.pipeline's
    said = pc.invert(pc.is_in(op_all, value_set=pa.array(["", *P2P_OPS], pa.string())))
    said = pc.and_(pc.and_(op_all.is_valid(), columns.column(table, "ts").is_valid()), said)
    row = np.flatnonzero(said.to_numpy(zero_copy_only=False))
    if not len(row):
        return None
    every = len(row) == table.num_rows

    def ints(name: str) -> tuple[np.ndarray, np.ndarray]:
        values, valid = columns.ints(columns.column(table, name))
        return (values, valid) if every else (values[row], valid[row])

    def codes(column: pa.Array) -> tuple[np.ndarray, list[Any]]:
        numbers, values = columns.codes(column)  # numbered over the table: only told apart
        return (numbers if every else numbers[row]), values

    ts, _ = ints("ts")
    dur, done = ints("dur_ns")
    seq, has_seq = ints("seq")
    nranks, _ = ints("nranks")  # null: 0 (``or 0``)
    rank, has_rank = ints("rank")
    comm_rank, has_comm_rank = ints("comm_rank")
    rank = np.where(has_rank & (rank >= 0), rank, np.where(has_comm_rank, comm_rank, -1))
    op, ops = codes(op_all)
    backend, backends = codes(columns.column(table, "backend"))
    comm, comms = codes(columns.column(table, "comm"))
    pg, pgs = codes(columns.column(table, "pg"))
    proc = columns.pair(
        codes(columns.column(table, "node"))[0], codes(columns.column(table, "pid"))[0]
    )
    key, keys = _comm_keys(backend, backends, comm, comms, pg, pgs, proc, ts, nranks)
    return _Calls(
        row=row, ts=ts, end=ts + dur, done=done, seq=seq, has_seq=has_seq, nranks=nranks,
        rank=rank, op=op, ops=ops, backend=backend, backends=backends, key=key, keys=keys,
    )  # fmt: skip


def _align(c: _Calls) -> tuple[np.ndarray, np.ndarray]:
    """The calls (indices into ``c``) communicator by communicator, rank by rank
    (both first seen first), each rank's in its order; and every call's seq
    shifted by its rank's offset (``_offset``) against the lowest rank's."""
    key, rank, seq, has_seq, done, ts, end = c.key, c.rank, c.seq, c.has_seq, c.done, c.ts, c.end
    backend, backends = c.backend, c.backends
    # each communicator's calls rank by rank (both first seen first), each rank's in
    # its order: the order in which calls join collectives (the first one names it)
    kr = columns.pair(key, columns.codes(rank)[0])
    kr_key, kr_rank = columns.per(kr, key), columns.per(kr, rank)
    groups = np.argsort(kr_key, kind="stable")  # kr is numbered first seen first
    place = np.empty(len(groups), dtype=np.int64)
    place[groups] = np.arange(len(groups))
    at = place[kr]
    calls = np.argsort(at.astype(np.uint16) if len(groups) < 1 << 16 else at, kind="stable")
    bounds = np.r_[0, np.cumsum(np.bincount(at, minlength=len(groups)))]

    # per rank a seq offset lining its calls up with the lowest rank's: Gloo on CPU
    # is synchronous, a call returns when the collective is done, so the returns line
    # up across ranks (calls still in flight are left out); otherwise the arrivals
    gloo = np.array([b == "gloo" for b in backends])[backend]

    def series(mine: np.ndarray, synchronous: bool) -> tuple[np.ndarray, np.ndarray]:
        """A rank's (seq, time) to line up: returns (of returned calls) or arrivals."""
        used = mine[has_seq[mine] & done[mine]] if synchronous else mine[has_seq[mine]]
        return seq[used], (end if synchronous else ts)[used]

    shift = np.zeros(len(groups), dtype=np.int64)
    g_key, g_rank = kr_key[groups], kr_rank[groups]
    firsts = np.flatnonzero(np.r_[True, g_key[1:] != g_key[:-1]]).tolist()
    for a, b in zip(firsts, [*firsts[1:], len(groups)], strict=True):
        # the lowest rank numbers the collectives: the same numbers in every
        # diagnosis of one job (a hang is named alike each time it is asked)
        ref = a + int(np.argmin(g_rank[a:b]))
        mine = calls[bounds[ref] : bounds[ref + 1]]
        synchronous = bool(gloo[mine].all())
        ref_s, ref_t = series(mine, synchronous)
        order = np.argsort(ref_t)
        ref_s, ref_t = ref_s[order], ref_t[order]
        for g in range(a, b):
            if g != ref:
                s, t = series(calls[bounds[g] : bounds[g + 1]], synchronous)
                shift[g] = _offset(s, t, ref_s, ref_t)
    return calls, seq + shift[at]


def _group(table: pa.Table, c: _Calls, calls: np.ndarray, aligned: np.ndarray) -> Matched:
    """The calls, in ``_align``'s order, grouped into collectives: communicator by
    communicator, by aligned seq; in a collective, in joining order. Its first
    call names a collective; a call of another op, or a rank's second, is left out."""
    key, rank, op, nranks, row = c.key, c.rank, c.op, c.nranks, c.row
    calls = calls[c.has_seq[calls]]
    if not len(calls):
        return Matched.empty(c.keys)
    calls = calls[np.lexsort((aligned[calls], key[calls]))]
    k, s = key[calls], aligned[calls]
    new = np.r_[True, (k[1:] != k[:-1]) | (s[1:] != s[:-1])]
    coll = np.cumsum(new) - 1
    named = calls[new]  # the call that names each collective: its op, nranks, bytes
    # a call of another op (misaligned) or a rank's second (duplicated): left out
    same = op[calls] == op[named][coll]
    calls, coll = calls[same], coll[same]
    r = rank[calls]
    again = np.r_[False, (coll[1:] == coll[:-1]) & (r[1:] == r[:-1])]
    calls, coll = calls[~again], coll[~again]
    count = np.bincount(coll, minlength=len(named))
    first = np.r_[0, np.cumsum(count)]
    size = np.maximum(np.maximum.reduceat(nranks[calls], first[:-1]), count)
    nbytes = columns.column(table, "bytes").take(pa.array(row[named])).to_pylist()
    return Matched(
        keys=c.keys, row=row[calls], rank=rank[calls], ts=c.ts[calls], end=c.end[calls],
        done=c.done[calls], coll=coll, key=key[named], seq=aligned[named],
        op=[c.ops[i] for i in op[named].tolist()], nranks=size, bytes=nbytes, first=first,
    )  # fmt: skip


def match(table: pa.Table) -> list[Collective]:
    """Every collective, matched across ranks by communicator and aligned sequence.

    Calls of point-to-point ops (``P2P_OPS``) and rows without op or ts are left
    out; a rank's calls are shifted by its seq offset (``seq_offset``) against
    the lowest rank's of its communicator; a collective takes its op, bytes and
    (at least) nranks from the first call of it met (rank by rank, first seen
    first), a call of another op or a rank's second call of it is left out.
    In the order of ``Matched``."""
    m = matched(table)
    if not len(m):
        return []
    starts, count = m.first[:-1], np.diff(m.first)
    lo, hi = np.minimum.reduceat(m.ts, starts), np.maximum.reduceat(m.ts, starts)
    back = np.logical_and.reduceat(m.done, starts)  # every rank there returned
    # the last arrival's rank: of a tie, the first to join
    at_hi = np.where(m.ts == hi[m.coll], np.arange(len(m.ts)), len(m.ts))
    last_rank = m.rank[np.minimum.reduceat(at_hi, starts)].tolist()
    transfer = np.maximum(np.minimum.reduceat(m.end, starts) - hi, 0).tolist()
    released = np.maximum.reduceat(m.end, starts).tolist()
    complete = ((count >= m.nranks) & back).tolist()
    keys = [m.keys[k] for k in m.key.tolist()]
    ranks, ts, ends = m.rank.tolist(), m.ts.tolist(), m.end.tolist()
    for i in np.flatnonzero(~m.done).tolist():
        ends[i] = None  # still inside
    first, skew, back_l, arrived = m.first.tolist(), (hi - lo).tolist(), back.tolist(), lo.tolist()
    out = []
    for c, (seq, nranks) in enumerate(zip(m.seq.tolist(), m.nranks.tolist(), strict=True)):
        a, b = first[c], first[c + 1]
        who = ranks[a:b]
        out.append(Collective.made({
            "comm": keys[c], "seq": seq, "op": m.op[c], "nranks": nranks, "bytes": m.bytes[c],
            "ts": dict(zip(who, ts[a:b], strict=True)),
            "end": dict(zip(who, ends[a:b], strict=True)),
            "complete": complete[c], "first_ns": arrived[c], "skew_ns": skew[c],
            "last_rank": last_rank[c], "released_ns": released[c] if back_l[c] else None,
            "_transfer": transfer[c] if back_l[c] else None,
        }))  # fmt: skip
    return out


def complete(collectives: list[Collective]) -> list[Collective]:
    """The collectives every rank returned from, of more than one rank: the ones
    whose timing says something."""
    return [c for c in collectives if c.complete and c.nranks > 1]


def by_comm(collectives: list[Collective]) -> dict[str, list[Collective]]:
    """``complete`` collectives by communicator, in their order."""
    out: dict[str, list[Collective]] = defaultdict(list)
    for c in complete(collectives):
        out[c.comm].append(c)
    return out


@dataclasses.dataclass
class Summary:
    """The figures that show a job is healthy (or how it is not)."""

    collectives: int
    ranks: int
    comms: int
    skew_ms_median: float | None
    skew_ms_p99: float | None
    transfer_ms_median: float | None
    last_share_max: float | None  # the most any one rank was last
    last_share_min: float | None = None  # the least (over ranks in every collective)
    step_ms: float | None = None  # the job's step (``probing.analyze.steps``)
    noisy: bool = False  # skew above NOISY_SKEW of a step (and nobody to blame)
    busiest: int | None = None  # complete collectives of the busiest communicator
    size: int = 0  # ranks in the largest group its collectives name (the job's, mostly)
    pace_ms: float | None = None  # median interval between any collectives of one group


def summarize(collectives: list[Collective], steps: st.Steps | None = None) -> Summary:
    """The figures of ``collectives``; its step is the job's (``steps``, found
    here where not given)."""
    done = complete(collectives)
    counts = Counter(c.comm for c in done)
    top = counts.most_common(1)[0][0] if counts else None
    busiest = [c for c in done if c.comm == top]
    job = (st.find(collectives) if steps is None else steps).job
    step = job.ms if job is not None else None
    skew = np.array([c.skew_ns / 1e6 for c in done])
    transfer = [c.transfer_ns() for c in done]
    tr = np.array([t / 1e6 for t in transfer if t is not None])
    last = Counter(c.last_rank for c in done)
    every = set.intersection(*(set(c.ts) for c in busiest)) if busiest else set()
    skew_med = float(np.median(skew)) if len(skew) else 0.0
    return Summary(
        collectives=len(done),
        ranks=len({r for c in collectives for r in c.ts}),
        comms=len({c.comm for c in collectives}),
        skew_ms_median=round(float(np.median(skew)), 3) if len(skew) else None,
        skew_ms_p99=round(float(np.percentile(skew, 99)), 3) if len(skew) else None,
        transfer_ms_median=round(float(np.median(tr)), 3) if len(tr) else None,
        last_share_max=round(max(last.values()) / len(done), 4) if done else None,
        last_share_min=round(min(last[r] for r in every) / len(done), 4) if every else None,
        step_ms=round(step, 3) if step else None,
        noisy=bool(step and len(busiest) >= MIN_COLLECTIVES and skew_med > NOISY_SKEW * step),
        busiest=len(busiest),
        size=max((c.nranks for c in collectives), default=0),
        pace_ms=_pace_ms(collectives),
    )


def _pace_ms(collectives: list[Collective]) -> float | None:
    """The median interval between the collectives (complete or not) of the
    group that issues most: how often a job this slow can be judged."""
    counts = Counter(c.comm for c in collectives if c.nranks > 1)
    if not counts:
        return None
    comm = counts.most_common(1)[0][0]
    starts = np.array(sorted(c.first_ns for c in collectives if c.comm == comm))
    return round(float(np.median(np.diff(starts))) / 1e6, 3) if len(starts) > 1 else None
