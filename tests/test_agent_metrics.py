"""The agent's side of findings and metrics, on canned files and texts: the
findings logs followed (``probing.node.findings``), the node's exposition
(``probing.node.openmetrics``), and the agent that puts them together:
findings by the rank they blame in /metrics, and to the webhook."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from probing import proc
from probing.analyze.findings import openmetrics
from probing.guest import wire
from probing.node import agent as agent_module
from probing.node.agent import Agent, Policy
from probing.node.detector.book import log_findings
from probing.node.findings import Feed
from probing.node.openmetrics import Exposition, text_format, wants_openmetrics
from probing.node.webhook import Webhook
from tests.conftest import require
from tests.test_webhook import Receiver, _until


def _finding(kind: str = "straggler", rank: int | None = 2, ts: int = 1, **kw: object) -> dict:  # type: ignore[type-arg]
    row = {"ts": ts, "kind": kind, "rank": rank, "node": "n1", "comm": "gloo/pg0",
           "text": f"{kind} {rank}", "since": None, "since_ns": None, "cleared_ns": None,
           "pid": os.getpid(), "pid_started": proc.started(os.getpid()), "host": "n1"}  # fmt: skip
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
    assert _keys(feed.poll()) == [
        ("straggler", 1, "new"),
        ("straggler", 2, "new"),
        ("straggler", 2, "cleared"),  # the dead detector's: cleared at once
    ]
    assert [r["rank"] for r in feed.active()] == [1]


def test_a_user_cannot_log_findings_about_another_users_process(runtime_dir: Path) -> None:
    require(os.geteuid() == 0, "needs root (a findings log of another user)")
    feed = Feed()
    feed.poll()
    theirs = _log(runtime_dir, uid=65534)
    _append(theirs, _finding(rank=1), _finding(rank=2, pid=999_999_999))
    assert _keys(feed.poll()) == [  # ours (root's) not believed
        ("straggler", 2, "new"),
        ("straggler", 2, "cleared"),  # and theirs about no process: cleared at once
    ]


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


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_a_finding_whose_detector_is_gone_is_cleared_in_its_log_once_and_never_served(
    runtime_dir: Path,
) -> None:
    """Found at the start (an agent started after the job died): a finding of
    a process that exited, one whose pid another process has since
    (``pid_started`` not its), and an older line (no ``pid_started``) about
    a process that started after it: each cleared at the first look, in the
    log ("job gone", the feed's clock), and a later feed serves none of them."""
    log, me = _log(runtime_dir), os.getpid()
    live, older_live = _finding(rank=0), _finding(rank=4, ts=time.time_ns(), pid_started=None)
    dead = _finding(rank=1, ts=2, pid=_dead_pid())
    reused = _finding(rank=2, ts=3, pid_started=(proc.started(me) or 0) - 1)
    older = _finding(rank=3, ts=4, pid_started=None)  # 4 ns after 1970: before this process
    _append(log, live, dead, reused, older, older_live)
    feed = Feed(clock=lambda: 42)
    cleared = feed.poll()
    assert [(r["rank"], r["state"], r["reason"], r["cleared_ns"]) for r in cleared] == [
        (1, "cleared", "job gone", 42),
        (2, "cleared", "job gone", 42),
        (3, "cleared", "job gone", 42),
    ]
    assert [r["rank"] for r in feed.active()] == [0, 4]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(x["rank"], x["pid"], x["cleared_ns"], x.get("reason")) for x in lines[5:]] == [
        (1, dead["pid"], 42, "job gone"),
        (2, me, 42, "job gone"),
        (3, me, 42, "job gone"),
    ]
    assert all("state" not in x for x in lines)
    assert feed.poll() == []  # its own lines read back: no news
    later = Feed(clock=lambda: 43)
    assert later.poll() == [] and [r["rank"] for r in later.active()] == [0, 4]
    assert len(log.read_text().splitlines()) == len(lines)  # cleared once


def test_a_cleared_line_goes_only_into_a_regular_file_of_the_logs_user(
    runtime_dir: Path,
) -> None:
    """The feed appends to a user's log (as root, another user's): never
    through a link put in its place, where the line would land elsewhere."""
    feed = Feed()
    feed.poll()
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        log = _log(runtime_dir)
        _append(log, _finding(rank=1, pid=job.pid, pid_started=proc.started(job.pid)))
        assert _keys(feed.poll()) == [("straggler", 1, "new")]
        target = runtime_dir / "elsewhere"
        target.write_text("")
        log.unlink()
        log.symlink_to(target)
    finally:
        job.kill()
        job.wait()
    assert _keys(feed.poll()) == [("straggler", 1, "cleared")]  # said, and not served
    assert feed.active() == [] and target.read_text() == ""


