"""The always-on detector (``probing.node.detector``) on canned cluster
answers: a straggler becomes one finding, in the verdict's words, written
once and cleared once it is over for several detections in a row (never at
one that misses it), whatever its group is called; a rank that stops
answering is gone after two detections, one never discovered is not; only
the lowest rank that answers detects; ``/metrics`` parses as OpenMetrics
and says the job's step and each straggler's cost as diagnose does.
A full detection asks only for the collectives that ended since the last;
between them a look at the detector's own pace asks every rank when it
drops; a straggler that began a moment ago is written once it lasted, a
burst of lateness never; ``PROBING_DETECT_S=0`` is off."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from time import time_ns
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from probing.analyze import detection as dt
from probing.analyze.findings import CLEAR_AFTER
from probing.node.cluster.wire import MissingPeer, PeerTiming
from probing.node.detector import watch
from probing.node.detector.watch import Watch
from probing.node.detector.window import Window
from tests.test_analyze import T0, job


@dataclass
class Got:
    peers: list[PeerTiming] = field(default_factory=list)
    missing: list[MissingPeer] = field(default_factory=list)


class Node:
    """What the detector uses of a ClusterNode: the answers are scripted, or
    come from ``live``, a job running, as its ranks' stores hold it at ``clock``."""

    def __init__(self, rank: int = 0) -> None:
        self.rank, self.pid, self.learning = rank, None, False
        self.answers: list[tuple[pa.Table, Got]] = []
        self.live: pa.Table | None = None
        self.clock = 0
        self.dead: list[dict[str, Any]] = [{"pid": 1, "alive": True, "died_ns": None, "rank": 0}]
        self.runq: list[dict[str, Any]] = []  # python.samples' runq and tick sums per rank
        self.samples: pa.Table = pa.table({})  # SAMPLES_SQL's rows (where each rank's time went)
        self.asked: list[str] = []
        self.lower: dict[int, dict[str, Any] | None] = {}  # what the ranks below answer (alive?)
        self.asked_ranks: list[int] = []
        self.groups: list[dict[str, Any]] = []  # comm.groups rows
        # trace.intervals: every rank tracing since long ago, unless a test says
        self.intervals = [{"start_ns": 0, "stop_ns": None, "state": "tracing", "rank": r}
                          for r in range(4)]  # fmt: skip

    def control(self, path: str, body: bytes, timeout: float, ranks: set[int]) -> list[dict]:  # type: ignore[type-arg]
        assert path == "/query" and b"process.info" in body
        self.asked_ranks += sorted(ranks)
        return [dict(self.lower[r], rank=r) for r in sorted(ranks) if self.lower[r] is not None]

    def coordinate(self, sql: str, *, timeout: float) -> tuple[pa.Table, Got, Any]:
        self.asked.append(sql)
        if "FROM process.info" in sql:  # who died: nobody, or ``self.dead``
            return pa.Table.from_pylist(self.dead), Got(), None
        if "FROM comm.groups" in sql:  # torch's groups, or none: communicators by their own names
            if self.groups:
                return pa.Table.from_pylist(self.groups), Got(), None
            return pa.table({"rank": pa.array([], pa.int64())}), Got(), None
        if "FROM trace.intervals" in sql:
            return pa.Table.from_pylist(self.intervals), Got(), None
        if "FROM python.samples s " in sql:  # what explains a straggler
            return self.samples, Got(), None
        if any(f"FROM {t}" in sql for t in ("cuda.calls", "nvml.gpu", "process.cpu")):
            return pa.table({}), Got(), None
        if "FROM python.samples" in sql:
            return pa.Table.from_pylist(self.runq), Got(), None
        if self.live is not None:  # the window too, as the peers' stores answer it
            since = int(re.findall(r"WHERE ts >= (\d+) OR dur_ns IS NULL", sql)[0])
            table, got = upto(self.live, self.clock), _answered()
            table = table.filter(
                pc.or_kleene(pc.greater_equal(table["ts"], since), pc.is_null(table["dur_ns"]))
            )
        else:
            table, got = self.answers.pop(0)
        return _ended_since(table, sql), got, None

    def database(self) -> Own:
        return Own(self)


