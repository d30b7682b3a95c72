"""What the detector asks of the job and of its own rank: ``sql`` over every
rank (``ask_cluster``, the node's ``coordinate``), the window of the job's
collectives kept between asks (``Window``) and its own rank's arrivals at
its collectives (``Pace``). The node is handed in: this package does not
import the cluster's."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from probing.analyze.detection import ASK_S, LAG_S, PACE_S, RESYNC_S, WINDOW_S, slowed
from probing.errors import ProbingError

if TYPE_CHECKING:
    import pyarrow as pa

    from probing.node.detector import Job


def ask_cluster(node: Job, sql: str) -> pa.Table:
    """``sql`` over every rank of ``node``'s job: the ranks its engine serves
    with no SQL where ``sql`` is a plain scan of a table a function makes
    (the node's ``scan``), else by the node's ``coordinate``."""
    scan = getattr(node, "scan", None)
    got = scan(sql, timeout=ASK_S) if scan is not None else None
    table: pa.Table = got[0] if got is not None else node.coordinate(sql, timeout=ASK_S)[0]
    return table


class Pace:
    """The arrivals of the detector's own rank at its collectives, kept
    ``PACE_S``: whether the last ``RECENT_S`` ran slower than the time before
    (each look reads the arrivals since the last, less ``LAG_S``: from
    ``arrivals(since_ns)``, its tracer's drained calls, where it has them;
    else from its own tables, a query of 25 ms a second)."""

    def __init__(self, arrivals: Callable[[int], Any] | None = None) -> None:
        self.ts: list[int] = []  # arrivals, in order
        self.looked_ns = 0
        self.arrivals = arrivals

    def forget(self) -> None:
        self.ts = []
        self.looked_ns = 0

    def look(self, node: Job, now: int) -> bool:
        """This rank's arrivals asked again; whether their pace dropped."""
        lo = now - int(PACE_S * 1e9)
        if self.looked_ns:
            lo = max(lo, self.looked_ns - int(LAG_S * 1e9))
        got = self.arrivals(lo) if self.arrivals is not None else None
        if got is not None:
            fresh = sorted(got.tolist())
        else:
            sql = f"SELECT ts FROM comm.collectives WHERE ts >= {lo}"
            try:
                fresh = sorted(node.database().sql(sql, allow_code=False)["ts"].to_pylist())
            except ProbingError:  # no such table yet: nothing traced
                fresh = []
        keep = now - int(PACE_S * 1e9)
        self.ts = [t for t in self.ts if keep <= t < lo] + fresh
        self.looked_ns = now
        return slowed(self.ts)


class Window:
    """The last ``WINDOW_S`` of the job's finished collectives, kept between
    asks: each fetch asks only for the calls that ended since the last one
    (less ``LAG_S``, for those drained since) and those in flight. The ranks
    the detector's engine serves answer from what their tracers keep, where
    that reaches back far enough (``collectives_since``: no SQL), the others
    by SQL."""

    def __init__(self) -> None:
        self.rows: pa.Table | None = None  # finished calls, each ended before ``asked_ns``
        self.asked_ns = 0  # the wall ns of the last fetch
        self.whole_ns = 0  # ... and of the last that asked the whole window

    def forget(self) -> None:
        self.rows = None

    def fetch(self, node: Job, now: int) -> tuple[pa.Table, Any]:
        """The window's collectives at ``now`` (finished and in flight) and who
        answered; the whole window where nothing is kept, every ``RESYNC_S``,
        and after a rank missed a fetch."""
        import pyarrow as pa
        import pyarrow.compute as pc

        from probing.analyze.queries import queries

        since = now - int(WINDOW_S * 1e9)
        sql = queries(remote=True)["collectives"].format(since_ns=since)
        kept = self.rows
        if now - self.whole_ns >= RESYNC_S * 1e9 or now < self.asked_ns:
            kept = None
        cursor = self.asked_ns - int(LAG_S * 1e9)
        if kept is not None:
            sql = (
                f"SELECT * FROM ({sql}) AS c WHERE c.dur_ns IS NULL OR c.ts + c.dur_ns >= {cursor}"
            )
        else:  # the whole window: every call begun in it ended in it, or is in flight
            cursor = since
        # the ranks of this engine from what their tracers keep (no SQL), where they can
        here = getattr(node, "collectives_since", None)
        asked = here(sql, since, cursor, timeout=ASK_S) if here is not None else None
        table, got = asked if asked is not None else node.coordinate(sql, timeout=ASK_S)[:2]
        if kept is not None and kept.num_rows:
            ts, dur = kept.column("ts"), kept.column("dur_ns")
            old = kept.filter(
                pc.and_(pc.greater_equal(ts, since), pc.less(pc.add(ts, dur), cursor))
            )
            if table.num_columns:
                old = old.select([c for c in table.column_names if c in old.column_names])
                table = pa.concat_tables([old, table], promote_options="permissive")
            else:
                table = old
        self.asked_ns = now
        if kept is None:
            self.whole_ns = now
        # a chunk a drain, a rank: every filter of the analysis would pay for each
        table = table.combine_chunks()
        finished = table.filter(pc.is_valid(table.column("dur_ns"))) if table.num_rows else table
        self.rows = None if got.missing else finished  # a rank's rows missed: all again next
        return table, got
