"""The agent's side of findings and metrics, on canned files and texts: the
findings logs followed (``probing.node.findings``), the node's exposition
(``probing.node.openmetrics``), and the agent that puts them together:
findings by the rank they blame in /metrics, and to the webhook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.openmetrics.parser import text_string_to_metric_families

from probing.analyze.findings import openmetrics
from probing.node.agent import Agent, Policy
from probing.node.findings import Feed
from probing.node.openmetrics import Exposition
from probing.node.webhook import Webhook
from tests.conftest import require
from tests.test_webhook import Receiver, _until


def _finding(kind: str = "straggler", rank: int | None = 2, ts: int = 1, **kw: object) -> dict:  # type: ignore[type-arg]
    row = {"ts": ts, "kind": kind, "rank": rank, "node": "n1", "comm": "gloo/pg0",
           "text": f"{kind} {rank}", "since": None, "since_ns": None, "cleared_ns": None,
           "pid": os.getpid(), "host": "n1"}  # fmt: skip
    row.update(kw)
    return row


def _log(runtime_dir: Path, uid: int | None = None) -> Path:
    uid = os.getuid() if uid is None else uid
    d = runtime_dir / f"probing-{uid}"
    d.mkdir(mode=0o700, exist_ok=True)
    os.chown(d, uid, -1)
    return d / "findings.jsonl"


def _append(path: Path, *rows: dict, raw: str = "") -> None:  # type: ignore[type-arg]
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + raw)


def _keys(rows: list[dict]) -> list[tuple]:  # type: ignore[type-arg]
    return [(r["kind"], r["rank"], r["state"]) for r in rows]


def test_the_feed_takes_what_was_active_at_its_start_and_follows_what_comes(
    runtime_dir: Path,
) -> None:
    log = _log(runtime_dir)
    a, b = _finding(rank=1, ts=1), _finding(rank=3, ts=2)
    _append(log, a, b, {**b, "cleared_ns": 5})
    feed = Feed()
    assert feed.poll() == []  # said before it came: no news
    assert [r["rank"] for r in feed.active()] == [1]
    c = _finding("hang", rank=0, ts=6)
    _append(log, c, {**a, "cleared_ns": 7})
    assert _keys(feed.poll()) == [("hang", 0, "new"), ("straggler", 1, "cleared")]
    assert [r["kind"] for r in feed.active()] == ["hang"]
    d = json.dumps(_finding(rank=4, ts=8))
    _append(log, raw=d[:20])  # half a line: the rest later
    assert feed.poll() == []
    _append(log, raw=d[20:] + "\nnot json\n")
    assert _keys(feed.poll()) == [("straggler", 4, "new")]
    log.write_text(json.dumps(_finding(rank=5, ts=9)) + "\n")  # truncated: from its start
    assert _keys(feed.poll()) == [("straggler", 5, "new")]
    rotated = log.with_suffix(".new")  # replaced by a longer file (log rotation)
    _append(rotated, *[_finding(rank=6, ts=10 + i) for i in range(5)])
    rotated.rename(log)
    assert _keys(feed.poll()) == [("straggler", 6, "new")] * 5


def test_a_log_that_comes_later_is_read_from_its_start_and_a_dead_detector_is_forgotten(
    runtime_dir: Path,
) -> None:
    feed = Feed()
    assert feed.poll() == []
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    log = _log(runtime_dir)
    _append(log, _finding(rank=1), _finding(rank=2, ts=2, pid=gone.pid))
    assert _keys(feed.poll()) == [("straggler", 1, "new"), ("straggler", 2, "new")]
    assert [r["rank"] for r in feed.active()] == [1]  # the dead detector's: not active


def test_a_user_cannot_log_findings_about_another_users_process(runtime_dir: Path) -> None:
    require(os.geteuid() == 0, "needs root (a findings log of another user)")
    feed = Feed()
    feed.poll()
    theirs = _log(runtime_dir, uid=65534)
    _append(theirs, _finding(rank=1), _finding(rank=2, pid=999_999_999))
    assert _keys(feed.poll()) == [("straggler", 2, "new")]  # ours (root's) not believed


def test_the_node_exposition_labels_every_probe_and_dates_its_counters() -> None:
    out = Exposition()
    out.counter("probing_agent_attach_failures", "failed", [({}, 2)], 100.0)
    rank0 = openmetrics(0.25, {(0, "n1"): 0.001, (2, "n2"): 0.06}, {"straggler": 1}, {"gloo": 3}, 4)
    rank1 = openmetrics(None, {}, {}, {"gloo": 0}, 0)
    out.merge(rank0, {"pid": "10", "job": "j", "rank": "0", "node": "n1"}, 200.0)
    out.merge(rank1, {"pid": "11", "job": "j", "rank": "1", "node": "n1"}, 300.0)
    text = out.text()
    assert text.count("# TYPE probing_findings gauge") == 1 and text.endswith("# EOF\n")
    families = {f.name: f for f in text_string_to_metric_families(text)}  # as Prometheus reads it
    late = {s.labels["rank"]: s.labels for s in families["probing_rank_lateness_seconds"].samples}
    assert late["2"] == {"rank": "2", "node": "n2", "pid": "10", "job": "j"}  # its own rank, node
    dropped = families["probing_events_dropped"].samples
    assert [(s.name, s.labels["rank"], s.value) for s in dropped] == [
        ("probing_events_dropped_total", "0", 3),
        ("probing_events_dropped_created", "0", 200.0),
        ("probing_events_dropped_total", "1", 0),
        ("probing_events_dropped_created", "1", 300.0),
    ]
    own = families["probing_agent_attach_failures"].samples
    assert [(s.name, s.value) for s in own] == [
        ("probing_agent_attach_failures_total", 2),
        ("probing_agent_attach_failures_created", 100.0),
    ]
    step = families["probing_step_seconds"].samples
    assert [(s.labels["rank"], s.value) for s in step] == [("0", 0.25)]


def test_the_agent_exports_findings_by_the_rank_they_blame_and_posts_them(
    runtime_dir: Path,
) -> None:
    server = Receiver()
    hook = Webhook(server.url)
    try:
        agent = Agent(Policy(attach=False), webhook=hook)
        log = _log(runtime_dir)
        assert agent.follow() == []
        found = _finding(rank=2)
        _append(log, found, _finding("slow_link", rank=None, ts=2, node="n1,n2"))
        assert len(agent.follow()) == 2
        families = {f.name: f for f in text_string_to_metric_families(agent.metrics())}
        active = {(s.labels["kind"], s.labels.get("rank")): s.labels
                  for s in families["probing_finding_active"].samples}  # fmt: skip
        assert set(active) == {("straggler", "2"), ("slow_link", None)}
        assert active[("straggler", "2")]["node"] == "n1"
        assert active[("straggler", "2")]["job"] == agent._job_of(os.getpid())
        _until(lambda: hook.counts().sent == 2)
        assert [(r["kind"], r["state"], r["pid"]) for r in server.got] == [
            ("straggler", "new", os.getpid()),
            ("slow_link", "new", os.getpid()),
        ]
        assert server.got[0]["job"] and server.got[0]["text"] == "straggler 2"
        _append(log, {**found, "cleared_ns": 3})
        agent.follow()
        _until(lambda: hook.counts().sent == 3)
        assert server.got[-1]["state"] == "cleared" and server.got[-1]["cleared_ns"] == 3
        health = agent.health()
        assert health["findings_active"] == 1 and health["webhook"]["sent"] == 3
        sent = families["probing_agent_webhook_sent"].samples
        assert {s.name for s in sent} == {
            "probing_agent_webhook_sent_total",
            "probing_agent_webhook_sent_created",
        }
    finally:
        hook.close(0)
        server.close()
