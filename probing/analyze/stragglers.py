"""Stragglers: the rank each communicator waits for, named where the
evidence (``probing.analyze.evidence``) holds, with what it costs the job's
step (``stragglers``), and the ranks late now and then (a phase of the
step, a delay at one collective)."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from probing.analyze import steps as st
from probing.analyze.collectives import MIN_COLLECTIVES, Collective, by_comm, iso
from probing.analyze.evidence import (
    FAR_LEAD,
    MIN_FAR,
    MIN_LAG_MS,
    P_LAST,
    P_VALUE,
    SHARE_ALWAYS,
    SHARE_NAMED,
    VERY_FAR,
    Seen,
    by_rank,
    change_point,
    evidence,
    first_arrival,
    row_median,
)


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
        starts = np.array([c.first_ns for c in cs], dtype=np.int64)
        seen = Seen.of(cs, ranks)  # read once for every rank's evidence
        mine = steps.comms.get(comm)
        phase = None  # each collective's place in its step, for ``_late_at_one``
        for j, r in enumerate(ranks):
            excess = seen.excess[:, j]
            if float(np.median(excess)) < 0:
                waits[comm].add(r)
            s = _straggler_on(comm, cs, r, excess, starts, len(ranks), nodes.get(r, ""), mine, seen)
            if s is None and mine is not None and steps.job is not None and mine.period > 1:
                if phase is None:
                    phase = np.array([mine.phase(c.seq) for c in cs])
                s = _late_at_one(
                    comm, cs, r, excess, len(ranks), nodes.get(r, ""), mine, steps.job, phase
                )
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
    seen: Seen | None = None,
) -> Straggler | None:  # fmt: skip
    """Rank ``r`` as a straggler on ``comm``, or None: over ``cs`` (its complete
    collectives, starting at ``starts``, ns), where ``r`` arrived ``excess``
    ms after the others' median (``excess_matrix``; ``seen``: the window's
    ``Seen``), of ``nranks`` ranks. Tested
    (``Evidence.named``) first since the change point where its excess rose
    (``change_point``), where there is one, then over the whole window; one
    only released late by the collective before (``released_late``, over
    ``comm``'s ``step``) is not."""
    k, score = change_point(excess)
    began = k > 0 and score > 3.0 and float(np.median(excess[k:])) > float(np.median(excess[:k]))
    seg_from = [0, k] if began and len(cs) - k >= MIN_COLLECTIVES else [0]
    ev = None
    for k0 in reversed(seg_from):  # the slow period alone first
        e = evidence(cs[k0:], r, None if seen is None else seen.since(k0))
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
    lags = np.array([(c.ts[r] - c.first_ns) / 1e6 for c in cs[k0:]])
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
    later = [c for c in cs if c.first_ns >= s.since_ns]
    own = own_delays(later, s.rank)
    since = [c.first_ns >= s.since_ns for c in cs]
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
    ranks = sorted({r for c in cs for r in (*c.ts, *c.end)})
    if len(cs) < 2 or rank not in ranks:
        return []
    base = first_arrival(cs)
    arrive = by_rank([c.ts for c in cs], ranks, base)
    back = by_rank([c.end for c in cs], ranks, base)  # NaN: never there, or still inside
    seq = np.array([c.seq for c in cs], dtype=np.int64)
    at, before, end = arrive[1:], arrive[:-1], back[:-1]  # each collective, and the one before
    # consecutive, and every rank at the next returned from the one before
    pairs = (seq[1:] == seq[:-1] + 1) & ~np.any(~np.isnan(at) & np.isnan(end), axis=1)
    gaps = np.where(at < end, at - before, at - end)  # NaN where any of the three is
    j = ranks.index(rank)
    others = np.delete(gaps, j, axis=1)
    use = pairs & ~np.isnan(gaps[:, j]) & (~np.isnan(others)).any(axis=1)
    if not use.any():
        return []
    delay = (gaps[use, j] - row_median(others[use])) / 1e6
    return list(zip(seq[1:][use].tolist(), delay.tolist(), strict=True))


def _late_at_one(
    comm: str, cs: list[Collective], r: int, excess: np.ndarray, nranks: int, node: str,
    mine: st.Step, job: st.Step, phase: np.ndarray,
) -> Straggler | None:  # fmt: skip
    """Rank ``r`` as a straggler late at one collective of each step, or None:
    where ``comm`` issues many a step (FSDP's gathers, a reduce-scatter per
    layer), a rank slow before one of them is last there alone, and nowhere
    else; over all of them chance hides it. The collective of the step at
    which its median excess is largest, where that is ``SHARE_ALWAYS`` of the
    job's step and it is last there, and later in the order, beyond chance.
    ``phase``: each of ``cs``' place in ``mine`` (of more than one collective:
    the caller's to check)."""
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
    lags = np.array([(c.ts[r] - c.first_ns) / 1e6 for c in at])
    return Straggler(
        rank=r, node=node, lag_ms_mean=round(float(lags.mean()), 3),
        lag_ms_p99=round(float(np.percentile(lags, 99)), 3),
        excess_ms_median=round(ev.excess_ms_median, 3), last_share=round(ev.last / len(at), 4),
        share_of_step=round(min(1.0, typical[ph] / job.ms), 4),
        since=iso(min(c.first_ns for c in cs)),
        since_ns=min(c.first_ns for c in cs), since_start=True, comm=comm,
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
