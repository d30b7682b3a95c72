"""Match collectives across ranks; find stragglers and slow links.

Pure functions over the gathered ``comm.collectives`` rows (a pyarrow Table
with ``node`` and ``rank`` tags, see ``probing.analyze.gather``). The method
follows C4 (per-collective timestamps across ranks: the last rank to arrive
is the one the others wait for) and FALCON (a change point over the
per-iteration series tells since when), with robust statistics: medians,
MADs and a binomial test, so one noisy step raises nothing.

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
import math
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from probing.analyze import columns
from probing.analyze import steps as st

P2P_OPS = ("send", "recv")
MAD_SCALE = 1.4826  # MAD -> standard deviation for normal noise
MIN_COLLECTIVES = 5  # fewer complete collectives than this: no verdict
# a straggler is last more often than chance (1/nranks per collective) and later than
# the others in the arrival order, each with p < P_LAST (divided by the ranks tested)
P_LAST = 0.01
P_VALUE = 1e-3  # ... and where it costs less than SHARE_ALWAYS, the order test p < this
# ... or, later than chance beyond doubt (p < this): a persistent lateness of a few % of
# a step, which noise does not keep up (alike ranks on a loaded 2-core machine reach
# p ~ 3e-5 over 10 s, where the machine favours one for a while)
P_STRONG = 1e-7
MIN_LAG_STRONG_MS = 0.5  # ... and this much later than the others' median (and MIN_EXCESS)
SHARE_ALWAYS = 0.10  # ... and either costs the job this share of its step time
MIN_LAG_MS = 2.0  # ... or is this much later than the others' median (median excess)
MIN_EXCESS = 0.03  # ... and this share of a step later
SHARE_MIN = 0.01  # ... and costs at least this share
SHARE_SPARSE = 0.20  # last more often than chance and costing this share: named
# ... and, where the job's step is known, never one that costs it less than this
# share of its step (a loaded machine keeps one rank 1 ms late a 65 ms step)
SHARE_NAMED = 0.03
NOISY_SKEW = 0.35  # arrival skew above this share of a step with no straggler: noisy
SLOW_LINK_MIN_MS = 5.0  # a collective's transfer time above this and ...
SLOW_LINK_FACTOR = 4.0  # ... this many times the modelled time, and ...
SLOW_LINK_SHARE = 0.15  # ... taking this share of the wall time is a slow link
# ... unless its ranks wait for a CPU at least this share of the excess per collective:
# a starved CPU slows every rank's transfer alike (each hop waits to be scheduled)
CPU_EXPLAINS = 0.5
LINK_LATENCY_MS = 0.25  # model: per ring step (one hop, TCP on a LAN or loopback)
LINK_GBPS = 1.0  # model: bytes per ns (1 GB/s, a slow LAN)


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

    @property
    def complete(self) -> bool:
        return len(self.ts) >= self.nranks and all(e is not None for e in self.end.values())

    def lags_ns(self) -> dict[int, int]:
        first = min(self.ts.values())
        return {r: t - first for r, t in self.ts.items()}

    def transfer_ns(self) -> int | None:
        """Time from the last arrival to the first return: what the wire took."""
        ends = [e for e in self.end.values() if e is not None]
        if len(ends) < len(self.end) or not ends:
            return None
        return max(0, min(ends) - max(self.ts.values()))


@dataclasses.dataclass
class Straggler:
    rank: int
    node: str
    lag_ms_mean: float  # arrival after the first rank, over every collective
    lag_ms_p99: float
    excess_ms_median: float  # arrival after the median of the other ranks
    last_share: float  # share of collectives it arrived last at
    share_of_step: float  # share of the job's wall time spent waiting for it
    since: str  # ISO-8601 UTC: the change point, or the first traced collective
    since_ns: int
    since_start: bool  # True: it was already slow when tracing began
    comm: str
    op: str
    collectives: int
    p_value: float
    groups: list[str] = dataclasses.field(default_factory=list)  # the communicators it slows
    place: str = ""  # where it sits in the job's layout ("TP 1 of 2, PP stage 0, DP 0")
    # a step of the job (``probing.analyze.steps``): how late it makes each one
    # (the sum over the step's collectives of its typical excess at each), that
    # step (ms) and its collectives on ``comm``; 0: the job's step is not known
    late_ms: float = 0.0
    step_ms: float = 0.0
    period: int = 0
    # late now and then (a slow step in ten): the share of steps it is late at
    # (1.0: most), and how late each of those (``late_ms`` is its mean a step)
    late_steps: float = 1.0
    late_each_ms: float = 0.0


@dataclasses.dataclass
class SlowLink:
    comm: str
    op: str
    nodes: list[str]
    transfer_ms_median: float
    baseline_ms: float
    skew_ms_median: float
    share_of_step: float
    since: str
    since_ns: int
    collectives: int


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
    keys = [m.keys[k] for k in m.key.tolist()]
    ranks, ts, ends = m.rank.tolist(), m.ts.tolist(), m.end.tolist()
    for i in np.flatnonzero(~m.done).tolist():
        ends[i] = None  # still inside
    first = m.first.tolist()
    out = []
    for c, (seq, nranks) in enumerate(zip(m.seq.tolist(), m.nranks.tolist(), strict=True)):
        a, b = first[c], first[c + 1]
        who = ranks[a:b]
        arrive, leave = dict(zip(who, ts[a:b], strict=True)), dict(zip(who, ends[a:b], strict=True))
        out.append(Collective(keys[c], seq, m.op[c], nranks, m.bytes[c], arrive, leave))
    return out


# -- robust statistics ----------------------------------------------------------------


def excess_matrix(cs: list[Collective], ranks: list[int]) -> np.ndarray:
    """``E[k, j]``: how long after the median arrival of the others
    ``ranks[j]`` entered ``cs[k]``, in ms; NaN where it was not there or was
    alone. One ``nanmedian`` per rank over every collective: a window of
    FSDP's gathers is thousands of collectives."""
    arrive = np.full((len(cs), len(ranks)), np.nan)
    if not cs or not ranks:
        return arrive
    col = {r: j for j, r in enumerate(ranks)}
    base = min(min(c.ts.values()) for c in cs)  # ns since it: exact in a float64
    for k, c in enumerate(cs):
        for r, t in c.ts.items():
            j = col.get(r)
            if j is not None:
                arrive[k, j] = (t - base) / 1e6
    out = np.full_like(arrive, np.nan)
    for j in range(len(ranks)):
        others = np.delete(arrive, j, axis=1)
        there = ~np.all(np.isnan(others), axis=1)
        if there.any():
            out[there, j] = arrive[there, j] - np.nanmedian(others[there], axis=1)
    return out