def test_each_logged_finding_names_its_detectors_process_and_its_start(
    runtime_dir: Path,
) -> None:
    log = _log(runtime_dir)
    log_findings([_finding(rank=1)], os.getpid())
    [line] = [json.loads(x) for x in log.read_text().splitlines()]
    assert line["pid"] == os.getpid() and line["pid_started"] == proc.started(os.getpid())
    assert isinstance(line["pid_started"], int) and line["pid_started"] > 0


def test_a_job_killed_during_a_finding_has_it_cleared_and_a_new_agent_never_serves_it(
    runtime_dir: Path,
) -> None:
    server = Receiver()
    hook = Webhook(server.url)
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        agent = Agent(Policy(attach=False), webhook=hook)
        agent.follow()
        log = _log(runtime_dir)
        found = _finding(rank=1, comm="gloo/pg1", pid=job.pid, pid_started=proc.started(job.pid))
        _append(log, found)
        assert _keys(agent.follow()) == [("straggler", 1, "new")]
        assert _active(agent) == {("straggler", "1")}
        job.kill()
        job.wait()
        assert _active(agent) == set()  # gone at once from /metrics
        [cleared] = agent.follow()
        assert (cleared["state"], cleared["reason"]) == ("cleared", "job gone")
        assert cleared["pid"] == job.pid
        _until(lambda: hook.counts().sent == 2)
        assert [(r["state"], r.get("reason")) for r in server.got] == [
            ("new", None),
            ("cleared", "job gone"),
        ]
        last = json.loads(log.read_text().splitlines()[-1])
        assert last["reason"] == "job gone" and last["cleared_ns"] == cleared["cleared_ns"]
        fresh = Agent(Policy(attach=False))
        assert fresh.follow() == [] and _active(fresh) == set()
        assert fresh.health()["findings_active"] == 0
    finally:
        job.kill()
        job.wait()
        hook.close(0)
        server.close()


def test_a_job_stopped_rank_by_rank_is_gone_and_a_lone_detectors_death_says_the_job_goes_on(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its detector's rank killed first, the rest a moment later (a job's
    ranks end one by one, and a killed rank is a zombie until reaped): the
    finding waits for the rest and is cleared "job gone". With its detector
    alone gone for ``ENDING_S``: "the job goes on"."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29571"}
    sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
    ranks = [subprocess.Popen(sleep, env=env) for _ in range(3)]

    def started(p: subprocess.Popen[bytes]) -> None:  # exec'd with its variables, not forked
        _until(lambda: proc.environ(p.pid).get("MASTER_PORT") == "29571")

    try:
        for r in ranks:
            started(r)
        agent = Agent(Policy(attach=False))
        agent.follow()
        for r in ranks[1:]:
            agent._job_of(r.pid)  # the agent knows the job's other ranks
        log = _log(runtime_dir)
        found = _finding(pid=ranks[0].pid, pid_started=proc.started(ranks[0].pid))
        _append(log, found)
        assert _keys(agent.follow()) == [("straggler", 2, "new")]
        ranks[0].kill()
        ranks[0].wait()
        assert agent.follow() == []  # the rest of its job runs: not said yet
        ranks[1].kill()
        ranks[1].wait()
        ranks[2].kill()  # a zombie, never reaped here: gone all the same
        _until(lambda: not proc.running(ranks[2].pid))
        [cleared] = agent.follow()
        assert (cleared["state"], cleared["reason"]) == ("cleared", "job gone")

        lone = [subprocess.Popen(sleep, env=env) for _ in range(2)]
        ranks += lone
        for r in lone:
            started(r)
        agent._job_of(lone[1].pid)
        _append(log, _finding(pid=lone[0].pid, pid_started=proc.started(lone[0].pid)))
        assert _keys(agent.follow()) == [("straggler", 2, "new")]
        lone[0].kill()
        lone[0].wait()
        assert agent.follow() == []
        monkeypatch.setattr(agent_module, "ENDING_S", 0.0)
        [cleared] = agent.follow()
        assert cleared["reason"] == "its detector's process is gone (the job goes on)"
    finally:
        for r in ranks:
            r.kill()
            r.wait()


def _active(agent: Agent) -> set[tuple[str, str]]:
    """(kind, rank) of each ``probing_finding_active`` series of the agent's /metrics."""
    families = {f.name: f for f in text_string_to_metric_families(agent.metrics())}
    samples = families["probing_finding_active"].samples
    return {(s.labels["kind"], s.labels["rank"]) for s in samples}


# what Prometheus 2.42 asks a target for
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def _detector() -> str:
    """A job detector's OpenMetrics with every family it has: a straggler active."""
    lateness = {(0, "n1"): 0.001, (2, "n2"): 0.06}
    return openmetrics(0.11, lateness, {"straggler": 1}, {"gloo": 3}, 4, {2: ("n2", 0.06, 0.55)})


