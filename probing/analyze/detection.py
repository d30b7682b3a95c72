"""What the always-on detector (``probing.node.detector``) holds its job to,
over tables: its spans and thresholds, and the verdicts it draws between
full analyses (a full analysis is ``probing.analyze.diagnose.analyze``): its
own rank's pace dropped (``slowed``), a tail of the window naming a
straggler (``screen``), a rank standing still (``still``), every rank
tracing (``all_tracing``), how late a straggler was when written
(``held_by``), a window's Gloo contexts, for torch's groups to name (``contexts``)."""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

WINDOW_S = 30.0  # the collectives each detection looks at
HANG_AFTER_S = 10.0  # a collective some rank never entered for this long is a hang
GONE_AFTER = 2  # full detections in a row: a peer missing to be gone, a link slow to be slow
FULL_S = 5.0  # a full detection (every kind of finding, clearing, /metrics) this often ...
QUIET_S = 60.0  # ... doubled after each that found nothing, up to this (a steady healthy job)
ASK_S = 5.0  # how long a detection waits for the ranks' answers, whatever the period
AUX_S = 60.0  # the ranks' deaths and traced spans asked again this often, or at once
# where who answered changed or a rank's newest collective began STILL_S ago
RUNQ_S = 20.0  # how long each rank waited for a CPU (a slow link suspected) asked this often
STILL_S = 2.0
GROUPS_S = 60.0  # torch's groups asked again this often (a job makes them as it goes) ...
GROUPS_RETRY_S = FULL_S  # ... or this soon where they left a Gloo context unnamed (doubling)
GROUPS_KEEP = 65536  # contexts whose group is kept (past it, only the last answer's)
# a call reaches its rank's store within this of its end (drained every 1 s):
# the calls that ended this long before the last ask are asked again
LAG_S = 2.0
RESYNC_S = 60.0  # the whole window asked again this often, and after a rank missed an ask
PACE_S = 10.0  # the detector's own arrivals kept: the pace the last RECENT_S is held to
RECENT_S = 0.5  # ... the last span looked at (4 of the usual intervals, if longer)
SLOWER = 0.7  # a pace under this share of the usual: the ranks are asked at once
MIN_PACE = 20  # arrivals before the last RECENT_S needed to tell a pace
ASK_EVERY_S = 0.5  # between full detections the ranks are asked at most this often ...
ALERT_S = 5.0  # ... and for at most this long after the pace dropped
TAIL_S = 3.0  # the span an ask screens for a straggler
DRAINED_S = 0.2  # a collective is in its rank's store this long after it began, as a rule
CONFIRM_S = 1.0  # a new straggler's lateness lasted this long: written (noise is briefer)
# what a straggler written is explained by, asked as diagnose asks it (queries.queries)
EXPLAIN = ("samples", "cuda", "nvml", "cpu")
# a straggler not named at a full detection but still this share as late as when
# it was written (its excess over the others' median) is not over: the test that
# names one is strict, so one window of a rank still slow may miss it
HOLD = 0.5


def held_by(s: Any) -> tuple[str, float]:
    """How late straggler ``s`` was when written, by the figure of its rank's
    row its end is told by: its median excess; or, late now and then (on time
    at most steps), its p99 lag."""
    if s.late_steps >= 0.5:
        return "excess_ms_median", s.excess_ms_median
    return "lag_ms_p99", s.lag_ms_p99


def all_tracing(intervals: pa.Table | None) -> bool:
    """Whether every rank's last span (``trace.intervals``) traces; True where unknown."""
    if intervals is None or "state" not in intervals.column_names:
        return True
    return all(s == "tracing" for s in intervals.column("state").to_pylist())


def still(table: pa.Table, ranks: set[int], now: int) -> bool:
    """Whether one of ``ranks`` began no collective of ``table`` in the last ``STILL_S``."""
    import pyarrow.compute as pc

    if not table.num_rows:
        return True
    newest = table.group_by("rank").aggregate([("ts", "max")])
    fresh = pc.greater_equal(newest.column("ts_max"), now - int(STILL_S * 1e9))
    moving = set(newest.filter(fresh).column("rank").to_pylist())
    return bool(ranks - moving)


def screen(table: pa.Table, now: int) -> set[int]:
    """The ranks the collectives of the last ``TAIL_S`` of ``table`` name
    stragglers (a few ms: the window's analysis follows where they name one)."""
    import pyarrow.compute as pc

    from probing.analyze import collectives as coll
    from probing.analyze import stragglers as sg

    if not table.num_rows:
        return set()
    tail = table.filter(pc.greater_equal(table.column("ts"), now - int(TAIL_S * 1e9)))
    if not tail.num_rows:
        return set()
    return {s.rank for s in sg.stragglers(coll.match(tail), {})}