def mad(x: np.ndarray) -> float:
    return float(np.median(np.abs(x - np.median(x)))) if len(x) else 0.0


def binom_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), in log space (no scipy)."""
    if k <= 0:
        return 1.0
    logs = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
        + i * math.log(p) + (n - i) * math.log1p(-p)
        for i in range(k, n + 1)
    ]  # fmt: skip
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def change_point(x: np.ndarray, min_size: int = 3) -> tuple[int, float]:
    """The one split of ``x`` that best separates two means (CUSUM / binary
    segmentation's first step): its index and a robust t-like score."""
    n = len(x)
    if n < 2 * min_size:
        return 0, 0.0
    c = np.cumsum(x - x.mean())
    i = np.arange(1, n)
    stat = np.abs(c[:-1]) / np.sqrt(i * (n - i) / n)
    stat[: min_size - 1] = 0
    stat[n - min_size :] = 0
    k = int(np.argmax(stat)) + 1
    a, b = x[:k], x[k:]
    spread = MAD_SCALE * max(mad(a), mad(b)) or 1e-9
    return k, float(abs(np.median(b) - np.median(a)) / spread)


# -- stragglers -------------------------------------------------------------------------


def order_p(positions: np.ndarray, nranks: np.ndarray) -> float:
    """One-sided p-value that a rank arrives later than chance: ``positions``
    is its place in each collective's arrival order (0 first, n-1 last), which
    is uniform where every rank is alike. A rank-sum test stratified by
    collective (paired, so the machine's noise in one step cancels; one
    outlier step moves the sum by at most n-1), by the normal approximation."""
    if not len(positions):
        return 1.0
    mean = float(((nranks - 1) / 2.0).sum())
    var = float(((nranks.astype(np.float64) ** 2 - 1) / 12.0).sum())
    if var <= 0:
        return 1.0
    z = (float(positions.sum()) - mean - 0.5) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2))


