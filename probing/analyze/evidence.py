"""The evidence that a rank is late at a communicator's collectives
(``evidence``: how often it is last, how late, its order test), and the
robust statistics it is told by (medians, MADs, a binomial test, a change
point), so one noisy step raises nothing. The method follows C4
(per-collective timestamps across ranks: the last rank to arrive is the
one the others wait for) and FALCON (a change point over the per-iteration
series tells since when)."""

from __future__ import annotations

import dataclasses
import functools
import math
from itertools import chain, repeat

import numpy as np

from probing.analyze.collectives import Collective

MAD_SCALE = 1.4826  # MAD -> standard deviation for normal noise
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

# -- robust statistics ----------------------------------------------------------------


def arrivals(cs: list[Collective], ranks: list[int]) -> np.ndarray:
    """``A[k, j]``: when ``ranks[j]`` entered ``cs[k]``, ns after the first
    arrival at any of them (a float64: exact to the ns over days); NaN where
    it was not there."""
    if not cs or not ranks:
        return np.full((len(cs), len(ranks)), np.nan)
    return by_rank([c.ts for c in cs], ranks, first_arrival(cs))


def first_arrival(cs: list[Collective]) -> int:
    """The first arrival at any of ``cs`` (wall ns), the base of ``by_rank``'s
    matrices of them; one of them has an arrival."""
    return min(c.first_ns for c in cs if c.ts)


def by_rank(of: list[dict[int, int]] | list[dict[int, int | None]], ranks: list[int],
            base: int) -> np.ndarray:  # fmt: skip
    """``M[k, j]``: ``of[k][ranks[j]]`` (a collective's arrivals or
    returns), ns after ``base`` (a float64: exact to the ns over days); NaN
    where it has none (or None: still inside)."""
    out = np.full((len(of), len(ranks)), np.nan)
    col = {r: j for j, r in enumerate(ranks)}
    sizes = [len(d) for d in of]
    total = sum(sizes)
    rows = np.repeat(np.arange(len(of)), sizes)
    every = chain.from_iterable
    cols = np.fromiter(map(col.get, every(of), repeat(-1)), np.intp, total)
    try:  # arrivals, or returns none of which is None: read at once
        ns = np.fromiter(every(d.values() for d in of), np.int64, total)
        there = cols >= 0
    except TypeError:
        values = list(every(d.values() for d in of))
        none = np.fromiter((v is None for v in values), bool, total)
        ns = np.fromiter((base if v is None else v for v in values), np.int64, total)
        there = (cols >= 0) & ~none
    out[rows[there], cols[there]] = ns[there] - base
    return out


def excess_of(arrive: np.ndarray) -> np.ndarray:
    """``excess_matrix`` of ``arrivals``."""
    arrive = arrive / 1e6
    out = np.full_like(arrive, np.nan)
    for j in range(arrive.shape[1]):
        others = np.delete(arrive, j, axis=1)
        there = ~np.all(np.isnan(others), axis=1)
        if there.any():
            out[there, j] = arrive[there, j] - row_median(others[there])
    return out


def row_median(m: np.ndarray) -> np.ndarray:
    """The median of each row of ``m`` (none all NaN), NaN skipped:
    ``np.nanmedian``'s, with ``np.median`` where there is none (10x faster)."""
    got: np.ndarray = np.median(m, axis=1) if not np.isnan(m).any() else np.nanmedian(m, axis=1)
    return got


def excess_matrix(cs: list[Collective], ranks: list[int]) -> np.ndarray:
    """``E[k, j]``: how long after the median arrival of the others
    ``ranks[j]`` entered ``cs[k]``, in ms; NaN where it was not there or was
    alone. One ``nanmedian`` per rank over every collective: a window of
    FSDP's gathers is thousands of collectives."""
    return excess_of(arrivals(cs, ranks))


def median(values: list[float] | list[int]) -> float:
    """``np.median`` of a few values (a collective's ranks), without numpy's
    cost per call (tens of µs, thousands of calls a window)."""
    v = sorted(values)
    n = len(v)
    if not n:
        return math.nan
    mid = n // 2
    return float(v[mid]) if n % 2 else (v[mid - 1] + v[mid]) / 2


def mad(x: np.ndarray) -> float:
    return float(np.median(np.abs(x - np.median(x)))) if len(x) else 0.0


def binom_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), in log space (no scipy)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    # log C(n, i) for i = k..n: the first from lgamma, each next from the one
    # before (times (n-i)/(i+1)), in numpy (a window's n is thousands)
    i = np.arange(k, n + 1, dtype=np.float64)
    step = np.log(n - i[:-1]) - np.log(i[:-1] + 1)
    first = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
    log_c = first + np.concatenate(([0.0], np.cumsum(step)))
    logs = log_c + i * math.log(p) + (n - i) * math.log1p(-p)
    top = float(logs.max())
    return min(1.0, math.exp(top) * float(np.exp(logs - top).sum()))


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


# -- the evidence against a rank ----------------------------------------------------


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


