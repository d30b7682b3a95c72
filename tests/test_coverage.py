"""No verdict from missing data: ``trace.intervals`` says when each rank
traced, and a diagnosis judges only the span in which every rank it compares
was tracing (``probing.analyze.coverage``). A trace stopped in the middle of
a healthy job is never a hang; a window where one rank traced is no
straggler."""

from __future__ import annotations

import re
from typing import Any

import pyarrow as pa

from probing.analyze import analyze
from probing.analyze import coverage as cv
from probing.analyze.diagnose import judge
from probing.cli.asking import diagnose
from probing.errors import ProbingError
from tests.test_analyze import T0, job

S = 10**9


def _intervals(spans: dict[int, list[tuple[int, int | None, str]]]) -> pa.Table:
    rows = [
        {"start_ns": a, "stop_ns": b, "state": state, "rank": r}
        for r, each in spans.items()
        for a, b, state in each
    ]
    schema = pa.schema(
        [("start_ns", pa.int64()), ("stop_ns", pa.int64()), ("state", pa.string()),
         ("rank", pa.int64())]
    )  # fmt: skip
    return pa.Table.from_pylist(rows, schema=schema)


def test_every_rank_tracing_now_is_the_whole_window() -> None:
    rows = _intervals({r: [(T0, None, "tracing")] for r in range(4)}).to_pylist()
    cov = cv.coverage(rows, range(4), T0 + 5 * S, T0 + 65 * S)
    assert cov.span == (T0, T0 + 65 * S) and cov.now and cov.untraced == []
    assert cov.note() == ""


def test_a_rank_that_stopped_ends_the_span_and_is_named() -> None:
    stop = T0 + 30 * S
    spans = {r: [(T0, None, "tracing")] for r in (0, 1, 3)}
    spans[2] = [(T0, stop, "stopped")]
    cov = cv.coverage(_intervals(spans).to_pylist(), range(4), T0, T0 + 60 * S)
    assert cov.span == (T0, stop) and not cov.now
    assert [(u.rank, u.state, u.since_ns) for u in cov.untraced] == [(2, "stopped", stop)]
    assert cov.note() == f"rank 2 stopped tracing since {cv.hms(stop)}"


def test_spans_that_never_overlap_are_no_span() -> None:
    spans = {0: [(T0, T0 + 10 * S, "stopped")], 1: [(T0 + 20 * S, None, "tracing")]}
    cov = cv.coverage(_intervals(spans).to_pylist(), [0, 1, 2], T0, T0 + 60 * S)
    assert cov.span is None and not cov.now
    assert {u.rank: u.state for u in cov.untraced} == {0: "stopped", 2: "never"}


def test_a_trace_restarted_is_one_span_again() -> None:
    spans = {
        0: [(T0, T0 + 10 * S, "stopped"), (T0 + 20 * S, None, "tracing")],
        1: [(T0, None, "tracing")],
    }
    cov = cv.coverage(_intervals(spans).to_pylist(), [0, 1], T0, T0 + 60 * S)
    assert cov.span == (T0 + 20 * S, T0 + 60 * S) and cov.now and cov.untraced == []


def test_only_one_rank_traced_is_no_verdict_not_a_straggler() -> None:
    """Issue 43: with only rank 0 tracing, rank 0 showed an 8.9 s lag."""
    t = job(straggler=0, lag_ms=40, steps=60)
    now = max(t.column("ts").to_pylist()) + S
    alone = t.filter(pa.compute.equal(t.column("rank"), 0))
    spans = {0: [(T0 - S, None, "tracing")]}
    table, cov = judge(alone, _intervals(spans), [0, 1, 2, 3], [], T0 - S, now)
    d = analyze(table, now_ns=now, coverage=cov)
    assert not d.healthy and not d.stragglers and not d.hangs
    assert d.verdict.startswith("no verdict: not every rank traced"), d.verdict
    assert "ranks 1, 2, 3 never traced in the window" in d.verdict, d.verdict
    assert "probing trace --pid P --cluster --background" in d.verdict


