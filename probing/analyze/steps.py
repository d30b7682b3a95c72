"""The job's training step, from the pattern its collectives repeat.

A step issues the same collectives in the same order every time: DDP one
all-reduce per gradient bucket, FSDP an all-gather and a reduce-scatter per
layer, gradient accumulation its buckets once every k iterations, Megatron
the same sequence in each of its TP, DP and PP groups. The period of that
pattern, in collectives of one communicator, is found from two things that
repeat with it:

1. what each collective is (its op and bytes): collective ``s`` is the same
   as collective ``s + p`` wherever ``p`` is a whole number of steps;
2. the gap before each collective: the gap before ``s`` is like the gap
   before ``s + p`` (the same phase of the next step), where the time between
   two neighbours mixes short gaps (buckets back to back) and long ones (the
   optimizer, the next batch, the forward pass).

The period is the smallest ``p`` that fits both as well as any larger one;
the step is the median time of ``p`` collectives. Sums over ``p`` would favour
multiples of the period (noise averages out over more steps); single gaps
compared one phase apart do not, so a multiple never fits better than the
period itself. An evaluation every N steps only moves the medians a little
(a longer step); a collective of its own, far rarer than the step's kinds
(``RARE``), is a chore left out of the pattern it would shift.

Pure: ``CollectiveLike`` rows in, a ``Step`` out.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MIN_STEPS = 3  # whole periods seen, at least, for a period to be believed
MAX_PERIOD = 1024  # collectives a step of one communicator (a large FSDP model: a few hundred)
MATCH_SLACK = 0.05  # a period's ops and bytes repeat within this share of the best period's
GAP_SLACK = 1.5  # ... and its gaps repeat within this many times the best period's error
GAP_FLOOR = 0.02  # ... or this share of the median gap (noise-free gaps: an error of ~0)
DIVISOR_SLACK = 2.0  # ... and a divisor of it within this many times its error is the period
AGREE = 0.1  # two groups' steps this close (a share of the longer) are one step
RARE = 0.25  # a kind of collective this many times rarer than the median kind: a chore
GAP_CAP = 10.0  # a gap off by more than this many median gaps counts as this many
BLOCK = 64  # periods tried at once (a block of a window's collectives by as many)


class CollectiveLike(Protocol):
    """What a step is found from: a collective as every rank saw it
    (``probing.analyze.collectives.Collective``)."""

    @property
    def comm(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def op(self) -> str: ...
    @property
    def nranks(self) -> int: ...
    @property
    def bytes(self) -> int | None: ...
    @property
    def ts(self) -> dict[int, int]:  # rank -> arrival (wall ns)
        ...
    @property
    def first_ns(self) -> int: ...  # its first arrival


@dataclasses.dataclass(frozen=True)
class Step:
    """One communicator's step: ``period`` collectives a step, ``ms`` the
    median step, ``steps`` whole steps seen, ``start``: the phase (seq modulo
    ``period``) of the collective each step begins with (the one after the
    longest gap)."""

    comm: str
    period: int
    ms: float
    steps: int
    start: int
    # the seqs left out of the pattern: a rare collective's (an evaluation's
    # metric every N steps), each counted out of the seqs after it
    chores: tuple[int, ...] = ()

    def phase(self, seq: int) -> int:
        """Which collective of its step ``seq`` is (0: the first)."""
        return (seq - bisect.bisect_left(self.chores, seq) - self.start) % self.period

    def index(self, seq: int) -> int:
        """Which step ``seq`` belongs to (counted from any one: steps compare)."""
        return (seq - bisect.bisect_left(self.chores, seq) - self.start) // self.period


def of_comm(comm: str, cs: Sequence[CollectiveLike]) -> Step | None:
    """The step of one communicator's collectives (any order; complete or not:
    a rank's arrival says when each began), or None where fewer than
    ``MIN_STEPS`` periods are seen or nothing repeats."""
    by_seq = {c.seq: c for c in cs if c.ts}
    kinds = Counter(f"{c.op}/{c.bytes}" for c in by_seq.values())
    # a collective far rarer than the others is a chore, not the step's pattern
    # (an evaluation's all-reduce every N steps would shift the pattern it breaks)
    rare = {k for k, n in kinds.items() if n < RARE * float(np.median(list(kinds.values())))}
    chores = tuple(sorted(s for s, c in by_seq.items() if f"{c.op}/{c.bytes}" in rare))
    by_pos = {s - bisect.bisect_left(chores, s): c for s, c in by_seq.items() if s not in chores}
    if len(by_pos) < 2 * MIN_STEPS:
        return None
    first = min(by_pos)
    n = max(by_pos) - first + 1  # dense by place: NaN (-1) where a collective was not seen
    t, released = np.full(n, np.nan), np.full(n, np.nan)
    names: dict[str, int] = {}
    sig = np.full(n, -1, dtype=np.int64)
    for s, c in by_pos.items():
        t[s - first] = c.first_ns
        released[s - first] = _released(c)
        sig[s - first] = names.setdefault(f"{c.op}/{c.bytes}", len(names))
    gap = _gaps(t, released)
    # the typical gap between collectives issued apart (back to back ones: none)
    apart = gap[np.isfinite(gap) & (gap > 0)]
    typical = float(np.median(apart)) if len(apart) else 0.0
    if not typical > 0:
        return None
    agree = _fits(sig, gap, typical, min(MAX_PERIOD, n // MIN_STEPS))
    if not agree:
        return None
    best_error = min(e for _, e in agree)
    period = next(p for p, e in agree if e <= GAP_SLACK * best_error + GAP_FLOOR)
    # a multiple of the period repeats as well as the period, by chance better:
    # a divisor that fits nearly as well is the period (a wrong one fits far worse)
    error = dict(agree)
    divisors = [d for d in error if period % d == 0 and d < period]
    fit = [d for d in divisors if error[d] <= DIVISOR_SLACK * error[period] + GAP_FLOOR]
    step = _step(comm, first, t, gap, min(fit, default=period))
    return dataclasses.replace(step, chores=chores) if step is not None else None


def _fits(sig: np.ndarray, gap: np.ndarray, typical: float, most: int) -> list[tuple[int, float]]:
    """The periods 1..``most`` that repeat best, with their gap error
    (period, error), in order: of the collectives seen one period apart, the
    share whose op and bytes (``sig``, -1: unseen) match is within
    ``MATCH_SLACK`` of the best period's; the error is how far off the gaps
    known one period apart are, each at most ``GAP_CAP`` typical gaps (a
    minority of phases, a step's one long gap, counts; a rare outlier
    little). Periods of too few collectives seen (``MIN_STEPS`` periods) or
    no gap known are left out. The counts of every period at once
    (``_lagged``); the errors only of the periods that match, a block at a
    time (each column one period, each row one collective)."""
    n = len(sig)
    if most < 1:
        return []
    seen = _lagged(sig[None, :] >= 0, most)[0]
    known_here = np.isfinite(gap)
    both = _lagged(known_here[None, :], most)[0]
    kinds = np.unique(sig[sig >= 0])
    same = _lagged(sig[None, :] == kinds[:, None], most).sum(axis=0)
    period = np.arange(most + 1)
    ok = (seen >= MIN_STEPS * period) & (both > 0)
    ok[0] = False
    if not ok.any():
        return []
    match = np.where(ok, same / np.maximum(seen, 1), 0.0)
    agree = np.flatnonzero(ok & (match >= match[ok].max() - MATCH_SLACK))
    g = gap / typical
    # later[i, p] = g[i + p], a view (past the end: unknown)
    later = sliding_window_view(np.concatenate([g, np.full(most, np.nan)]), most + 1)[:n]
    fits: list[tuple[int, float]] = []
    for lo in range(0, len(agree), BLOCK):
        ps = agree[lo : lo + BLOCK]
        run = ps[-1] - ps[0] + 1 == len(ps)  # periods side by side: a slice of the view
        off = (later[:, ps[0] : ps[-1] + 1] if run else later[:, ps]) - g[:, None]
        np.abs(off, out=off)
        np.fmin(off, GAP_CAP, out=off)  # NaN (a gap unknown) counts GAP_CAP: taken off below
        err = np.maximum(off.sum(axis=0) - GAP_CAP * (n - both[ps]), 0.0)
        fits += zip(ps.tolist(), (err / both[ps]).tolist(), strict=True)
    return fits


def _lagged(x: np.ndarray, most: int) -> np.ndarray:
    """For each row of ``x`` (bools) and each lag 0..``most``, how many ``i``
    have both ``x[i]`` and ``x[i + lag]``: autocorrelations, by FFT."""
    n = x.shape[1]
    size = 1 << (2 * n).bit_length()  # past 2n - 1: no lag wraps around
    f = np.fft.rfft(x.astype(np.float64), size, axis=1)
    return np.rint(np.fft.irfft(f * np.conj(f), size, axis=1)[:, : most + 1]).astype(np.int64)


def _released(c: CollectiveLike) -> float:
    """When the last rank returned from ``c`` (NaN: one has not, or no returns kept)."""
    ends = getattr(c, "end", None)
    if not ends or len(ends) < len(c.ts):
        return np.nan
    at = getattr(c, "released_ns", None)
    return float(at) if at is not None else np.nan


def _gaps(t: np.ndarray, released: np.ndarray) -> np.ndarray:
    """The gap before each collective (NaN: a neighbour unseen): from when the
    one before released its ranks to the first arrival (none where it was
    issued before then: DDP's buckets), where returns are known. Not from the
    first arrival before: one rank late at a step now and then holds the
    others in the collective it is late to, and a gap from arrival to arrival
    would count that wait as the job's own pattern (a step ten steps long)."""
    gap = np.full(len(t), np.nan)
    if np.isfinite(released).mean() < 0.5:  # returns not kept (transfers): arrival to arrival
        gap[1:] = np.diff(t)
    else:
        gap[1:] = np.maximum(t[1:] - released[:-1], 0.0)
    return gap


def _step(comm: str, first: int, t: np.ndarray, gap: np.ndarray, p: int) -> Step | None:
    """The ``p``-periodic step of the collectives begun at ``t`` (ns, dense
    from seq ``first``; NaN: unseen), each after ``gap`` (ns)."""
    spans = t[p:] - t[:-p]
    spans = spans[np.isfinite(spans)]
    if not len(spans):
        return None
    # a step begins after its longest typical gap (the optimizer, the next batch)
    phases = (first + np.arange(len(t))) % p
    typical = [
        float(np.median(g)) if len(g := gap[(phases == ph) & np.isfinite(gap)]) else -1.0
        for ph in range(p)
    ]
    start = int(np.argmax(typical))
    return Step(comm, p, round(float(np.median(spans)) / 1e6, 3), len(t) // p, start)


@dataclasses.dataclass(frozen=True)
class Steps:
    """The job's step (``job``: None where nothing repeats) and each
    communicator's own, where it has one."""

    job: Step | None
    comms: dict[str, Step]


def find(collectives: Sequence[CollectiveLike]) -> Steps:
    """Each communicator's step and the job's (``job_step``)."""
    by: dict[str, list[CollectiveLike]] = defaultdict(list)
    for c in collectives:
        if c.nranks > 1:
            by[c.comm].append(c)
    comms = {comm: s for comm, cs in sorted(by.items()) if (s := of_comm(comm, cs)) is not None}
    return Steps(job_step(list(comms.values())), comms)


def job_step(found: Sequence[Step]) -> Step | None:
    """The job's step of its communicators' (``found``): every group of a
    synchronous job steps alike, so the step most of them agree on (within
    ``AGREE``), of those the one seen for the most whole steps. A group that
    missed its period (evenly spaced alike collectives) or steps with a
    periodic chore (a barrier every N steps) is outvoted. None: no step."""
    if not found:
        return None

    def votes(s: Step) -> int:
        return sum(1 for o in found if abs(o.ms - s.ms) <= AGREE * max(o.ms, s.ms))

    return max(found, key=lambda s: (votes(s), s.steps))


@dataclasses.dataclass(frozen=True)
class OneRankTransfer:
    """A rank's send or receive as a one-rank ``CollectiveLike``: a pipeline's
    stages talk by point-to-point transfers only, in a pattern its
    microbatches repeat every step (``of_transfers``)."""

    comm: str
    seq: int
    op: str
    nranks: int
    bytes: int | None
    ts: dict[int, int]

    @property
    def first_ns(self) -> int:
        return min(self.ts.values())


def of_transfers(rows: Sequence[dict[str, Any]]) -> list[OneRankTransfer]:
    """Each rank's sends and receives (``pipeline.p2p_rows``, tagged ``rank``),
    in its order, as a sequence of its own (``p2p/rank3``) whose step
    ``find`` tells: the op and peer of each is what repeats."""
    per: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row.get("rank") is not None and row.get("ts") is not None:
            per[int(row["rank"])].append(row)
    out = []
    for rank, mine in sorted(per.items()):
        for seq, row in enumerate(sorted(mine, key=lambda r: r["ts"])):
            out.append(
                OneRankTransfer(
                    f"p2p/rank{rank}",
                    seq,
                    f"{row.get('op')}/{row.get('peer')}",
                    2,
                    row.get("bytes"),
                    {rank: int(row["ts"])},
                )  # fmt: skip
            )
    return out