class Own:
    """The detector's own database: its rank's tables of the live job."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def sql(self, sql: str, *, allow_code: bool) -> pa.Table:
        assert sql.startswith("SELECT ts FROM comm.collectives WHERE ts >= ") and not allow_code
        since = int(sql.rsplit(" ", 1)[1])
        if self.node.live is None:
            return pa.table({"ts": pa.array([], pa.int64())})
        t = upto(self.node.live, self.node.clock)
        return t.filter(
            pc.and_(pc.equal(t["rank"], self.node.rank), pc.greater_equal(t["ts"], since))
        )


def _ended_since(table: pa.Table, sql: str) -> pa.Table:
    """``table`` as an incremental fetch asks it: the calls that ended since
    its cursor, and those in flight."""
    cursor = re.search(r"c\.ts \+ c\.dur_ns >= (-?\d+)", sql)
    if cursor is None:
        return table
    ts, dur = table.column("ts"), table.column("dur_ns")
    ended = pc.greater_equal(pc.add(ts, dur), int(cursor.group(1)))
    return table.filter(pc.or_kleene(pc.is_null(dur), ended))


def _now(table: pa.Table) -> int:
    return max(table.column("ts").to_pylist()) + 10**9


def later(table: pa.Table, s: float) -> pa.Table:
    """``table`` ``s`` seconds later."""
    i = table.schema.get_field_index("ts")
    return table.set_column(i, "ts", pc.add(table.column("ts"), int(s * 1e9)))


def _answered(n: int = 4) -> Got:
    return Got(peers=[PeerTiming(r, f"host{r // 2}", "", 1.0, 0) for r in range(n)])


def diagnosed(table: pa.Table) -> Any:
    """What ``diagnose`` says of ``table`` (the window the detector analyzes)."""
    from probing.analyze import analyze

    return analyze(table, now_ns=_now(table), window_s=dt.WINDOW_S)


def test_a_small_straggler_its_samples_show_nothing_of_its_own_for_is_not_written() -> None:
    """The watch drops what diagnose drops (``explain.explained``): a rank a
    few ms late (under SMALL_SHARE of the step) whose samples are the
    others' is the machine's noise, not a finding; with a function of its
    own that explains it, it is one."""
    from probing.analyze.explain import SMALL_SHARE
    from tests.test_why import _samples

    slow = job(straggler=2, lag_ms=6, seed=1)
    [s] = diagnosed(slow).stragglers
    assert s.rank == 2 and s.share_of_step < SMALL_SHARE, s
    span = 60 * (80 + 5 + 6) / 1e3
    alike = {r: [("off", "/job/train.py", "load_batch", 41, 20.0 * 60)] for r in range(4)}
    own = {r: [("off", "/job/train.py", "load_batch", 41, (26.0 if r == 2 else 20.0) * 60)]
           for r in range(4)}  # fmt: skip
    for per, written in ((alike, []), (own, [2])):
        node = Node()
        node.samples = _samples(per, span)
        w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
        node.answers = [(slow, _answered())] * 2
        w.once(now_ns=_now(slow))
        found = w.once(now_ns=_now(slow))  # confirmed: it lasted CONFIRM_S
        rows = w.table().to_pylist()
        assert [r["rank"] for r in rows if r["kind"] == "straggler"] == written, (found, rows)


def test_a_straggler_is_one_finding_until_it_is_gone() -> None:
    """Written once, in the verdict's words with the verdict's numbers;
    cleared only at the CLEAR_AFTER-th healthy detection in a row."""
    from probing.analyze.verdict import straggler_text

    node = Node()
    w = Watch(node, tracing=lambda: True, dropped=lambda: {"gloo": 3}, every_s=5)
    slow = job(straggler=2, lag_ms=60, seed=1)
    healthy = later(job(seed=1), 40)  # the slow rows out of the window
    node.answers = [(slow, _answered()), (slow, _answered())]
    node.answers += [(healthy, _answered())] * CLEAR_AFTER
    [new] = w.once(now_ns=_now(slow))
    assert new["kind"] == "straggler" and new["rank"] == 2 and new["node"] == "host1", new
    [s] = diagnosed(slow).stragglers
    # its samples are empty here: the verdict's words, and why it names no cause
    unread = "; its cause is not known: no stack samples of rank 2 in the window"
    assert new["text"].startswith(straggler_text(s, ()) + unread), new["text"]
    assert new["since_ns"] > 0
    assert f"is {s.late_ms:.0f} ms late each {s.step_ms:.0f} ms step" in new["text"]
    assert "FROM comm.collectives WHERE ts >= " in node.asked[0]
    assert w.once(now_ns=_now(slow)) == []  # still there: not written again
    for _ in range(CLEAR_AFTER - 1):  # over, but not yet for long
        assert w.once(now_ns=_now(healthy)) == []
        assert w.table()["cleared_ns"].to_pylist() == [None]
    assert w.once(now_ns=_now(healthy)) == []
    rows = w.table().to_pylist()
    assert [(r["kind"], r["rank"]) for r in rows] == [("straggler", 2)]
    assert rows[0]["cleared_ns"] == _now(healthy)  # gone: cleared, kept
    assert rows[0]["seen_ns"] == _now(slow)  # the last detection that found it


def test_a_straggler_finding_says_its_cause_as_the_verdict_does() -> None:
    """Rank 2's loader sleeps 80 ms a step: the finding written names it, with
    the share of the lateness it explains, in the verdict's words (the
    detector asks what explains a straggler as diagnose does, once)."""
    from probing.analyze import analyze
    from probing.analyze.verdict import straggler_text

    slow = job(straggler=2, lag_ms=30, seed=2)
    steps, span = 60, 60 * (80 + 5 + 30) / 1000
    rows = []
    for r in range(4):
        rows.append({"kind": "tick", "file": None, "func": None, "line": None,
                     "dur_ns": int(span * 1e9), "n": 1, "rank": r})  # fmt: skip
        for kind, func, line, ms in (("off", "load_batch", 41, 80.0 if r == 2 else 0.3),
                                     ("cpu", "step", 12, 5.0)):  # fmt: skip
            rows.append({"kind": kind, "file": "/job/train.py", "func": func, "line": line,
                         "dur_ns": int(ms * steps * 1e6), "n": 1, "rank": r})  # fmt: skip
    node = Node()
    node.samples = pa.Table.from_pylist(rows)
    node.answers = [(slow, _answered())]
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
    [new] = w.once(now_ns=_now(slow))
    d = analyze(slow, now_ns=_now(slow), window_s=dt.WINDOW_S, samples=node.samples)
    [s] = d.stragglers
    assert new["text"] == straggler_text(s, d.why), (new["text"], d.verdict)
    assert ": load_batch (/job/train.py:41) " in new["text"] and "of its lateness" in new["text"]
    assert new["text"] in d.verdict


def test_a_detection_that_misses_a_slow_rank_clears_nothing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Rank 2 stays slow; detections that do not name it (the test that names
    one is strict: one window in a few may miss it), that miss a rank's
    answer, or see it healthy only now and then never clear its finding."""
    import dataclasses

    from probing.analyze import diagnose

    node = Node()
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
    slow = job(straggler=2, lag_ms=60, seed=1)
    healthy = later(job(seed=1), 40)
    node.answers = [(slow, _answered())]
    [new] = w.once(now_ns=_now(slow))
    real = diagnose.analyze

    def unnamed(*args: Any, **kw: Any) -> Any:  # the same window, its straggler not named
        return dataclasses.replace(real(*args, **kw), stragglers=[])

    monkeypatch.setattr(diagnose, "analyze", unnamed)
    node.answers = [(slow, _answered())] * (2 * CLEAR_AFTER)
    for _ in range(2 * CLEAR_AFTER):  # still as late: not over
        assert w.once(now_ns=_now(slow)) == []
        assert w.table()["cleared_ns"].to_pylist() == [None]
    assert w.book.misses[("straggler", 2)] == 0  # each said it is still there
    monkeypatch.setattr(diagnose, "analyze", real)
    lost = Got(peers=_answered(3).peers, missing=[MissingPeer(3, "host1", "h:1", "timeout")])
    # healthy now and then, or a rank's answer missing: never CLEAR_AFTER in a row
    for table, got in [(healthy, _answered()), (healthy, _answered()), (healthy, lost),
                       (slow, _answered()), (healthy, _answered()), (healthy, _answered()),
                       (slow, _answered())] * 2:  # fmt: skip
        node.answers = [(table, got)]
        assert [f["kind"] for f in w.once(now_ns=_now(table))] in ([], ["rank_gone"])
    assert [(f["kind"], f["rank"], f["cleared_ns"]) for f in w.table().to_pylist()
            if f["kind"] == "straggler"] == [("straggler", 2, None)]  # fmt: skip


def groups_of(table: pa.Table, ranks: range | list[int] = range(4)) -> list[dict[str, Any]]:
    """comm.groups rows naming ``ranks``' Gloo contexts in ``table`` torch's group 0."""
    comms = {(r["node"], r["rank"], r["comm"]) for r in table.to_pylist() if r["rank"] in ranks}
    return [{"node": n, "rank": r, "backend": "gloo", "comm": c, "pg": "0", "ranks": [0, 1, 2, 3]}
            for n, r, c in sorted(comms)]  # fmt: skip