@dataclasses.dataclass
class Evidence:
    """One rank's lateness over a run of collectives of one communicator."""

    rank: int
    collectives: int
    last: int  # collectives it arrived last at
    p_last: float  # chance (1/nranks each) explaining ``last``
    p_far: float  # chance explaining how many of the far-last arrivals (``far_last``) are its
    far: int  # how many collectives it arrived last at by very far (``VERY_FAR``)
    p_excess: float  # its place in the arrival order is no later than chance
    excess_ms_median: float  # its arrival after the median of the others
    noise_ms: float  # the others' typical |excess| (median of their robust spreads)
    share_of_step: float  # of the wall time, what the job spent waiting for it alone
    step_ms: float  # the median interval between these collectives

    @property
    def late_share(self) -> float:
        """Its typical lateness (median excess) as a share of the step."""
        return max(0.0, self.excess_ms_median) / self.step_ms if self.step_ms > 0 else 0.0

    def named(self, nranks: int) -> bool:
        """Whether this is a straggler: last more often than chance *and* later
        than the others in the arrival order (each p < ``P_LAST``/nranks), and
        either costing the job ``SHARE_ALWAYS`` of its step time, or later
        than chance with p < ``P_VALUE``/nranks and later than the others'
        median by ``MIN_EXCESS`` of a step (by ``MIN_LAG_STRONG_MS`` where
        p < ``P_STRONG``/nranks). A rank whose median excess alone is
        ``SHARE_ALWAYS`` of a step needs only the order test (p < ``P_VALUE``/nranks).
        One last more often than chance, or last by far more often than
        chance, that costs ``SHARE_SPARSE`` of the step time is named whatever
        its median excess."""
        n = max(nranks, 1)  # one test per rank
        # late by a lot at a few collectives of each step (FSDP gathers a block's
        # weights many times a step; the slow code runs before one of them): its
        # median excess is nothing, but the others wait for it alone that long
        if self.share_of_step >= SHARE_SPARSE and min(self.p_last, self.p_far) < P_LAST / n:
            return True
        # late by a lot now and then (a slow step in ten): last by far there, its
        # median excess nothing; that it is always this rank chance cannot explain
        if self.far >= MIN_FAR and self.p_far < P_VALUE / n and self.share_of_step >= SHARE_NAMED:
            return True
        if self.p_excess >= P_LAST / n:
            return False
        # late by a tenth of a step at the typical collective, beyond chance: under noise
        # it is last less often than that costs (its lead over the next-latest shrinks)
        if self.late_share >= SHARE_ALWAYS and self.p_excess < P_VALUE / n:
            return True
        if self.p_last >= P_LAST / n:
            return False
        if self.share_of_step >= SHARE_ALWAYS:  # a large cost needs less evidence
            return True
        if self.share_of_step < SHARE_MIN:
            return False
        if self.p_excess < P_STRONG / n:  # overwhelming evidence needs a smaller lateness
            late = max(MIN_LAG_STRONG_MS, MIN_EXCESS * self.step_ms)
        elif self.p_excess < P_VALUE / n:
            late = max(MIN_LAG_MS, MIN_EXCESS * self.step_ms)
        else:
            return False
        return self.excess_ms_median >= late


FAR_LEAD = 4.0  # last by this many times the typical last arrival's lead: last by far
VERY_FAR = 4.0  # ... and this many times that: last by very far
MIN_FAR = 5  # a rank last by very far at this many collectives, beyond chance, is late now and then