def test_a_straggler_is_judged_over_the_span_every_rank_traced() -> None:
    t = job(straggler=1, lag_ms=40, steps=80)
    ts = sorted(t.column("ts").to_pylist())
    stop, now = ts[len(ts) // 2], ts[-1] + 30 * S
    spans = {r: [(T0 - S, None, "tracing")] for r in (0, 1, 2)}
    spans[3] = [(T0 - S, stop, "stopped")]
    table, cov = judge(t, _intervals(spans), [0, 1, 2, 3], [], T0 - S, now)
    assert max(table.column("ts").to_pylist()) <= stop < max(ts)
    d = analyze(table, now_ns=now, window_s=120, coverage=cov)
    assert [s.rank for s in d.stragglers] == [1], d.verdict
    assert f"rank 3 stopped tracing since {cv.hms(stop)}" in d.verdict
    assert "while every rank traced" in d.verdict
    assert [u.rank for u in d.untraced] == [3]


def test_a_call_cut_off_by_a_stop_is_not_in_flight() -> None:
    """The last call of a rank whose trace stopped had no return traced: it
    is not a call still in flight, and not a hang however old."""
    t = job(hang_rank=2, hang_step=40, steps=60)  # rows with NULL dur_ns at step 40
    stop = max(r["ts"] for r in t.to_pylist()) + S // 10
    now = stop + 40 * S
    spans = {r: [(T0 - S, stop, "stopped")] for r in range(4)}
    before = analyze(t, now_ns=now, hang_after_s=10)
    assert before.hangs  # what the rows alone say
    table, cov = judge(t, _intervals(spans), list(range(4)), [], T0 - S, now)
    assert table.filter(pa.compute.is_null(table.column("dur_ns"))).num_rows == 0
    d = analyze(table, now_ns=now, hang_after_s=10, coverage=cov)
    assert not d.hangs, d.verdict


def test_a_dead_rank_is_a_death_not_a_rank_that_stopped_tracing() -> None:
    died = T0 + 3 * S
    spans = {r: [(T0 - S, None, "tracing")] for r in range(3)}
    spans[3] = [(T0 - S, died, "died")]
    dead = [{"rank": 3, "died_ns": died, "alive": False, "pid": 1003}]
    t = job(steps=30)
    _, cov = judge(t, _intervals(spans), list(range(4)), dead, T0 - S, T0 + 60 * S)
    assert cov is not None and cov.now and cov.untraced == []


def test_probes_without_trace_intervals_are_judged_as_before() -> None:
    t = job(steps=30)
    table, cov = judge(t, None, list(range(4)), [], T0, T0 + 60 * S)
    assert cov is None and table is t


class StoppedHealthyJob:
    """Issue 43's false hang: 4 ranks traced until ``stop``, then the trace
    stopped while the job trains on. 40 s later the ranks' stacks sit in an
    all-reduce (a healthy step spends most of its time there) and their
    collective counts, read one after another, differ by one or two; asked
    again, they have moved."""

    remote = False

    def __init__(self) -> None:
        self.table = job(steps=60)
        self.stop = max(self.table.column("ts").to_pylist()) + S // 10
        self.now = self.stop + 40 * S
        self.counts_asked = 0

    def ask(self, sql: str) -> pa.Table:
        if "FROM comm.collectives" in sql and "GROUP BY" not in sql:
            since = int(re.search(r"ts >= (\d+)", sql).group(1))  # type: ignore[union-attr]
            keep = [r for r in self.table.to_pylist() if r["ts"] >= since]
            return pa.Table.from_pylist(keep, schema=self.table.schema)
        if "FROM trace.intervals" in sql:
            return _intervals({r: [(T0 - S, self.stop, "stopped")] for r in range(4)})
        if "FROM process.stacks" in sql:
            return pa.Table.from_pylist([self._frame(r) for r in range(4)])
        if "_get_sequence_number_for_group" in sql:
            self.counts_asked += 1
            base = 4282 + 26 * self.counts_asked  # a step every 39 ms
            return pa.Table.from_pylist(
                [{"group": "0", "size": 4, "count": base + d, "rank": r, "node": "h"}
                 for r, d in enumerate((2, 0, 1, 1))]
            )  # fmt: skip
        if "FROM process.info" in sql:
            return pa.Table.from_pylist(
                [{"pid": 1000 + r, "alive": True, "died_ns": None, "rank": r} for r in range(4)]
            )
        raise ProbingError("no such table here\n")

    def _frame(self, rank: int) -> dict[str, Any]:
        func, file = ("all_reduce", "torch/distributed/distributed_c10d.py")
        if rank == 2:
            func, file = ("load_batch", "train.py")
        return {"tid": 1, "thread": "MainThread", "state": "R", "depth": 0, "func": func,
                "file": file, "line": 1, "rank": rank, "node": "h"}  # fmt: skip

    def trace_starts_ns(self) -> list[int]:
        return []  # none traces now


def test_a_trace_stopped_in_a_healthy_job_is_no_hang() -> None:
    j = StoppedHealthyJob()
    d, _ = diagnose(j, window_s=60, hang_after_s=10, now_ns=j.now)
    assert not d.hangs, d.verdict
    assert j.counts_asked >= 2  # the counts were watched, and they moved
    assert "while every rank traced; ranks 0, 1, 2, 3 stopped tracing since" in d.verdict
    assert [u.rank for u in d.untraced] == [0, 1, 2, 3]