def _promtool(text: str) -> tuple[int, str]:
    """``promtool check metrics`` on ``text``: its exit status and all it said."""
    promtool = shutil.which("promtool")
    require(promtool is not None, "needs promtool (Debian's prometheus; make jobenvs installs it)")
    assert promtool is not None
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def _samples(families: object) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    return sorted(
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for f in families  # type: ignore[attr-defined]
        for s in f.samples
    )


def test_promtool_passes_the_agents_metrics_as_curl_gets_them(runtime_dir: Path) -> None:
    """The agent's /metrics with findings active and a webhook set: to
    ``curl`` (``Accept: */*``) Prometheus' text format, which ``promtool
    check metrics`` passes saying nothing; to Prometheus OpenMetrics; the
    same samples both ways."""
    from urllib.request import Request, urlopen

    from prometheus_client.parser import text_string_to_metric_families as text_families

    from probing.node.agent import serve

    receiver = Receiver()
    hook = Webhook(receiver.url)
    agent = Agent(Policy(attach=False), webhook=hook)
    agent.follow()
    _append(_log(runtime_dir), _finding(rank=2), _finding("slow_link", rank=None, ts=2))
    assert len(agent.follow()) == 2
    _until(lambda: hook.counts().sent == 2)  # the two answers alike
    http = serve(agent, "127.0.0.1", 0)
    got = {}
    try:
        url = f"http://127.0.0.1:{http.server_address[1]}/metrics"
        for accept in ("*/*", PROMETHEUS_ACCEPT):
            with urlopen(Request(url, headers={"Accept": accept}), timeout=10) as r:
                got[accept] = (r.headers["Content-Type"], r.read().decode())
    finally:
        http.shutdown()
        http.server_close()
        hook.close(0)
        receiver.close()
    (plain_type, plain), (om_type, om) = got["*/*"], got[PROMETHEUS_ACCEPT]
    assert plain_type.startswith("text/plain; version=0.0.4"), plain_type
    assert om_type.startswith("application/openmetrics-text"), om_type
    assert _promtool(plain) == (0, ""), plain
    assert "probing_finding_active{" in plain and "\nprobing_agent_webhook_sent_total " in plain
    assert _samples(text_families(plain)) == _samples(text_string_to_metric_families(om))


def test_promtool_passes_a_detectors_metrics_as_its_probe_serves_them_to_curl() -> None:
    """A probe's GET /metrics: OpenMetrics to Prometheus and to the agent
    (which names no format), the text format, clean for promtool, to curl."""
    from types import SimpleNamespace

    from probing.node.probe import api
    from probing.node.probe.http import Request

    detector = SimpleNamespace(metrics=_detector)
    probe = SimpleNamespace(cluster=SimpleNamespace(ensure_watch=lambda start: detector))

    def get(accept: str | None) -> tuple[str, str]:
        headers = {"accept": accept} if accept is not None else {}
        answer = api.metrics(probe, Request("GET", "/metrics", {}, b"", 0, headers=headers))  # type: ignore[arg-type]
        assert answer.status == 200
        return answer.content_type, answer.body.decode()

    assert get(PROMETHEUS_ACCEPT) == get(None) == (api.openmetrics.OPENMETRICS, _detector())
    ctype, plain = get("*/*")
    assert ctype.startswith("text/plain; version=0.0.4") and plain == text_format(_detector())
    assert _promtool(plain) == (0, ""), plain
    assert _promtool(_detector())[0] != 0  # OpenMetrics is not what promtool 2.42 reads


def test_a_scraper_gets_openmetrics_where_it_asks_or_names_no_format() -> None:
    assert wants_openmetrics(PROMETHEUS_ACCEPT) and wants_openmetrics(None)
    assert wants_openmetrics("Application/OpenMetrics-Text; version=1.0.0")
    assert not wants_openmetrics("*/*")  # curl
    assert not wants_openmetrics("text/plain;version=0.0.4")


def test_a_process_its_engine_traces_already_is_tracing_not_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An agent started again (its container replaced, with the engine in it)
    meets probes whose new engine resumed their trace: they are traced."""
    from probing.inject import injector

    monkeypatch.setattr(injector, "inject", lambda pid: injector.InjectResult(pid, True, "/x"))

    def refuse(*args: object, **kw: object) -> None:
        raise wire.WireError(
            409, "pid 7 is already tracing (gloo); stop it first", "AlreadyTracing"
        )

    monkeypatch.setattr(wire, "request", refuse)
    agent = Agent(Policy())
    assert agent._attach(7, "RANK", "job", 1.0).state == "tracing"
    assert agent.failures == 0

    def other(*args: object, **kw: object) -> None:
        raise wire.WireError(500, "the BPF programs did not load", "BPFUnavailable")

    monkeypatch.setattr(wire, "request", other)
    assert agent._attach(7, "RANK", "job", 1.0).state == "failed: the BPF programs did not load"
    assert agent.failures == 1