def test_one_straggler_is_one_finding_whatever_its_group_is_called() -> None:
    """torch's groups not known at the first detection, known by one rank
    only at the next (its rows alone named gloo/pg0 would split the group),
    then by every rank: one finding, never cleared meanwhile; the groups
    are asked again while a window holds a context they do not name."""
    node = Node()
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
    slow = job(straggler=2, lag_ms=60, seed=1)
    node.answers = [(slow, _answered())]
    [new] = w.once(now_ns=_now(slow))
    assert new["comm"] == "gloo/n4#0", new  # not known yet: by size and order
    node.groups = groups_of(slow, [0])
    t = _now(slow)
    n = int(dt.GROUPS_S / dt.FULL_S) + 2  # a full detection every FULL_S, past GROUPS_S
    for k in range(1, n + 1):  # the job goes on: its window as slow, later
        if k == 3:
            node.groups = groups_of(slow)
        node.answers = [(later(slow, k * dt.FULL_S), _answered())]
        assert w.once(now_ns=t + int(k * dt.FULL_S * 1e9)) == [], k
        assert w.table()["cleared_ns"].to_pylist() == [None], k
    [row] = w.table().to_pylist()
    assert row["seen_ns"] == t + int(n * dt.FULL_S * 1e9)
    asked = [q for q in node.asked if "FROM comm.groups" in q]
    assert len(asked) >= 3, node.asked  # again while a context was not named
    # once every context is named, a window says torch's name, as diagnose does
    assert {c.comm for c in diagnosed(w.groups.names(slow)).stragglers} == {"gloo/pg0"}
    assert w.groups.names(slow).column("pg").to_pylist()[0] == "0"


def test_a_straggler_is_written_by_torchs_name_where_it_came_since_it_was_asked() -> None:
    """The groups asked at a full detection name nothing yet (no rank had
    traced a Gloo call then); rank 2 slows down and a look writes it a
    moment later, the groups' retry not due: they are asked again as it is
    written, and it is written by torch's name."""
    onset = 330
    node = Node()
    node.live = synchronous(lambda k: 60.0 if k >= onset else 0.0, steps=420)
    began = int(node.live.filter(pc.equal(node.live["seq"], onset))["ts"][0].as_py())
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=1)
    node.clock = began - int(2.1e9)
    assert w.once(node.clock) == []  # the groups asked: none named
    assert not w.groups.due(upto(node.live, began), began + int(1.5e9))
    node.groups = groups_of(node.live)
    written = []
    for k in range(1, 8):  # looks every 0.25 s
        node.clock = began + int(k * 0.25e9)
        written += w.look(node.clock)
    [new] = written
    assert new["comm"] == "gloo/pg0" and "gloo/pg0" in new["text"], new


def test_a_window_is_named_by_torchs_groups_only_where_they_name_every_context() -> None:
    """A context one rank's answer left out keeps every rank's rows named by
    size and order (one group, not two); the groups are asked again sooner
    while one is unnamed, later after each answer that named none."""
    from probing.analyze import collectives as coll
    from probing.node.detector.groups import Groups

    slow = job(straggler=2, lag_ms=60, seed=1)
    g = Groups()
    now = _now(slow)
    assert g.due(slow, now)
    g.learn(pa.Table.from_pylist(groups_of(slow, [0, 1, 3])), slow, now)
    assert {c.comm for c in coll.match(g.names(slow))} == {"gloo/n4#0"}  # one group, by size
    assert not g.due(slow, now + int(dt.GROUPS_RETRY_S * 1e9) - 1)
    assert g.due(slow, now + int(dt.GROUPS_RETRY_S * 1e9))  # rank 2's context unnamed
    g.learn(None, slow, now + int(dt.GROUPS_RETRY_S * 1e9))  # named none: later next
    assert not g.due(slow, now + int(2.5 * dt.GROUPS_RETRY_S * 1e9))
    g.learn(
        pa.Table.from_pylist(groups_of(slow, [2])), slow, now + int(3 * dt.GROUPS_RETRY_S * 1e9)
    )
    assert {c.comm for c in coll.match(g.names(slow))} == {"gloo/pg0"}
    assert not g.due(slow, now + int(4 * dt.GROUPS_RETRY_S * 1e9))  # all named: GROUPS_S
    assert g.due(slow, now + int((3 * dt.GROUPS_RETRY_S + dt.GROUPS_S) * 1e9))


def test_no_finding_from_a_window_where_not_every_rank_traced() -> None:
    """Only rank 2 traces (the others stopped before the window): its rows
    alone are no straggler, no hang; with every rank tracing, the same rows
    are one."""
    slow = job(straggler=2, lag_ms=60, seed=1)
    node = Node()
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
    node.intervals = [
        {"start_ns": 0, "stop_ns": None if r == 2 else 1, "state": "tracing" if r == 2
         else "stopped", "rank": r}
        for r in range(4)
    ]  # fmt: skip
    node.answers = [(slow, _answered())]
    assert w.once(now_ns=_now(slow)) == []
    node.intervals = [dict(i, stop_ns=None, state="tracing") for i in node.intervals]
    node.answers = [(slow, _answered())]
    assert [f["kind"] for f in w.once(now_ns=_now(slow))] == ["straggler"]


def test_a_rank_that_stops_answering_is_gone_after_two_detections() -> None:
    node = Node()
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
    healthy = job(seed=2)
    lost = Got(peers=_answered(3).peers, missing=[MissingPeer(3, "host1", "h:1", "refused")])
    node.answers = [(healthy, lost), (healthy, lost)] + [(healthy, _answered())] * CLEAR_AFTER
    assert w.once(now_ns=_now(healthy)) == []  # once: a slow answer, maybe
    [gone] = w.once(now_ns=_now(healthy))
    assert gone["kind"] == "rank_gone" and gone["rank"] == 3
    assert gone["text"] == "rank 3 (host1) does not answer: refused"
    for _ in range(CLEAR_AFTER):
        w.once(now_ns=_now(healthy))
    assert w.table().to_pylist()[0]["cleared_ns"] is not None


def test_a_rank_never_discovered_is_not_gone() -> None:
    """Ranks not discovered yet (the probes still joining the job) are no
    finding, however many detections run before they come."""
    node = Node()
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
    healthy = job(seed=2)
    unknown = [MissingPeer(r, "?", "", "not discovered") for r in (1, 2, 3)]
    node.answers = [(healthy, Got(peers=_answered(1).peers, missing=unknown))] * 3
    for _ in range(3):
        assert w.once(now_ns=_now(healthy)) == []
    # one that answered once and is lost from the directory is gone
    node.answers = [(healthy, _answered())] + [(healthy, Got(_answered(3).peers, unknown[2:]))] * 2
    w.once(now_ns=_now(healthy))
    w.once(now_ns=_now(healthy))
    assert [(f["kind"], f["rank"]) for f in w.once(now_ns=_now(healthy))] == [("rank_gone", 3)]


def test_only_the_lowest_rank_that_lives_detects() -> None:
    node = Node(2)
    alive = {"status": 200, "addr": "a:1", "reply": [{"alive": True}]}
    node.lower = {0: alive, 1: alive}
    assert not Watch(node, lambda: True, dict).detector()  # rank 0 lives: it watches
    node.lower[0] = {"status": 200, "addr": "a:1", "reply": [{"alive": False}]}  # killed
    node.lower[1] = {"status": 0, "addr": "a:2", "reason": "refused"}  # its node gone
    assert Watch(node, lambda: True, dict).detector()
    node.lower[1] = {"status": 0, "addr": "", "reason": "not discovered"}
    assert not Watch(node, lambda: True, dict).detector()  # not known yet: not me
    node.lower[1] = None  # no row for it at all: not known either
    assert not Watch(node, lambda: True, dict).detector()
    assert Watch(Node(0), lambda: True, dict).detector()
    assert node.asked_ranks == [0, 0, 1, 0, 1, 0, 1]  # the first that lives ends the look