def far_last(cs: list[Collective], rank: int, lead: float = FAR_LEAD) -> tuple[int, int]:
    """How many collectives ``rank`` arrived last at by far, of how many any
    rank did: by ``lead`` times the median lead of the last arrival over
    the next (and ``MIN_LAG_MS``). Late by a lot at a few collectives of each
    step (FSDP's gathers) is last by far at those, where chance spreads it."""
    leads, lasts = [], []
    for c in cs:
        order = sorted(c.ts.items(), key=lambda kv: kv[1])
        if len(order) > 1:
            leads.append((order[-1][1] - order[-2][1]) / 1e6)
            lasts.append(order[-1][0])
    if not leads:
        return 0, 0
    bar = max(lead * float(np.median(leads)), MIN_LAG_MS)
    far = [who for who, lead in zip(lasts, leads, strict=True) if lead > bar]
    return sum(1 for who in far if who == rank), len(far)


def evidence(cs: list[Collective], rank: int) -> Evidence:
    """The tests of ``Evidence.named`` for ``rank`` over ``cs`` (complete collectives)."""
    ranks = sorted({r for c in cs for r in c.ts})
    n = len(cs)
    matrix = np.nan_to_num(excess_matrix(cs, ranks), nan=0.0)  # alone: not late
    excess = {r: matrix[:, j] for j, r in enumerate(ranks)}
    lost = 0.0
    last = 0
    place = np.zeros(n)
    size = np.zeros(n)
    for k, c in enumerate(cs):
        ts = c.ts
        place[k] = sum(1 for t in ts.values() if t < ts[rank])
        size[k] = len(ts)
        others = [t for o, t in ts.items() if o != rank]
        if others and ts[rank] > max(others):
            last += 1
            lost += (ts[rank] - max(others)) / 1e6
    # last by far (a slow step now and then), and by very far: the noise's far-last
    # arrivals, spread over every rank, thin out there while a slow step's stay
    lasts = [far_last(cs, rank), far_last(cs, rank, VERY_FAR * FAR_LEAD)]
    starts = np.array([min(c.ts.values()) for c in cs], dtype=np.int64)
    span_ms = (starts[-1] - starts[0]) / 1e6 if n > 1 else 0.0
    # the last collective's wait belongs to a step after the span: n-1 steps, n waits
    share = lost * (n - 1) / n / span_ms if span_ms > 0 else 0.0
    others = [o for o in ranks if o != rank]
    noise = float(np.median([MAD_SCALE * mad(excess[o]) for o in others])) if others else 0.0
    return Evidence(
        rank=rank,
        collectives=n,
        last=last,
        p_last=binom_tail(last, n, 1.0 / max(len(ranks), 1)),
        p_far=min(binom_tail(m, f, 1.0 / max(len(ranks), 1)) if f else 1.0 for m, f in lasts),
        far=lasts[1][0],
        p_excess=order_p(place, size),
        excess_ms_median=float(np.median(excess[rank])) if n else 0.0,
        noise_ms=noise,
        share_of_step=min(1.0, share),
        step_ms=float(np.median(np.diff(starts))) / 1e6 if n > 1 else 0.0,
    )


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


def stragglers(
    collectives: list[Collective], nodes: dict[int, str], steps: st.Steps | None = None
) -> list[Straggler]:
    """Ranks that keep arriving last, more often than chance and later than the
    others' own lateness (see ``Evidence``); tested over the whole window and,
    where a rank's excess has a change point, over the time since. ``steps``:
    the job's (``steps.find``, found here where not given) puts each
    straggler's figures per step."""
    comms = by_comm(collectives)
    steps = st.find(collectives) if steps is None else steps
    found: dict[int, Straggler] = {}
    groups: dict[int, list[str]] = defaultdict(list)
    waits: dict[str, set[int]] = defaultdict(set)  # comm -> ranks usually first there
    named_in: dict[str, set[int]] = defaultdict(set)
    for comm, cs in sorted(comms.items()):
        if len(cs) < MIN_COLLECTIVES:
            continue
        ranks = sorted({r for c in cs for r in c.ts})
        starts = np.array([min(c.ts.values()) for c in cs], dtype=np.int64)
        matrix = np.nan_to_num(excess_matrix(cs, ranks), nan=0.0)
        for j, r in enumerate(ranks):
            excess = matrix[:, j]
            if float(np.median(excess)) < 0:
                waits[comm].add(r)
            mine = steps.comms.get(comm)
            s = _straggler_on(comm, cs, r, excess, starts, len(ranks), nodes.get(r, ""), mine)
            if s is None and mine is not None and steps.job is not None:
                s = _late_at_one(comm, cs, r, excess, len(ranks), nodes.get(r, ""), mine, steps.job)
            if s is None:
                continue
            per_step(s, cs, excess, mine, steps.job)
            if s.step_ms and s.share_of_step < SHARE_NAMED:  # a machine favouring a rank
                continue
            groups[r].append(comm)
            named_in[comm].add(r)
            if r not in found or s.share_of_step > found[r].share_of_step:
                found[r] = s
    # a rank that waits in a subgroup for a straggler there (arrives early) is late
    # elsewhere because of it (released late): not a straggler of its own
    for r in list(found):
        for comm, early in waits.items():
            if r in early and named_in[comm] - {r}:
                found.pop(r)
                break
    for r, s in found.items():
        s.groups = sorted(groups[r])
    return sorted(found.values(), key=lambda s: -s.share_of_step)


