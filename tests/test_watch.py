"""The always-on detector (``probing.analyze.watch``) on canned cluster
answers: a straggler becomes one finding, written once and cleared when it
is gone; a rank that stops answering is gone after two detections; only
the lowest rank that answers detects; ``/metrics`` parses as OpenMetrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from probing.analyze.watch import Watch
from probing.node.cluster.wire import MissingPeer, PeerTiming
from tests.test_analyze import job


@dataclass
class Got:
    peers: list[PeerTiming] = field(default_factory=list)
    missing: list[MissingPeer] = field(default_factory=list)


class Node:
    """What the detector uses of a ClusterNode: the answers are scripted."""

    def __init__(self, rank: int = 0) -> None:
        self.rank, self.pid, self.learning = rank, None, False
        self.answers: list[tuple[pa.Table, Got]] = []
        self.dead: list[dict[str, Any]] = [{"pid": 1, "alive": True, "died_ns": None, "rank": 0}]
        self.runq: list[dict[str, Any]] = []  # python.samples' runq and tick sums per rank
        self.asked: list[str] = []
        self.lower: dict[int, dict[str, Any]] = {}  # what the ranks below answer (alive?)
        self.asked_ranks: list[int] = []
        self.groups: list[dict[str, Any]] = []  # comm.groups rows
        # trace.intervals: every rank tracing since long ago, unless a test says
        self.intervals = [{"start_ns": 0, "stop_ns": None, "state": "tracing", "rank": r}
                          for r in range(4)]  # fmt: skip

    def fan_out(self, path: str, body: bytes, timeout: float, ranks: set[int]) -> list[dict]:  # type: ignore[type-arg]
        assert path == "/query" and b"process.info" in body
        self.asked_ranks += sorted(ranks)
        return [dict(self.lower[r], rank=r) for r in sorted(ranks)]

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
        if "FROM python.samples" in sql:
            return pa.Table.from_pylist(self.runq), Got(), None
        table, got = self.answers.pop(0)
        return table, got, None


def _now(table: pa.Table) -> int:
    return max(table.column("ts").to_pylist()) + 10**9


def _answered(n: int = 4) -> Got:
    return Got(peers=[PeerTiming(r, f"host{r // 2}", "", 1.0, 0) for r in range(n)])


def test_a_straggler_is_one_finding_until_it_is_gone() -> None:
    node = Node()
    w = Watch(node, tracing=lambda: True, dropped=lambda: {"gloo": 3}, every_s=5)
    slow = job(straggler=2, lag_ms=60, seed=1)
    healthy = job(seed=1)
    node.answers = [(slow, _answered()), (slow, _answered()), (healthy, _answered())]
    [new] = w.once(now_ns=_now(slow))
    assert new["kind"] == "straggler" and new["rank"] == 2 and new["node"] == "host1", new
    assert new["text"].startswith("rank 2 on node host1 arrives ") and new["since_ns"] > 0
    assert "FROM comm.collectives WHERE ts >= " in node.asked[0]
    assert w.once(now_ns=_now(slow)) == []  # still there: not written again
    assert w.once(now_ns=_now(healthy)) == []
    rows = w.table().to_pylist()
    assert [(r["kind"], r["rank"]) for r in rows] == [("straggler", 2)]
    assert rows[0]["cleared_ns"] == _now(healthy)  # gone: cleared, kept


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
    node.answers = [(healthy, lost), (healthy, lost), (healthy, _answered())]
    assert w.once(now_ns=_now(healthy)) == []  # once: a slow answer, maybe
    [gone] = w.once(now_ns=_now(healthy))
    assert gone["kind"] == "rank_gone" and gone["rank"] == 3
    assert gone["text"] == "rank 3 (host1) does not answer: refused"
    w.once(now_ns=_now(healthy))
    assert w.table().to_pylist()[0]["cleared_ns"] is not None


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
    assert Watch(Node(0), lambda: True, dict).detector()
    assert node.asked_ranks == [0, 0, 1, 0, 1]  # the first that lives ends the look


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
    # before any detection: the same families, nothing measured yet
    idle = {
        f.name for f in text_string_to_metric_families(Watch(node, lambda: True, dict).metrics())
    }
    assert {"probing_findings", "probing_events_dropped", "probing_detections"} <= idle


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


def test_a_slow_link_is_a_finding_only_when_found_twice_running() -> None:
    """A link slow at one detection only is a burst; slow at two in a row it is
    named."""
    node = Node()
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
    slow = job(link_ms=40.0, seed=5)
    assert analyze_links(slow), "the canned job has a slow link"
    node.answers = [(slow, _answered()), (job(seed=5), _answered()), (slow, _answered()),
                    (slow, _answered())]  # fmt: skip
    assert w.once(now_ns=_now(slow)) == []
    w.once(now_ns=_now(slow))  # healthy between: the count starts again
    assert w.once(now_ns=_now(slow)) == []
    [new] = w.once(now_ns=_now(slow))
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
    slow, healthy = job(straggler=2, lag_ms=60, seed=1), job(seed=1)
    comms = {(r["rank"], r["comm"]) for r in slow.to_pylist()}
    node = Node()
    node.groups = [{"node": f"host{r // 2}", "rank": r, "backend": "gloo", "comm": c, "pg": "0",
                    "ranks": [0, 1, 2, 3]} for r, c in comms]  # fmt: skip
    node.answers = [(slow, _answered()), (healthy, _answered())]
    w = Watch(node, tracing=lambda: True, dropped=dict, every_s=5)
    [new] = w.once(now_ns=_now(slow))
    assert "gloo/pg0" in new["text"], new["text"]
    assert w.once(now_ns=_now(healthy)) == []
    from probing import paths

    lines = [json.loads(line) for line in open(paths.findings_log())]
    assert [(x["kind"], x["rank"], x["cleared_ns"] is None) for x in lines] == [
        ("straggler", 2, True),
        ("straggler", 2, False),
    ], lines
    assert lines[0]["text"] == new["text"] and lines[1]["cleared_ns"] == _now(healthy)