def test_metrics_parse_as_openmetrics_with_the_stragglers_lateness() -> None:
    node = Node()
    w = Watch(node, tracing=lambda: True, dropped=lambda: {"gloo": 3, "nccl": 0}, every_s=5)
    slow = job(straggler=1, lag_ms=60, seed=3)
    node.answers = [(slow, _answered())]
    w.once(now_ns=_now(slow))
    families = {f.name: f for f in text_string_to_metric_families(w.metrics())}
    late = {s.labels["rank"]: s.value for s in families["probing_rank_lateness_seconds"].samples}
    assert late["1"] > 0.04 and all(late[r] < 0.02 for r in ("0", "2", "3")), late
    found = {s.labels["kind"]: s.value for s in families["probing_findings"].samples}
    assert found == {"straggler": 1, "slow_link": 0, "hang": 0, "rank_gone": 0}
    dropped = {s.labels["family"]: s.value for s in families["probing_events_dropped"].samples}
    assert dropped == {"gloo": 3, "nccl": 0}
    assert 0.05 < families["probing_step_seconds"].samples[0].value < 0.2
    assert families["probing_detections"].samples[0].value == 1
    # the straggler's cost, as the verdict says it
    [s] = diagnosed(slow).stragglers
    [late] = families["probing_straggler_late_seconds"].samples
    [share] = families["probing_straggler_step_share"].samples
    assert late.labels["rank"] == "1" and abs(late.value - s.late_ms / 1e3) < 1e-6
    assert abs(share.value - s.share_of_step) < 1e-4
    # before any detection: the same families, nothing measured yet
    idle = {
        f.name for f in text_string_to_metric_families(Watch(node, lambda: True, dict).metrics())
    }
    assert {"probing_findings", "probing_events_dropped", "probing_detections"} <= idle


def test_the_step_in_metrics_is_the_jobs_step_as_diagnose_says_it() -> None:
    """A DDP job with 4 buckets a step (4 all-reduces back to back, then 80 ms
    of compute): ``probing_step_seconds`` is the job's step (its summary's,
    ~90 ms), not the interval between two collectives (~20 ms), and its
    HELP says so."""
    node = Node()
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
    table = job(buckets=4, steps=40, seed=6)
    node.answers = [(table, _answered())]
    w.once(now_ns=_now(table))
    text = w.metrics()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    step = families["probing_step_seconds"].samples[0].value
    want = diagnosed(table).summary.step_ms
    assert want and abs(step - want / 1e3) < 1e-6 and 0.08 < step < 0.12, (step, want)
    assert "# HELP probing_step_seconds the job's training step" in text


def test_a_killed_rank_is_gone_with_where_it_died() -> None:
    node = Node()
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
    hung = job(hang_rank=3, hang_step=40, steps=45, seed=4)
    died = max(hung.column("ts").to_pylist())
    node.dead = [{"pid": 4242, "alive": r != 3, "died_ns": died if r == 3 else None, "rank": r}
                 for r in range(4)]  # fmt: skip
    node.answers = [(hung, _answered())]
    new = w.once(now_ns=died + 30 * 10**9)
    gone = [f for f in new if f["kind"] == "rank_gone"]
    assert [f["rank"] for f in gone] == [3], new
    assert gone[0]["text"].startswith("rank 3 (pid 4242) died at "), gone
    assert "(it never entered #" in gone[0]["text"], gone
    assert [f["kind"] for f in new if f["kind"] == "hang"] == ["hang"], new
    from probing.analyze.verdict import hang_text

    [h] = [f for f in new if f["kind"] == "hang"]
    [hang] = watch_analysis(w, hung, died + 30 * 10**9).hangs
    assert h["text"] == hang_text(hang), h["text"]


def test_a_slow_link_is_a_finding_only_when_found_twice_running() -> None:
    """A link slow at one detection only is a burst; slow at two in a row it is
    named."""
    node = Node()
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
    slow = job(link_ms=40.0, seed=5)
    assert analyze_links(slow), "the canned job has a slow link"
    runs = [slow, later(job(seed=5), 40), later(slow, 80), later(slow, 80)]
    node.answers = [(t, _answered()) for t in runs]
    assert w.once(now_ns=_now(runs[0])) == []
    w.once(now_ns=_now(runs[1]))  # healthy between: the count starts again
    assert w.once(now_ns=_now(runs[2])) == []
    [new] = w.once(now_ns=_now(runs[3]))
    assert new["kind"] == "slow_link" and new["text"].startswith("slow link: allreduce on ")


def waits(ms_per_s: float, ranks: int = 4) -> list[dict[str, Any]]:
    """RUNQ_SQL rows: each rank waited ``ms_per_s`` for a CPU over 30 s sampled."""
    rows = []
    for r in range(ranks):
        rows.append({"kind": "tick", "dur_ns": 30 * 10**9, "node": "n", "rank": r})
        rows.append({"kind": "runq", "dur_ns": int(30 * ms_per_s * 1e6), "node": "n", "rank": r})
    return rows


def test_ranks_waiting_for_a_cpu_are_not_a_slow_link() -> None:
    """Every rank's transfer slow while every rank waits for a CPU about as long
    per collective (the noisy machine: each hop waits to be scheduled) is no
    finding; the same transfers with ranks that hardly wait are a slow link."""
    slow = job(link_ms=40.0, seed=5)
    for ms_per_s, named in ((600.0, False), (20.0, True)):
        node = Node()
        node.runq = waits(ms_per_s)
        node.answers = [(slow, _answered()), (slow, _answered())]
        w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
        w.once(now_ns=_now(slow))
        found = w.once(now_ns=_now(slow))
        assert [f["kind"] for f in found] == (["slow_link"] if named else []), ms_per_s
        assert any("FROM python.samples" in q for q in node.asked)


def watch_analysis(w: Watch, table: pa.Table, now: int) -> Any:
    """What ``diagnose`` says of ``table`` as the detector asks it (window, hang age)."""
    from probing.analyze import analyze

    return analyze(table, now_ns=now, window_s=dt.WINDOW_S, hang_after_s=dt.HANG_AFTER_S,
                   dead=w.analyst.aux["dead"])  # fmt: skip


def analyze_links(table: pa.Table) -> list[Any]:
    from probing.analyze import analyze

    return analyze(table, now_ns=_now(table)).slow_links