def _straggler_on(
    comm: str, cs: list[Collective], r: int, excess: np.ndarray, starts: np.ndarray,
    nranks: int, node: str, step: st.Step | None = None,
) -> Straggler | None:  # fmt: skip
    """Rank ``r`` as a straggler on ``comm``, or None: over ``cs`` (its complete
    collectives, starting at ``starts``, ns), where ``r`` arrived ``excess``
    ms after the others' median (``excess_matrix``), of ``nranks`` ranks. Tested
    (``Evidence.named``) first since the change point where its excess rose
    (``change_point``), where there is one, then over the whole window; one
    only released late by the collective before (``released_late``, over
    ``comm``'s ``step``) is not."""
    k, score = change_point(excess)
    began = k > 0 and score > 3.0 and float(np.median(excess[k:])) > float(np.median(excess[:k]))
    seg_from = [0, k] if began and len(cs) - k >= MIN_COLLECTIVES else [0]
    ev = None
    for k0 in reversed(seg_from):  # the slow period alone first
        e = evidence(cs[k0:], r)
        if e.named(nranks):
            ev = e
            break
    if ev is None:
        return None
    k0 = k0 if k0 and began else 0
    # late by a lot at a few collectives: its mean excess, not its median
    sparse = ev.excess_ms_median < 0.5 * float(np.mean(excess[k0:]))
    typical = np.mean if sparse else np.median
    if released_late(cs[k0:], r, excess[k0:], typical, step):
        return None
    if sparse and _released_at_far(cs[k0:], r):  # late now and then, by the link before
        return None
    lags = np.array([(c.ts[r] - min(c.ts.values())) / 1e6 for c in cs[k0:]])
    return Straggler(
        rank=r,
        node=node,
        lag_ms_mean=round(float(lags.mean()), 3),
        lag_ms_p99=round(float(np.percentile(lags, 99)), 3),
        excess_ms_median=round(ev.excess_ms_median, 3),
        last_share=round(ev.last / ev.collectives, 4),
        share_of_step=round(max(ev.share_of_step, min(1.0, ev.late_share)), 4),
        since=iso(int(starts[k0])),
        since_ns=int(starts[k0]),
        since_start=k0 == 0,
        comm=comm,
        op=Counter(c.op for c in cs).most_common(1)[0][0],
        collectives=ev.collectives,
        p_value=max(ev.p_last, ev.p_excess),
    )


def _released_at_far(cs: list[Collective], rank: int) -> bool:
    """Whether ``rank``, last by very far at a few collectives (late now and
    then), was let go late there by the collective before (a rank behind a
    slow link), not held by its own work: its own delay before those
    (``own_delays``; or before the one just before) under half its lead there."""
    own = dict(own_delays(cs, rank))
    leads = [(c, (t[-1] - t[-2]) / 1e6) for c in cs if len(t := sorted(c.ts.values())) > 1]
    if not leads:
        return False
    bar = max(VERY_FAR * FAR_LEAD * float(np.median([lead for _, lead in leads])), MIN_LAG_MS)
    # its own delay there, or before the one just before (an asynchronous launch,
    # DDP's next bucket, carries the delay it was late by to the first)
    at = [(max(own[c.seq], own.get(c.seq - 1, own[c.seq])), lead) for c, lead in leads
          if c.seq in own and lead > bar and max(c.ts, key=c.ts.__getitem__) == rank]  # fmt: skip
    if len(at) < MIN_FAR:
        return False
    return float(np.mean([o for o, _ in at])) < 0.5 * float(np.mean([lead for _, lead in at]))


