"""The verdict's sentence: the worst finding of a diagnosis first (a hang, a
straggler, a slow pipeline stage, a slow link), or the figures that say the
job is healthy, noisy or not judged. Pure text from findings: ``diagnose``
puts the whole verdict together from these parts in one place
(``diagnose.whole_verdict``)."""

from __future__ import annotations

from collections.abc import Sequence

from probing.analyze import cause as ca
from probing.analyze import collectives as coll
from probing.analyze import coverage as cv
from probing.analyze import hangs as hg
from probing.analyze import links as ln
from probing.analyze import mesh
from probing.analyze import pipeline as pp
from probing.analyze import stragglers as sg
from probing.analyze import why as wy

MOST = 0.5  # a cause that explains this share of the lateness heads the verdict
# what to do about ranks not heard from
ASK_AGAIN = "is their engine up? probing ps on their node, then diagnose again"


def verdict(
    stragglers: list[sg.Straggler],
    slow_links: list[ln.SlowLink],
    hangs: list[hg.Hang],
    summary: coll.Summary,
    window_s: float,
    why: Sequence[ca.Why] = (),
    pipe: pp.Pipeline | None = None,
    missing: Sequence[str] = (),
    answered: Sequence[int] = (),
) -> str:
    """One sentence: the worst finding first, or the figures that say it is
    healthy, or why there is no verdict. ``missing``: the peers not heard
    from ("rank 1 (vm): timeout ..."), whose state is unknown: no cause that
    depends on them is named; ``answered``: the ranks whose probes answered."""
    unheard = f"not heard from {'; '.join(missing)}" if missing else ""
    if hangs and unheard and not hangs[0].missing_ranks:  # "every rank" is not known
        h = hangs[0]
        return (
            f"hang: {who_wait(h.waiting_ranks)} in {_where(h)} for {h.age_s:g}+ s; "
            f"{unheard}: whether they entered it is unknown, so no cause is named ({ASK_AGAIN})"
        )
    said = _worst(stragglers, slow_links, hangs, summary, window_s, why, pipe, answered)
    if unheard and said.startswith(("healthy", "noisy", "no verdict")):
        return (
            f"no verdict: {unheard}; their ranks' state is unknown, so none is judged ({ASK_AGAIN})"
        )
    return f"{said}; {unheard} (their state is unknown)" if unheard else said


def _worst(
    stragglers: list[sg.Straggler],
    slow_links: list[ln.SlowLink],
    hangs: list[hg.Hang],
    summary: coll.Summary,
    window_s: float,
    why: Sequence[ca.Why],
    pipe: pp.Pipeline | None,
    answered: Sequence[int],
) -> str:
    """``verdict``'s sentence from the findings alone."""
    if hangs:
        return hang_text(hangs[0])
    if stragglers:
        return straggler_text(stragglers[0], why)
    if pipe is not None and pipe.slow is not None:
        return pipe.text() + cause_text(wy.headline(why, pipe.slow)).replace("/step", "/s")
    if slow_links:
        return slow_link_text(slow_links[0])
    return summary_text(summary, window_s, pipe, answered)


def _where(h: hg.Hang) -> str:
    what = f"{h.op} #{h.seq}" if h.op else f"collective #{h.seq}"
    return f"{what} of {h.comm}" if h.seq >= 0 else "a collective (by their stacks)"


def hang_text(h: hg.Hang) -> str:
    """A hang: who waits where, and who never came (a pipeline's: who never
    sent or received what the others wait for)."""
    if h.op == "recv" and h.missing_ranks:  # a pipeline's
        return (
            f"hang: {who_wait(h.waiting_ranks)} in send/recv for {h.age_s:g}+ s; "
            f"{ranks_text(h.missing_ranks)} never sent or received what they wait for "
            f"({h.detail})"
        )
    where = _where(h)
    said = f" ({h.detail})" if h.detail else ""
    if not h.missing_ranks:
        return (
            f"hang: every rank ({', '.join(map(str, h.waiting_ranks))}) waits in {where} "
            f"for {h.age_s:g}+ s and none returns: the collective itself "
            f"is stuck (network, or a peer's transport){said}"
        )
    return (
        f"hang: {who_wait(h.waiting_ranks)} in {where} for "
        f"{h.age_s:g}+ s; {ranks_text(h.missing_ranks)} never entered it{said}"
    )


