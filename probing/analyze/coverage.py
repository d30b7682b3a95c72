"""Which span of time every rank was traced in (``trace.intervals``).

A verdict compares ranks, so it may only come from the time in which every
rank it compares was tracing. A rank that was not leaves holes: its last
collective cut off by a stop looks like a call that never returned, its
missing rows look like a rank that never arrived, and the others' rows alone
look like one rank's lag. ``judged`` keeps the collectives of the latest span
in which all the ranks traced and says which ranks were not tracing, and
since when, where that span is not now.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

INTERVALS_SQL = "SELECT start_ns, stop_ns, state{tags} FROM trace.intervals"

Span = tuple[int, int]  # [start_ns, end_ns)


@dataclasses.dataclass
class Untraced:
    """A rank not tracing at the end of the window: since when, and why."""

    rank: int
    state: str  # "stopped", "died" or "never" (no trace in the window)
    since_ns: int | None  # its last trace's end (None: never traced)


@dataclasses.dataclass
class Coverage:
    """The latest span in which every compared rank traced, within the window."""

    span: Span | None  # None: no instant in the window had every rank tracing
    now: bool  # the span reaches the present: every rank traces now
    untraced: list[Untraced]  # the ranks not tracing now, first stopped first
    since_ns: int = 0  # the window's start: the span as a verdict says it begins no earlier

    def shown(self) -> Span | None:
        """The span as a verdict says it: within the window (``span`` reaches
        before it, for the calls that number a hang)."""
        return None if self.span is None else (max(self.span[0], self.since_ns), self.span[1])

    def note(self) -> str:
        """ "ranks 1, 3 not tracing (stopped since 12:00:01)", or ""."""
        if not self.untraced:
            return ""
        by_what: dict[tuple[str, str], list[int]] = defaultdict(list)
        for u in self.untraced:  # ranks stopped in the same second are said together
            by_what[(u.state, hms(u.since_ns) if u.since_ns else "")].append(u.rank)
        parts = []
        for (state, since), ranks in by_what.items():
            who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"
            when = f" since {since}" if since else ""
            what = {"never": "never traced in the window", "died": f"died{when}"}.get(
                state, f"stopped tracing{when}"
            )
            parts.append(f"{who} {what}")
        return "; ".join(parts)


def hms(ns: int) -> str:
    """Wall-clock ns as the local time of day, HH:MM:SS."""
    return time.strftime("%H:%M:%S", time.localtime(ns / 1e9))


def spans_by_rank(
    rows: Iterable[Mapping[str, Any]], since_ns: int, now_ns: int
) -> dict[int, list[Span]]:
    """Each rank's traced spans (``trace.intervals`` rows tagged ``rank``)
    that reach into ``[since_ns, now_ns]``, merged, oldest first. A span is
    not cut at ``since_ns``: rows older than the window (calls in flight, the
    history that numbers a hang) were traced by it too."""
    spans: dict[int, list[Span]] = defaultdict(list)
    for row in rows:
        start = int(row["start_ns"])
        end = int(row["stop_ns"]) if row.get("stop_ns") is not None else now_ns
        end = min(end, now_ns)
        if end > max(start, since_ns):
            spans[int(row["rank"])].append((start, end))
    return {r: _merged(s) for r, s in spans.items()}


def _merged(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _intersect(a: list[Span], b: list[Span]) -> list[Span]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def coverage(
    rows: Iterable[Mapping[str, Any]], ranks: Iterable[int], since_ns: int, now_ns: int
) -> Coverage:
    """The latest span of ``[since_ns, now_ns]`` in which each of ``ranks``
    traced, from their ``trace.intervals`` rows (``rows``, all states)."""
    rows = list(rows)
    spans = spans_by_rank(rows, since_ns, now_ns)
    ranks = sorted(set(ranks))
    common: list[Span] = [(min([since_ns, *(s[0][0] for s in spans.values())]), now_ns)]
    for r in ranks:
        common = _intersect(common, spans.get(r, []))
    last_stop: dict[int, tuple[str, int]] = {}
    for row in rows:  # each rank's last trace, if it ended
        r, stop = int(row["rank"]), row.get("stop_ns")
        if stop is not None and (r not in last_stop or int(stop) > last_stop[r][1]):
            last_stop[r] = (str(row.get("state") or "stopped"), int(stop))
    untraced = []
    for r in ranks:
        mine = spans.get(r, [])
        if mine and mine[-1][1] >= now_ns:
            continue  # tracing now
        state, since = last_stop.get(r, ("never", 0))
        untraced.append(Untraced(r, state if mine or state == "died" else "never", since or None))
    untraced.sort(key=lambda u: (u.since_ns or 0, u.rank))
    common = [s for s in common if s[1] > since_ns]
    span = common[-1] if common else None
    return Coverage(span, span is not None and span[1] >= now_ns, untraced, since_ns)


def judged(table: pa.Table, cov: Coverage) -> pa.Table:
    """The rows of ``table`` (collectives tagged ``rank``) inside ``cov``'s span;
    none where no span had every rank tracing. A call still in flight at the
    span's end that the span does not reach past (a stop cut it off) goes too:
    only a span that reaches now can hold a call that never returned."""
    import pyarrow.compute as pc

    if cov.span is None or not table.num_rows:
        return table.slice(0, 0)
    start, end = cov.span
    ts = table.column("ts")
    keep = pc.and_(pc.greater_equal(ts, start), pc.less_equal(ts, end))
    if not cov.now:
        keep = pc.and_(keep, pc.is_valid(table.column("dur_ns")))
    return table.filter(keep)