def per_step(
    s: Straggler, cs: list[Collective], excess: np.ndarray, mine: st.Step | None,
    job: st.Step | None,
) -> None:  # fmt: skip
    """``s``'s figures per step of the job (``job``), where its communicator
    repeats (``mine``): how late it makes a step (``late_ms``: the sum, over
    the step's collectives, of its typical own delay before each, from
    ``s.since_ns``: ``own_delays``; at least its typical ``excess`` at the
    collective it is latest at, where the job sees it arrive), and the share of
    the step the job loses to it (``share_of_step``: that delay over the step)."""
    if job is None or mine is None or job.ms <= 0:
        return
    later = [c for c in cs if min(c.ts.values()) >= s.since_ns]
    own = own_delays(later, s.rank)
    since = [min(c.ts.values()) >= s.since_ns for c in cs]
    arrivals = [(c.seq, e) for c, e, x in zip(cs, excess.tolist(), since, strict=True) if x]
    # where it is latest, it is at least that late a step (what the job sees it
    # arrive); its own delays summed say more where it is late before several
    late = _by_phase(arrivals, mine, max)
    if len(own) >= MIN_COLLECTIVES:
        late = max(late, _by_phase(own, mine, sum))
    s.late_ms = round(max(0.0, late), 3)
    s.step_ms = job.ms
    s.period = mine.period
    if len(own) >= MIN_COLLECTIVES:  # summed; its one delay where the next gives it back
        _now_and_then(s, own, mine, lambda v: max(sum(v), max(v)))
    else:
        _now_and_then(s, arrivals, mine, max)
    # what the job would gain without it: its delay, not the others' waits summed
    # over a step's collectives (waits at back-to-back buckets are one wait)
    s.share_of_step = round(min(1.0, s.late_ms / job.ms), 4)


NOW_AND_THEN = 2.0  # a mean delay a step this many times its typical one: late now and then


def _now_and_then(
    s: Straggler, delays: list[tuple[int, float]], mine: st.Step,
    over: Callable[[list[float]], float],
) -> None:  # fmt: skip
    """Where ``s`` is late at some steps and on time at most (a slow step in
    ten), its typical step says nothing: its lateness a step is its mean
    (``late_ms``: what the job loses), with the share of steps it is late at
    and how late each of those (``late_steps``, ``late_each_ms``). ``over``
    makes one step's figure of its collectives' ``delays``."""
    each: dict[int, list[float]] = defaultdict(list)
    for seq, ms in delays:
        each[mine.index(seq)].append(ms)
    if len(each) < 2 * st.MIN_STEPS:
        return
    per = np.array([over(v) for v in each.values()])
    mean = float(per.mean())
    if mean < MIN_LAG_MS or mean < NOW_AND_THEN * max(s.late_ms, 0.0):
        return
    # the slow steps stand above the mean, and nearer the slowest than 0 (a noisy
    # step above the mean is not one of them)
    late = per > max(mean, 0.5 * float(np.percentile(per, 98)))
    # its steady lateness (its typical step's: no noise's bias), and the slow steps' excess
    base = max(0.0, min(s.late_ms, float(np.median(per[~late]))))
    s.late_ms = round(base + float((per[late] - base).sum()) / len(per), 3)
    s.late_steps = round(float(late.mean()), 4)
    s.late_each_ms = round(float(per[late].mean()), 3)