def test_findings_go_to_a_log_of_their_own_and_name_torchs_groups(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A new finding and its clearing are one JSON line each in
    findings.jsonl (the job's own log may write over its copy there); the
    group is torch's name for it, as diagnose says it."""
    import json

    monkeypatch.setenv("PROBING_RUNTIME_DIR", str(tmp_path))
    (tmp_path / f"probing-{__import__('os').getuid()}").mkdir(mode=0o700)
    slow, healthy = job(straggler=2, lag_ms=60, seed=1), later(job(seed=1), 40)
    comms = {(r["rank"], r["comm"]) for r in slow.to_pylist()}
    node = Node()
    node.groups = [{"node": f"host{r // 2}", "rank": r, "backend": "gloo", "comm": c, "pg": "0",
                    "ranks": [0, 1, 2, 3]} for r, c in comms]  # fmt: skip
    node.answers = [(slow, _answered())] + [(healthy, _answered())] * CLEAR_AFTER
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
    [new] = w.once(now_ns=_now(slow))
    assert "gloo/pg0" in new["text"] and new["comm"] == "gloo/pg0", new["text"]
    for _ in range(CLEAR_AFTER):
        assert w.once(now_ns=_now(healthy)) == []
    from probing import paths

    lines = [json.loads(line) for line in open(paths.findings_log())]
    assert [(x["kind"], x["rank"], x["cleared_ns"] is None) for x in lines] == [
        ("straggler", 2, True),
        ("straggler", 2, False),
    ], lines
    assert lines[0]["text"] == new["text"] and lines[1]["cleared_ns"] == _now(healthy)


def synchronous(
    late_ms: Callable[[int], float], steps: int, rank: int = 2, seed: int = 0
) -> pa.Table:
    """A 4-rank synchronous all-reduce job (``job``'s columns), 80 ms a step:
    ``rank`` arrives ``late_ms(step)`` late; the others wait for it."""
    rng = np.random.default_rng(seed)
    rows, t = [], float(T0)
    for k in range(steps):
        arrive = t + 5e6 + rng.normal(0, 1.0, size=4).clip(-3, 3) * 1e6
        arrive[rank] += late_ms(k) * 1e6
        end = arrive.max() + 0.4e6
        for r in range(4):
            rows.append({"backend": "gloo", "op": "allreduce", "comm": 0x1000 + r, "seq": k,
                         "comm_rank": r, "nranks": 4, "bytes": 80_000, "ts": int(arrive[r]),
                         "dur_ns": int(end - arrive[r]), "pid": 1000 + r,
                         "node": f"host{r // 2}", "rank": r})  # fmt: skip
        t = end + 80e6
    return pa.Table.from_pylist(rows)


def upto(table: pa.Table, clock: int) -> pa.Table:
    """What the ranks' stores hold at ``clock``: the calls that ended by
    then, and those begun and in flight (no ``dur_ns``)."""
    ts, dur = table.column("ts"), table.column("dur_ns")
    ended = table.filter(pc.less_equal(pc.add(ts, dur), clock))
    flying = table.filter(pc.and_(pc.less_equal(ts, clock), pc.greater(pc.add(ts, dur), clock)))
    flying = flying.set_column(
        flying.schema.get_field_index("dur_ns"), "dur_ns", pa.nulls(flying.num_rows, pa.int64())
    )
    return pa.concat_tables([ended, flying])


def ended(table: pa.Table, rank: int, k: int) -> int:
    """When ``rank``'s ``k``-th collective ended (ns)."""
    row = table.filter(pc.and_(pc.equal(table["rank"], rank), pc.equal(table["seq"], k)))
    return int(row["ts"][0].as_py() + row["dur_ns"][0].as_py())


def keys(table: pa.Table) -> list[tuple[int, int, bool]]:
    return sorted(
        zip(table["rank"].to_pylist(), table["seq"].to_pylist(),
            [d is None for d in table["dur_ns"].to_pylist()], strict=True)
    )  # fmt: skip


def test_a_fetch_asks_only_for_what_ended_since_the_last_and_keeps_the_window() -> None:
    """The second fetch asks for the calls that ended since the first (less
    LAG_S) and those in flight; with those it keeps, it holds what the whole
    window holds: each call once, a call in flight at the first fetch
    finished at the second."""
    live = synchronous(lambda k: 0.0, steps=420)  # ~36 s
    a = ended(live, 0, 380) - 10**5  # every rank in #380, none returned yet
    b = a + 10**9
    node = Node()
    node.answers = [(upto(live, a), _answered()), (upto(live, b), _answered())]
    window = Window()
    first, _ = window.fetch(node, a)
    assert "c.ts + c.dur_ns" not in node.asked[0]  # the whole window first
    assert pc.sum(pc.is_null(first["dur_ns"])).as_py() > 0, "a call in flight at the first"
    second, _ = window.fetch(node, b)
    assert f"c.ts + c.dur_ns >= {a - int(dt.LAG_S * 1e9)}" in node.asked[1]
    shipped = _ended_since(upto(live, b), node.asked[1]).num_rows
    assert shipped < upto(live, b).num_rows / 8, shipped
    since = b - int(dt.WINDOW_S * 1e9)
    whole = upto(live, b).filter(
        pc.or_kleene(
            pc.greater_equal(upto(live, b)["ts"], since), pc.is_null(upto(live, b)["dur_ns"])
        )
    )
    assert keys(second) == keys(whole)


def looks(w: Watch, node: Node, start: int, seconds: float) -> dict[int, list[dict[str, Any]]]:
    """``w`` looking every ``w.every_s`` for ``seconds`` from ``start``, a full
    detection whenever one is due (``tick``): what each wrote, by its clock."""
    out = {}
    for k in range(int(seconds / w.every_s) + 1):
        node.clock = start + int(k * w.every_s * 1e9)
        out[node.clock] = w.tick(node.clock)
    return out


def test_a_steady_pace_asks_the_ranks_only_at_full_detections() -> None:
    """Looks between full detections ask no rank while the detector's own
    collectives keep their pace; a steady healthy job's full detections come
    FULL_S, then twice as long apart after each that found nothing (QUIET_S
    at most), the deaths and who traced asked once in AUX_S at most, torch's
    groups once in GROUPS_S."""
    node = Node()
    node.live = synchronous(lambda k: 0.0, steps=1600)
    node.groups = groups_of(node.live)
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=0.25)
    start = ended(node.live, 0, 300)
    asked_at: list[float] = []
    for k in range(int(70.5 / w.every_s) + 1):
        node.clock = start + int(k * w.every_s * 1e9)
        before = len(node.asked)
        assert not w.tick(node.clock)
        asked_at += [k * w.every_s] * (len(node.asked) - before)
    asked = [re.findall(r"FROM (\w+\.\w+)", q)[0] for q in node.asked]
    assert list(zip(asked_at, asked, strict=True)) == [
        (0.0, "comm.collectives"), (0.0, "comm.groups"), (0.0, "process.info"),
        (0.0, "trace.intervals"),
        (2 * dt.FULL_S, "comm.collectives"),
        (6 * dt.FULL_S, "comm.collectives"),
        (14 * dt.FULL_S, "comm.collectives"), (14 * dt.FULL_S, "comm.groups"),
        (14 * dt.FULL_S, "process.info"), (14 * dt.FULL_S, "trace.intervals"),
    ]  # fmt: skip
    assert w.book.detections == 4
    assert w.full_s() == dt.QUIET_S


def test_a_rank_that_stands_still_has_the_deaths_asked_at_once() -> None:
    """Between the AUX_S asks, a rank that began no collective for STILL_S
    (it died, hangs or stopped tracing) has the deaths and spans asked again
    at the next full detection."""
    node = Node()
    node.live = synchronous(lambda k: 0.0, steps=420)
    node.groups = groups_of(node.live)
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=0.25)
    start = ended(node.live, 0, 300)
    looks(w, node, start, 0)
    asked = len(node.asked)
    node.live = node.live.filter(pc.invert(pc.and_(  # rank 1 stops at step 330
        pc.equal(node.live["rank"], 1), pc.greater_equal(node.live["seq"], 330))))  # fmt: skip
    looks(w, node, start + int(w.full_s() * 1e9), 0)  # the next full detection
    tables = [re.findall(r"FROM (\w+\.\w+)", q)[0] for q in node.asked[asked:]]
    assert tables == ["comm.collectives", "process.info", "trace.intervals"], tables