def slowed(ts: list[int]) -> bool:
    """Whether arrivals ``ts`` (ns, in order) came at under ``SLOWER`` of
    their earlier pace over their last ``RECENT_S`` (or 4 usual intervals),
    with ``MIN_PACE`` arrivals before it to tell that pace."""
    import numpy as np

    if len(ts) < MIN_PACE:
        return False
    t = np.asarray(ts, dtype=np.int64)
    usual = float(np.median(np.diff(t)))
    recent = max(RECENT_S * 1e9, 4 * usual)
    split = t[-1] - recent
    before = t[t <= split]
    if len(before) < MIN_PACE or before[-1] <= before[0]:
        return False
    pace = (len(before) - 1) / (before[-1] - before[0])  # arrivals per ns, before
    now_pace = int(np.count_nonzero(t > split)) / recent
    return bool(now_pace < SLOWER * pace)


def latest_ts(table: pa.Table) -> int:
    """The latest arrival in ``table`` (0 where it has none)."""
    import pyarrow.compute as pc

    if not table.num_rows:
        return 0
    return int(pc.max(table.column("ts")).as_py() or 0)


GROUP_KEYS = ("node", "rank", "backend", "comm")  # a Gloo context, as torch's groups key it


def contexts(table: pa.Table) -> set[tuple[Any, ...]]:
    """The Gloo contexts of ``table``, by ``GROUP_KEYS``."""
    import pyarrow.compute as pc

    if not table.num_rows or "backend" not in table.column_names:
        return set()
    keys = [c for c in GROUP_KEYS if c in table.column_names]
    # the few distinct ones first (Arrow's hash grouping), then the Gloo ones of them
    picked = table.select(keys).group_by(keys, use_threads=False).aggregate([])
    picked = picked.filter(pc.equal(picked.column("backend"), "gloo"))
    return set(zip(*(picked.column(c).to_pylist() for c in keys), strict=True))


def full_period_s(base_s: float, quiet: int) -> float:
    """The full detections' period after ``quiet`` of them in a row found
    nothing: ``base_s``, doubled after each, ``QUIET_S`` at most (a steady
    healthy job is asked for its window once a minute, not twelve times)."""
    return max(base_s, min(base_s * float(2**quiet), QUIET_S))


def calm(d: Any, got: Any, found: Container[Any], active: bool) -> bool:
    """Whether the full detection ``d`` (who answered: ``got``) found nothing
    at all: every rank answered, the window could be judged, no straggler
    (confirmed or not), slow link or other finding, and none is ``active``."""
    from probing.analyze.collectives import MIN_COLLECTIVES

    judged = (d.summary.busiest or 0) >= MIN_COLLECTIVES  # a window too short tells nothing
    quiet = not (found or active or d.stragglers or d.slow_links or d.hangs or d.dead)
    return quiet and judged and not got.missing


def over(key: tuple[Any, ...], d: Any, got: Any, late: tuple[str, float] | None) -> bool | None:
    """Whether the full detection ``d`` (who answered: ``got``) saw the
    active finding ``key``, which it did not find, over: a straggler only
    where every rank answered, the window could be judged and its rank is
    no longer ``HOLD`` as late as when it was written (``late``: the
    figure and how late, ``held_by``; False: still that late; None: it
    cannot tell); any other finding, yes."""
    from probing.analyze.collectives import MIN_COLLECTIVES

    if key[0] != "straggler":
        return True
    rank = key[1]
    judged = not d.hangs and (d.summary.busiest or 0) >= MIN_COLLECTIVES
    if got.missing or rank not in {t.rank for t in got.peers} or not judged:
        return None
    mine = next((r for r in d.ranks if r["rank"] == rank and r["collectives"]), None)
    figure, then = late or ("excess_ms_median", 0.0)
    return None if mine is None or mine[figure] is None else bool(mine[figure] < HOLD * then)


def gone(row: Mapping[str, object]) -> bool:
    """Whether a rank below the detector, asked whether it lives (``row``:
    the node's ``control`` answer), is out of the election: it died (its
    probe answered that no process is alive) or is gone (refused,
    unreachable, no answer in time). False: it lives, or is not known yet
    (not discovered)."""
    reply = row.get("reply")
    alive = isinstance(reply, list) and any(isinstance(r, dict) and r.get("alive") for r in reply)
    if row.get("status") == 200:
        return not alive
    return row.get("status") == 0 and bool(row.get("addr"))