def straggler_text(s: sg.Straggler, why: Sequence[ca.Why]) -> str:
    """The straggler: how late, how often, since when, what it costs the
    job, and the cause that explains most of it (``why``)."""
    since = f"since {'at least ' if s.since_start else ''}{hms(s.since_ns)}"
    node = (f" ({s.place})" if s.place else "") + (f" on node {s.node}" if s.node else "")
    groups = (f" in {', '.join(group_text(g) for g in s.groups)}" if len(s.groups) > 1
              else f" on {group_text(s.comm)}")  # fmt: skip
    cause = cause_text(wy.headline(why, s.rank)) or unexplained_text(why, s.rank)
    if s.step_ms > 0 and s.late_steps < 0.5:  # late now and then: how often, how late
        late = (
            f"is {s.late_each_ms:.0f} ms late at {now_and_then(s.late_steps)} "
            f"{s.step_ms:.0f} ms steps, {s.late_ms:.0f} ms a step on average (last at"
        )
    elif s.step_ms > 0:  # the job's step known: how late it makes each
        late = f"is {s.late_ms:.0f} ms late each {s.step_ms:.0f} ms step (last at"
    else:
        late = f"arrives {s.lag_ms_mean:.0f} ms late (last at"
    return (
        f"rank {s.rank}{node} {late} {100 * s.last_share:.0f} % of {s.op}s){groups} "
        f"{since}; the job loses ~{100 * s.share_of_step:.0f} % of its step time{cause}"
    )


def now_and_then(share: float) -> str:
    """How often, in words: "1 in 10 of its", "3 in 10 of its"."""
    if share <= 0:
        return "none of its"
    if share < 0.1:
        return f"1 in {round(1 / share)} of its"
    return f"{round(10 * share)} in 10 of its"


def group_text(comm: str) -> str:
    """A group as a verdict says it: by its role where its name tells one
    (``its TP group gloo/pg23 (TENSOR_MODEL_PARALLEL_GROUP)``), else by name."""
    role = mesh.role_of(comm)
    if role is None:
        return comm
    return f"its {role.upper() if role in mesh.ROLES else role} group {comm}"


def slow_link_text(link: ln.SlowLink) -> str:
    """A slow link: every rank slow in one collective, with no arrival skew."""
    return (
        f"slow link: {link.op} on {link.comm} takes {link.transfer_ms_median:.0f} ms on "
        f"every rank (model {link.baseline_ms:.1f} ms) with no arrival skew "
        f"({link.skew_ms_median:.1f} ms); ~{100 * link.share_of_step:.0f} % of the job's "
        f"time since {hms(link.since_ns)}"
    )