def test_a_slowdown_asks_every_rank_at_once_and_is_written_once_it_lasted() -> None:
    """Rank 2 slows down: the detector's pace drops, so the ranks are asked
    between full detections; the analysis that first names rank 2 does not
    write it, the look once its lateness may have lasted CONFIRM_S does:
    under 1.5 s after the slowdown began, the next full detection 3 s away."""
    from probing.analyze import analyze

    onset = 330
    node = Node()
    node.live = synchronous(lambda k: 60.0 if k >= onset else 0.0, steps=420)
    node.groups = groups_of(node.live)
    began = int(node.live.filter(pc.equal(node.live["seq"], onset))["ts"][0].as_py())
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=1)
    node.clock = began - int(2.1e9)
    assert w.once(node.clock) == []  # a full detection 2.1 s before the onset
    full = len(node.asked)
    written = {}
    for k in range(1, 8):  # looks every 0.25 s
        node.clock = began + int(k * 0.25e9)
        written[node.clock] = w.look(node.clock)
    [(clock, [new])] = [(c, f) for c, f in written.items() if f]
    assert new["kind"] == "straggler" and new["rank"] == 2
    # only the collectives asked, and what explains the straggler once, as it is written
    tables = [re.findall(r"FROM (\w+\.\w+)", q)[0] for q in node.asked[full:]]
    explained = ["python.samples", "cuda.calls", "nvml.gpu", "process.cpu"]
    assert [t for t in tables if t != "comm.collectives"] == explained, tables
    names = [c for c in written if analyze(upto(node.live, c), now_ns=c).stragglers]
    assert names[0] < clock, "named once: not yet written"
    assert began + dt.CONFIRM_S * 1e9 <= clock < began + 1.5e9, (clock - began) / 1e9
    # /metrics says its lateness with it (one scrape: the finding and the rank it blames)
    late = {s.labels["rank"]: s.value for f in text_string_to_metric_families(w.metrics())
            for s in f.samples if s.name == "probing_rank_lateness_seconds"}  # fmt: skip
    assert late and max(late, key=lambda r: late[r]) == "2", late


def test_a_full_detection_clears_nothing_a_look_wrote_from_newer_rows() -> None:
    """The two threads: a full detection that asked before a look wrote a
    straggler does not clear it (its rows are older); one that asked later
    and no longer finds it does."""
    onset = 330
    node = Node()
    # ~80 s: healthy again for as long as it takes to clear (an empty window tells nothing)
    node.live = synchronous(lambda k: 60.0 if onset <= k < onset + 30 else 0.0, steps=900)
    began = int(node.live.filter(pc.equal(node.live["seq"], onset))["ts"][0].as_py())
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=1)
    node.clock = began - int(2e9)
    w.once(node.clock)
    written = []
    for k in range(1, 8):
        node.clock = began + int(k * 0.25e9)
        written += w.look(node.clock)
    [new] = written
    node.clock = began  # asked before the look wrote it
    assert w.once(node.clock) == [] and w.table()["cleared_ns"].to_pylist() == [None]
    for k in range(CLEAR_AFTER):  # long after, healthy again: cleared at the last
        node.clock = began + int(40e9) + int(k * dt.FULL_S * 1e9)
        w.once(node.clock)
    assert w.table()["cleared_ns"].to_pylist() == [node.clock]


def test_detection_is_off_at_zero(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """PROBING_DETECT_S=0 turns the detector off (not the default)."""
    monkeypatch.setenv("PROBING_DETECT_S", "0")
    assert watch.detect_s() == 0.0
    w = Watch(Node(), tracing=lambda: True, dropped=dict)
    w.start()
    assert not w._threads
    monkeypatch.setenv("PROBING_DETECT_S", "0.5")
    assert watch.detect_s() == 0.5


def test_a_burst_of_lateness_is_never_written() -> None:
    """Rank 2 late at five collectives (0.7 s), then on time again: the pace
    drops, an analysis at the end of the burst names it, the next one no
    longer does, and nothing is ever written."""
    from probing.analyze import analyze

    onset = 330
    node = Node()
    node.live = synchronous(lambda k: 60.0 if onset <= k < onset + 5 else 0.0, steps=420)
    began = int(node.live.filter(pc.equal(node.live["seq"], onset))["ts"][0].as_py())
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=0.25)
    written = looks(w, node, began - int(2.1e9), 2 * dt.FULL_S)
    assert not any(written.values()) and w.table().num_rows == 0
    assert any(analyze(upto(node.live, c), now_ns=c).stragglers for c in written if c > began)


def test_the_pace_drops_when_the_collectives_come_slower() -> None:
    """Arrivals every 25 ms for 10 s: steady; then every 85 ms: slower once
    about 0.2 s of them came; faster, or a single late one, is not slower."""
    from probing.analyze.detection import slowed

    steady = [int(k * 25e6) for k in range(400)]
    assert not slowed(steady)
    after = [steady[-1] + int(k * 85e6) for k in range(1, 6)]
    assert not slowed(steady + after[:2]) and slowed(steady + after)
    assert not slowed(steady + [steady[-1] + int(k * 10e6) for k in range(1, 20)])
    assert not slowed(
        steady
        + [steady[-1] + int(200e6)]
        + [steady[-1] + int(200e6 + k * 25e6) for k in range(1, 20)]
    )
    assert not slowed(steady[:15])  # too few to tell a pace