@dataclasses.dataclass(frozen=True)
class Seen:
    """A window's collectives, read once for every rank's ``evidence``: its
    ranks, when each arrived (``arrive``: ``arrivals``), ``excess``
    (``excess_matrix``, NaN as 0), and at each collective how far the last
    arrival came after the one before it (``lead_ms``; NaN: one rank alone)
    and who that was (``last``; -1: alone; of a tie, the later in the
    collective's order of ranks). Each row is its own collective's: the rows
    from ``k0`` serve the slice ``cs[k0:]``."""

    ranks: list[int]
    arrive: np.ndarray
    excess: np.ndarray
    lead_ms: np.ndarray
    last: np.ndarray

    @classmethod
    def of(cls, cs: list[Collective], ranks: list[int] | None = None) -> Seen:
        ranks = sorted({r for c in cs for r in c.ts}) if ranks is None else ranks
        arrive = arrivals(cs, ranks)
        lead_ms, last = np.full(len(cs), np.nan), np.full(len(cs), -1, dtype=np.int64)
        if len(cs) and ranks:
            there = (~np.isnan(arrive)).sum(axis=1)
            order = np.sort(arrive, axis=1)  # NaN last
            k = np.flatnonzero(there > 1)
            top, next_ = order[k, there[k] - 1], order[k, there[k] - 2]
            lead_ms[k] = (top - next_) / 1e6
            last[k] = np.asarray(ranks)[np.nanargmax(arrive[k], axis=1)]
            for i in k[top == next_].tolist():  # a tie: the later of them in its order
                c = cs[i]
                last[i] = sorted(c.ts.items(), key=lambda kv: kv[1])[-1][0]
        excess = np.nan_to_num(excess_of(arrive), nan=0.0)  # alone: not late
        return cls(ranks, arrive, excess, lead_ms, last)

    @functools.cached_property
    def there(self) -> np.ndarray:
        """Whether each of ``ranks`` arrived at any of these collectives."""
        return np.asarray(~np.isnan(self.arrive).all(axis=0))  # of no collective: none

    @functools.cached_property
    def spread(self) -> list[float]:
        """Each rank's robust spread of its ``excess`` (``MAD_SCALE`` x its MAD)."""
        return [MAD_SCALE * mad(self.excess[:, j]) for j in range(len(self.ranks))]

    def since(self, k0: int) -> Seen:
        if not k0:
            return self
        return Seen(
            self.ranks, self.arrive[k0:], self.excess[k0:], self.lead_ms[k0:], self.last[k0:]
        )

    def far_last(self, rank: int, lead: float = FAR_LEAD) -> tuple[int, int]:
        """How many collectives ``rank`` arrived last at by far, of how many
        any rank did: by ``lead`` times the median lead of the last arrival
        over the next (and ``MIN_LAG_MS``). Late by a lot at a few
        collectives of each step (FSDP's gathers) is last by far at those,
        where chance spreads it."""
        there = self.last >= 0
        if not there.any():
            return 0, 0
        leads, lasts = self.lead_ms[there], self.last[there]
        far = lasts[leads > max(lead * float(np.median(leads)), MIN_LAG_MS)]
        return int((far == rank).sum()), len(far)


def far_last(cs: list[Collective], rank: int, lead: float = FAR_LEAD) -> tuple[int, int]:
    """``Seen.far_last`` over ``cs``."""
    return Seen.of(cs).far_last(rank, lead)


def evidence(cs: list[Collective], rank: int, seen: Seen | None = None) -> Evidence:
    """The tests of ``Evidence.named`` for ``rank`` over ``cs`` (complete
    collectives); ``seen``: the caller's ``Seen`` of these, where it has it
    (each rank's evidence reads the same window)."""
    n = len(cs)
    if seen is not None and len(seen.excess) == n:  # the ranks there, as ``Seen.of`` reads them
        ranks = [r for r, x in zip(seen.ranks, seen.there.tolist(), strict=True) if x]
    else:
        ranks = sorted({r for c in cs for r in c.ts})
    if seen is None or seen.ranks != ranks or len(seen.excess) != n:
        seen = Seen.of(cs, ranks)
    matrix = seen.excess
    excess = {r: matrix[:, j] for j, r in enumerate(ranks)}
    arrive = seen.arrive  # rank is at every one of cs
    j = ranks.index(rank)
    mine = arrive[:, j]
    place = (arrive < mine[:, None]).sum(axis=1)  # NaN: not there, never before
    size = (~np.isnan(arrive)).sum(axis=1)
    others = np.delete(arrive, j, axis=1)
    first_max = np.max(np.nan_to_num(others, nan=-np.inf), axis=1, initial=-np.inf)
    late = mine > first_max  # after every other (of none: never)
    last = int(late.sum())
    lost = float((mine[late] - first_max[late]).sum()) / 1e6
    # last by far (a slow step now and then), and by very far: the noise's far-last
    # arrivals, spread over every rank, thin out there while a slow step's stay
    lasts = [seen.far_last(rank), seen.far_last(rank, VERY_FAR * FAR_LEAD)]
    starts = np.nanmin(arrive, axis=1) if n else np.zeros(0)
    span_ms = (starts[-1] - starts[0]) / 1e6 if n > 1 else 0.0
    # the last collective's wait belongs to a step after the span: n-1 steps, n waits
    share = lost * (n - 1) / n / span_ms if span_ms > 0 else 0.0
    spread = seen.spread
    rest = [spread[i] for i, o in enumerate(ranks) if o != rank]
    noise = float(np.median(rest)) if rest else 0.0
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