def summary_text(
    summary: coll.Summary,
    window_s: float,
    pipe: pp.Pipeline | None,
    answered: Sequence[int] = (),
) -> str:
    """Nothing found: no verdict (the true reason, and what to do), noisy, or
    healthy, with the figures that say so."""
    if not summary.collectives and pipe is not None:
        return pipe.text()
    if not summary.collectives and 0 < len(answered) < summary.size:
        return (
            f"no verdict: only {ranks_text(sorted(answered))} of the job's {summary.size} "
            "answered, and a collective is judged from every rank's arrival: add --cluster "
            "(every rank through its peers), or give every rank's pid"
        )
    if (summary.busiest or 0) < coll.MIN_COLLECTIVES and summary.pace_ms:
        need_s = max(1.0, 2 * coll.MIN_COLLECTIVES * summary.pace_ms / 1e3)
        step = summary.step_ms or summary.pace_ms
        return (
            f"no verdict: only {summary.busiest or 0} complete collectives of one group in the "
            f"last {window_s:g} s ({coll.MIN_COLLECTIVES} needed to tell a straggler from "
            f"noise), at about one every {step / 1e3:.3g} s in this job: trace every rank at "
            f"least {need_s:.0f} s (--record {need_s:.0f}s), and diagnose over a longer "
            f"--window where {window_s:g} s is less"
        )
    if not summary.collectives:
        return (
            f"no verdict: no collective traced in the last {window_s:g} s "
            "(is every rank traced? probing diagnose --pid P --cluster --record 15s traces "
            "every rank 15 s first; probing trace --pid P --cluster --background leaves them "
            "tracing)"
        )
    chance = 100 / max(summary.ranks, 1)
    spread = (
        f"each rank last {100 * (summary.last_share_min or 0):.0f}-"
        f"{100 * (summary.last_share_max or 0):.0f} % of the time (chance {chance:.0f} %)"
    )
    if summary.noisy:
        return (
            f"noisy, no single straggler: {summary.ranks} ranks, {summary.collectives} "
            f"collectives in the last {window_s:g} s; arrival skew median "
            f"{summary.skew_ms_median:.1f} ms (p99 {summary.skew_ms_p99:.1f} ms), "
            f"{100 * (summary.skew_ms_median or 0) / (summary.step_ms or 1):.0f} % of a "
            f"{summary.step_ms:.0f} ms step; {spread}"
        )
    return (
        f"healthy: {summary.ranks} ranks, {summary.collectives} collectives in the last "
        f"{window_s:g} s; arrival skew median {summary.skew_ms_median:.1f} ms "
        f"(p99 {summary.skew_ms_p99:.1f} ms); {spread}"
    )


def unexplained_text(why: Sequence[ca.Why], rank: int) -> str:
    """Where ``rank``'s samples show nothing of its own that makes it late,
    or were not read, that."""
    w = next((w for w in why if w.rank == rank and w.kind in (wy.NOTHING, wy.UNREAD)), None)
    return f"; {w.text.split(': ', 1)[-1]}" if w is not None else ""


def cause_text(w: ca.Why | None) -> str:
    """The verdict's cause: the one that explains most of the lateness, with
    that share, or that none explains most of it."""
    if w is None:
        return ""
    what = w.text.split(": ", 1)[-1]  # "rank 2: load_batch (...) ..." -> "load_batch (...) ..."
    if w.kind in wy.HARDWARE and w.share is None:  # slower hardware; no wait says how much
        return f": {what}"
    if w.share is None:
        return ""
    pct = f"{100 * w.share:.0f} % of its lateness"
    if w.share < MOST:
        return f"; no single cause explains most of its lateness (the largest: {what}, {pct})"
    if w.kind == "cpu_starvation":
        return (
            f": CPU starvation, it waits {w.extra_ms:.0f} ms/step longer for a CPU than the "
            f"others, {pct} (what else runs on its node?)"
        )
    return f": {what}, {pct}"


def covered_text(said: str, cov: cv.Coverage, hang: bool, window_s: float) -> str:
    """The verdict ``said`` over ``cov``'s span, with the ranks not tracing:
    no verdict where no instant had every rank tracing (a hang seen in the
    stacks and counts stands: it needs no trace)."""
    note = cov.note()
    if not note:
        return said
    if cov.span is None and not hang:
        return (
            f"no verdict: not every rank traced in the last {window_s:g} s ({note}); "
            "trace every rank: probing trace --pid P --cluster --background"
        )
    if cov.span is None or cov.now:
        return f"{said}; {note}"
    start, end = cov.shown() or cov.span
    return f"{said} (judged over {cv.hms(start)}-{cv.hms(end)}, while every rank traced; {note})"


def hms(ns: int) -> str:
    """``14:05:01 UTC``: the time of day of ``ns`` (ns since the epoch)."""
    return coll.iso(ns)[11:19] + " UTC"


def who_wait(ranks: Sequence[int]) -> str:
    """``rank 3 waits`` or ``ranks 1, 3 wait``."""
    return f"{ranks_text(ranks)} {'waits' if len(ranks) == 1 else 'wait'}"


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 1, 3``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)