def test_a_look_reads_its_tracers_arrivals_and_asks_no_sql() -> None:
    """With the tracer's drained arrivals (``arrivals(since_ns)``), a look
    plans no query: each reads the arrivals since the last (less LAG_S),
    and a pace that drops is seen as from its tables."""
    from probing.analyze.detection import LAG_S
    from probing.node.detector.window import Pace

    every = np.arange(400, dtype=np.int64) * int(25e6)  # every 25 ms for 10 s
    later = every[-1] + np.arange(1, 6, dtype=np.int64) * int(85e6)  # then every 85 ms
    served = [every]
    asked: list[int] = []

    def arrivals(since_ns: int) -> np.ndarray:
        asked.append(since_ns)
        got = np.concatenate(served)
        return got[got >= since_ns][::-1]  # unsorted, as drained

    no_sql = SimpleNamespace(database=lambda: pytest.fail("a look planned SQL"))
    pace = Pace(arrivals)
    now = int(every[-1]) + 1
    assert not pace.look(no_sql, now) and pace.ts == every.tolist()
    served.append(later)
    assert pace.look(no_sql, int(later[-1]) + 1)
    assert asked[1] == now - int(LAG_S * 1e9) and pace.ts[-5:] == later.tolist()


def test_the_drain_keeps_the_arrivals_of_collectives_only_and_not_for_ever() -> None:
    """``Drainer.arrivals``: the entries of calls with an op (a collective or
    a transfer), not the others' (a wait), the last ARRIVALS_S at most."""
    from probing.node.bpf.drain import ARRIVALS_S, Drainer

    d = Drainer(store=None, decoded=None)  # no family loaded: its drain is a no-op
    s = int(1e9)

    def batch(ts: list[int], op: list[str | None]) -> pa.RecordBatch:
        return pa.RecordBatch.from_pydict({"ts": pa.array(ts, pa.int64()), "op": op})

    d._arrived(batch([1 * s, 2 * s, 3 * s], ["allreduce", None, "send"]))
    assert sorted(d.arrivals(0).tolist()) == [1 * s, 3 * s]
    assert d.arrivals(2 * s).tolist() == [3 * s]
    late = int(3 * s + ARRIVALS_S * s + s)
    d._arrived(batch([late], ["allgather"]))  # the first slice is older than ARRIVALS_S now
    assert d.arrivals(0).tolist() == [late]