def _by_phase(
    values: list[tuple[int, float]], step: st.Step, over: Callable[[list[float]], float],
    typical: Callable[..., Any] = np.median,
) -> float:  # fmt: skip
    """``over`` the ``typical`` (median) ``(seq, value)`` of each of ``step``'s collectives."""
    by: dict[int, list[float]] = defaultdict(list)
    for seq, v in values:
        by[step.phase(seq)].append(v)
    return float(over([float(typical(v)) for v in by.values()])) if by else 0.0


def own_delays(cs: list[Collective], rank: int) -> list[tuple[int, float]]:
    """``(seq, ms)``: how much longer than the others' median ``rank`` took to
    reach each collective from where the previous one left it (of consecutive
    ones that every rank returned from): its own delay before each. A rank
    that arrived at the next before the previous was done (an asynchronous
    launch: DDP's buckets, issued back to back) was never held by it, and
    carries its lateness on: its delay counts from its arrival there; one held
    until the previous was done (Gloo's synchronous calls, a bucket waited
    for at the step's end) goes on with the others: from its return."""
    own = []
    for prev, c in zip(cs, cs[1:], strict=False):
        if c.seq != prev.seq + 1 or any(prev.end.get(o) is None for o in c.ts):
            continue
        gaps = {}
        for o, t in c.ts.items():
            end, before = prev.end.get(o), prev.ts.get(o)
            if end is not None and before is not None:
                gaps[o] = t - (before if t < end else end)
        if rank in gaps and len(gaps) > 1:
            others = [g for o, g in gaps.items() if o != rank]
            own.append((c.seq, (gaps[rank] - float(np.median(others))) / 1e6))
    return own


def _late_at_one(
    comm: str, cs: list[Collective], r: int, excess: np.ndarray, nranks: int, node: str,
    mine: st.Step, job: st.Step,
) -> Straggler | None:  # fmt: skip
    """Rank ``r`` as a straggler late at one collective of each step, or None:
    where ``comm`` issues many a step (FSDP's gathers, a reduce-scatter per
    layer), a rank slow before one of them is last there alone, and nowhere
    else; over all of them chance hides it. The collective of the step at
    which its median excess is largest, where that is ``SHARE_ALWAYS`` of the
    job's step and it is last there, and later in the order, beyond chance."""
    if mine.period < 2:
        return None
    phase = np.array([mine.phase(c.seq) for c in cs])
    typical = {ph: float(np.median(excess[phase == ph])) for ph in set(phase.tolist())
               if (phase == ph).sum() >= MIN_COLLECTIVES}  # fmt: skip
    if not typical:
        return None
    ph = max(typical, key=typical.__getitem__)
    if typical[ph] < SHARE_ALWAYS * job.ms:
        return None
    at = [c for c, p in zip(cs, phase.tolist(), strict=True) if p == ph]
    ev = evidence(at, r)
    n = max(nranks, 1)
    if ev.p_last >= P_LAST / n or ev.p_excess >= P_VALUE / n:
        return None
    lags = np.array([(c.ts[r] - min(c.ts.values())) / 1e6 for c in at])
    return Straggler(
        rank=r, node=node, lag_ms_mean=round(float(lags.mean()), 3),
        lag_ms_p99=round(float(np.percentile(lags, 99)), 3),
        excess_ms_median=round(ev.excess_ms_median, 3), last_share=round(ev.last / len(at), 4),
        share_of_step=round(min(1.0, typical[ph] / job.ms), 4),
        since=iso(min(min(c.ts.values()) for c in cs)),
        since_ns=min(min(c.ts.values()) for c in cs), since_start=True, comm=comm,
        op=at[0].op, collectives=len(at), p_value=max(ev.p_last, ev.p_excess),
    )  # fmt: skip


def released_late(
    cs: list[Collective],
    rank: int,
    excess: np.ndarray,
    typical: Callable[..., Any] = np.median,
    step: st.Step | None = None,
) -> bool:
    """Whether ``rank`` arrives late only because the previous collective let it
    go late (a rank behind a slow link), not because of its own work between
    collectives: its ``typical`` own time between them (``own_delays``)
    against its ``typical`` lateness (``excess``, ms, one per collective of
    ``cs``). Where its communicator has a ``step`` of several collectives,
    its own delays over a step against its lateness where it is latest (its
    own work comes before one of them; an asynchronous launch carries that
    lateness to the next). Needs return times (synchronous backends); else False."""
    own = own_delays(cs, rank)
    if len(own) < MIN_COLLECTIVES:
        return False
    if step is None or step.period == 1:
        return float(typical([g for _, g in own])) < 0.5 * float(typical(excess))
    late = _by_phase(
        [(c.seq, e) for c, e in zip(cs, excess.tolist(), strict=True)], step, max, typical
    )
    return _by_phase(own, step, sum, typical) < 0.5 * late