def test_a_rank_late_now_and_then_stays_a_finding_while_it_is(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Rank 2 is 60 ms late at one step in ten: its typical arrival is on
    time, so a detection that misses it must not take that for over (its
    slow steps still show in its p99 lag); once they are gone, it clears."""
    import dataclasses

    from probing.analyze import diagnose

    node = Node()
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
    slow = job(steps=200, straggler=2, lag_ms=60.0, every=10, buckets=2, seed=3)
    node.answers = [(slow, _answered())]
    [new] = w.once(now_ns=_now(slow))
    assert new["rank"] == 2 and "late at 1 in 10 of its" in new["text"], new["text"]
    real = diagnose.analyze

    def unnamed(*args: Any, **kw: Any) -> Any:
        return dataclasses.replace(real(*args, **kw), stragglers=[])

    monkeypatch.setattr(diagnose, "analyze", unnamed)
    node.answers = [(slow, _answered())] * (2 * CLEAR_AFTER)
    for _ in range(2 * CLEAR_AFTER):  # its slow steps still there: not over
        assert w.once(now_ns=_now(slow)) == []
    assert w.table()["cleared_ns"].to_pylist() == [None]
    healthy = later(job(steps=200, buckets=2, seed=3), 40)
    node.answers = [(healthy, _answered())] * CLEAR_AFTER
    for _ in range(CLEAR_AFTER):
        w.once(now_ns=_now(healthy))
    assert w.table()["cleared_ns"].to_pylist() == [_now(healthy)]


def _calls(family: str, rows: list[dict[str, Any]]) -> pa.Table:
    """``family``'s ``calls`` rows, every other column null."""
    from probing.node.bpf.families import FAMILIES

    schema = FAMILIES[family].schema
    return pa.Table.from_pylist([{n: r.get(n) for n in schema.names} for r in rows], schema=schema)


def test_the_calls_a_tracer_kept_answer_as_the_peers_sql_does() -> None:
    """``collectives_rows`` (the detector's ask between full detections,
    answered from a tracer's kept calls) says what ``comm.collectives``'s
    SQL says of the same calls, row for row and type for type: each
    backend's branch, calls in flight, from ``since`` and ended from
    ``cursor`` on, rows without an op left out."""
    from probing.analyze.queries import queries
    from probing.node.sql import Database
    from probing.node.store import Store
    from probing.node.tables import trace

    s = int(1e9)
    since, cursor = 100 * s, 120 * s
    common = {"pid": 7, "tid": 8, "nranks": 4, "bytes": 64, "rank": 2}
    gloo_done = _calls("gloo", [
        {**common, "op": "allreduce", "comm": 5, "seq": 1, "ts": 90 * s, "dur_ns": 40 * s},
        {**common, "op": "allreduce", "comm": 5, "seq": 2, "ts": 110 * s, "dur_ns": 5 * s},
        {**common, "op": "allreduce", "comm": 5, "seq": 3, "ts": 119 * s, "dur_ns": 2 * s},
        {**common, "op": "send", "comm": 5, "seq": 4, "ts": 125 * s, "dur_ns": s, "peer": 3,
         "tag": 9, "wait_ns": 77},
        {**common, "op": None, "comm": 5, "ts": 126 * s, "dur_ns": s},  # a wait
    ])  # fmt: skip
    gloo_flying = _calls("gloo", [{**common, "op": "broadcast", "comm": 5, "seq": 5, "ts": 50 * s}])
    nccl_done = _calls("nccl", [
        {**common, "op": "allgather", "comm": 11, "comm_id": 12, "seq": 1, "ts": 121 * s,
         "dur_ns": s, "peer": 0},
        {**common, "op": "recv", "comm": 11, "seq": 2, "ts": 122 * s, "dur_ns": s, "peer": 1},
    ])  # fmt: skip
    nccl_flying = _calls("nccl", [])
    flying = {"gloo": gloo_flying, "nccl": nccl_flying}
    tracer = SimpleNamespace(inflight=lambda family: flying[family])
    db = Database(Store())
    trace.install(db, current=lambda: tracer)  # type: ignore[arg-type,return-value]
    db.store.table("gloo", "calls").append_batch(gloo_done)
    db.store.table("nccl", "calls").append_batch(nccl_done)
    sql = queries(remote=False)["collectives"].format(since_ns=since)
    ask = f"SELECT * FROM ({sql}) AS c WHERE c.dur_ns IS NULL OR c.ts + c.dur_ns >= {cursor}"
    by_sql = db.sql(ask)
    kept = [
        trace.collectives_rows(b, pa.concat_tables([done, flying[b]]), "n1", 6, since, cursor)
        for b, done in (("gloo", gloo_done), ("nccl", nccl_done))
    ]
    mine = pa.concat_tables(kept)
    assert mine.column("node").to_pylist() == ["n1"] * mine.num_rows
    assert set(mine.column("rank").to_pylist()) == {6} and mine.schema.field("rank").type == "int64"
    mine = mine.drop_columns(["node", "rank"])
    assert mine.column_names == by_sql.column_names
    assert [f.type for f in mine.schema] == [f.type for f in by_sql.schema]
    order = [("backend", "ascending"), ("seq", "ascending")]
    assert mine.sort_by(order).to_pylist() == by_sql.sort_by(order).to_pylist()
    # gloo's 3rd, 4th and 5th (in flight), nccl's both; gloo's 1st began before
    # since, its 2nd ended before the cursor, its wait has no op
    assert sorted(mine.column("seq").to_pylist()) == [1, 2, 3, 4, 5]


def test_the_drain_keeps_the_calls_of_collectives_while_it_can_say_what_ended() -> None:
    """``Drainer.calls_since``: the collective families' batches drained
    since the cursor (a call ends before it is drained), or None once the
    cursor is older than what it kept (``RECENT_S``), or where the store
    held calls before the drain began."""
    from probing.node.bpf import drain
    from probing.node.store import Store

    store = Store()
    try:  # no family loaded: its drain is a no-op
        ago = time_ns() - int(60e9)  # a minute before it began: the store held no call
        assert drain.Drainer(store, decoded=None).calls_since(ago) == {}
        store.table("gloo", "calls").append_batch({"ts": [1], "op": ["allreduce"]})
        d = drain.Drainer(store, decoded=None)
    finally:
        store.close()
    assert d.calls_since(time_ns()) is None  # the store held calls it did not drain
    d._kept_ns -= int(10e9)  # as if it began 10 s ago
    first = _calls("gloo", [{"op": "allreduce", "ts": 1, "dur_ns": 1},
                            {"op": None, "ts": 2, "dur_ns": 1}]).to_batches()[0]  # fmt: skip
    d._keep("gloo", first)
    later = time_ns() + 2 * drain.CLOCK_SLACK_NS
    got = d.calls_since(time_ns())
    assert list(got or {}) == ["gloo"] and len(got["gloo"]) == 1  # type: ignore[index]
    kept = got["gloo"][0]  # type: ignore[index]
    # what the detector reads of it, the calls with an op alone
    assert kept.schema.names == [c for c in drain.KEPT_COLUMNS if c in first.schema.names]
    assert kept.to_pylist() == first.select(kept.schema.names).to_pylist()[:1]
    assert d.calls_since(later) == {}
    old = d._recent[0][0] - int(2 * drain.RECENT_S * 1e9)
    d._recent[0] = (old, "gloo", first)
    d._keep("gloo", first)  # the first batch is older than RECENT_S now: let go
    assert len(d._recent) == 1 and d._kept_ns == old
    assert d.calls_since(old) is None  # what ended then went with it
    assert list(d.calls_since(old + 2 * drain.CLOCK_SLACK_NS) or {}) == ["gloo"]


def test_each_ranks_wait_for_a_cpu_is_asked_again_only_after_runq_s() -> None:
    """Where a slow link is suspected, every rank is asked how long it waited
    for a CPU: the answer serves the detections of the next ``RUNQ_S``; the
    ranks the engine serves answer from their samplers (``runq_since``),
    with no SQL."""
    from probing.node.detector.analyst import Analyst

    node = Node()
    node.runq = [{"rank": 0, "runq_ns": 5}]
    analyst = Analyst(node)
    s = int(1e9)
    sql = "SELECT * FROM python.samples"
    first = analyst.runq(100 * s, sql, 70 * s)
    assert first is not None and first.to_pylist() == node.runq
    node.runq = [{"rank": 0, "runq_ns": 9}]
    assert analyst.runq(int((100 + dt.RUNQ_S - 1) * s), sql, 70 * s) is first
    assert len([q for q in node.asked if "python.samples" in q]) == 1
    again = analyst.runq(int((100 + dt.RUNQ_S) * s), sql, 70 * s)
    assert again is not None and again.to_pylist() == node.runq
    assert analyst.runq(50 * s, sql, 20 * s) is not again  # a clock set back: asked again
    since: list[int] = []
    kept = pa.table({"kind": ["runq", "tick"], "dur_ns": [3, s], "rank": [0, 0]})
    node.runq_since = lambda q, at, timeout: since.append(at) or (kept, None)  # type: ignore[attr-defined]
    asked = len(node.asked)
    assert analyst.runq(500 * s, sql, 470 * s) is kept and since == [470 * s]
    assert len(node.asked) == asked  # no SQL


def test_a_window_asks_this_engines_ranks_from_their_tracers_whole_or_since() -> None:
    """``Window.fetch`` asks ``collectives_since`` first: from the window's
    start where it holds nothing (every call begun in it), then from the
    last ask less ``LAG_S``; SQL only where that cannot say."""
    s = int(1e9)
    node = Node()
    cursors: list[tuple[int, int]] = []
    rows = pa.table({"ts": pa.array([95 * s], pa.int64()), "dur_ns": pa.array([s], pa.int64()),
                     "rank": pa.array([0], pa.int64())})  # fmt: skip

    def collectives_since(sql: str, since: int, cursor: int, *, timeout: float) -> Any:
        cursors.append((since, cursor))
        return rows, Got(peers=[PeerTiming(0, "n0", "local", 0.0, 0)])

    node.collectives_since = collectives_since  # type: ignore[attr-defined]
    w = Window()
    table, _ = w.fetch(node, 100 * s)
    assert cursors == [(int(100 * s - dt.WINDOW_S * s),) * 2] and table.num_rows == 1
    w.fetch(node, 105 * s)
    assert cursors[1] == (int(105 * s - dt.WINDOW_S * s), int(100 * s - dt.LAG_S * s))
    assert not node.asked  # no SQL
    node.collectives_since = lambda *a, **k: None  # type: ignore[attr-defined]
    node.answers.append((rows, Got()))
    w.fetch(node, 106 * s)
    assert len(node.asked) == 1 and "comm.collectives" in node.asked[0]


def test_a_samplers_wait_for_a_cpu_is_kept_as_far_back_as_its_reads_reach() -> None:
    """The detector's RUNQ_SQL sums without SQL (``Sampler.waits_since``):
    from the reads kept (``WAITS_S``), the table's sums from a wall time on;
    None before the sampler started where its table held an earlier trace's
    rows, and before the oldest read it let go."""
    from probing.node.bpf import sampler as smp
    from probing.node.store import Store

    s = smp.Sampler(Store())  # not started: its reads read nothing
    assert s.waits_since(0) is None
    s._waits_from = 0  # started on a table of none but its own rows
    sec = 10**9
    for k in range(5):
        s._kept_waits(T0 + k * sec, 5 + 1, sec)  # two runq rows: 5 and 1 ns
    assert s.waits_since(0) == (30, 5 * sec)
    assert s.waits_since(T0 + 2 * sec) == (18, 3 * sec)  # reads at or after it
    later = T0 + int((smp.WAITS_S + 3.5) * sec)  # the first four are let go
    s._kept_waits(later, 0, sec)
    assert s.waits_since(T0 + 3 * sec) is None
    assert s.waits_since(T0 + 4 * sec) == (6, 2 * sec)
    s._waits_from = later  # its table held an earlier trace's rows: none of those
    assert s.waits_since(later - 1) is None and s.waits_since(later) == (0, sec)