# -- slow links -------------------------------------------------------------------------


def model_ms(nbytes: int | None, nranks: int) -> float:
    """A ring collective's expected time on a slow but healthy network."""
    steps = 2 * max(nranks - 1, 1)
    wire = 2 * (nranks - 1) / max(nranks, 1) * (nbytes or 0) / LINK_GBPS / 1e6
    return steps * LINK_LATENCY_MS + wire


def slow_links(
    collectives: list[Collective], nodes: dict[int, str], runq: dict[int, float] | None = None
) -> list[SlowLink]:
    """Communicators whose collectives are slow for every rank, with no arrival skew,
    and not because their ranks wait for a CPU (``runq``: each rank's threads' time
    runnable but not running, ms per s, from ``python.samples``; None: not sampled)."""
    out = []
    for comm, every in by_comm(collectives).items():
        cs = [c for c in every if c.transfer_ns() is not None]
        if len(cs) < MIN_COLLECTIVES:
            continue
        transfer = np.array([c.transfer_ns() for c in cs], dtype=np.float64) / 1e6
        skew = np.array([max(c.lags_ns().values()) for c in cs], dtype=np.float64) / 1e6
        baseline = float(np.median([model_ms(c.bytes, c.nranks) for c in cs]))
        med = float(np.median(transfer))
        starts = np.array([min(c.ts.values()) for c in cs], dtype=np.int64)
        ends = np.array([max(e for e in c.end.values() if e is not None) for c in cs])
        span_ms = max((ends[-1] - starts[0]) / 1e6, 1e-9)
        share = float(transfer.sum() / span_ms)
        if med < max(SLOW_LINK_MIN_MS, SLOW_LINK_FACTOR * baseline):
            continue
        if share < SLOW_LINK_SHARE or float(np.median(skew)) > med:
            continue
        ranks = sorted({r for c in cs for r in c.ts})
        waits = [runq[r] for r in ranks if runq and r in runq]
        if waits:  # ms a rank waited for a CPU per collective of this comm
            wait_ms = float(np.median(waits)) / 1e3 * span_ms / len(cs)
            if wait_ms >= CPU_EXPLAINS * (med - baseline):
                continue
        k, score = change_point(transfer)
        began = k > 0 and score > 3.0 and float(np.median(transfer[:k])) < SLOW_LINK_MIN_MS
        since_ns = int(starts[k]) if began else int(starts[0])
        out.append(
            SlowLink(
                comm=comm,
                op=Counter(c.op for c in cs).most_common(1)[0][0],
                nodes=sorted({nodes.get(r, "") for r in ranks}),
                transfer_ms_median=round(med, 3),
                baseline_ms=round(baseline, 3),
                skew_ms_median=round(float(np.median(skew)), 3),
                share_of_step=round(min(1.0, share), 4),
                since=iso(since_ns),
                since_ns=since_ns,
                collectives=len(cs),
            )
        )
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
    busiest = [c for c in done if counts and c.comm == counts.most_common(1)[0][0]]
    job = (st.find(collectives) if steps is None else steps).job
    step = job.ms if job is not None else None
    skew = np.array([max(c.lags_ns().values()) / 1e6 for c in done])
    transfer = [c.transfer_ns() for c in done]
    tr = np.array([t / 1e6 for t in transfer if t is not None])
    last = Counter(max(c.ts, key=c.ts.__getitem__) for c in done)
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
    starts = np.array(sorted(min(c.ts.values()) for c in collectives if c.comm == comm))
    return round(float(np.median(np.diff(starts))) / 1e6, 3) if len(starts) > 1 else None
