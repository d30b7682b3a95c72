"""``probing agent``: a 4-rank job started with no PROBING and no inject is
attached, traced and watched by the node's agent by itself; its slowed
rank becomes a finding and shows in the agent's /metrics, where every
rank's probe is labelled with its job, rank and node; a process with
PROBING=0, or with no launcher's variables, is never touched.
``watched_job`` is the job and agent tests/privileged/test_prometheus.py
scrapes too."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from probing.cli.client import ProbeClient
from probing.cli.demo import free_port
from probing.errors import ProbingError
from tests.conftest import IDLE_LOOP, SLOWDOWN, require_bpf
from tests.test_cluster import TOKEN

pytestmark = pytest.mark.privileged
WORLD, SLOW = 4, 2

JOB = """
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(256)
slow = int(os.environ["RANK"]) == {slow}
while True:
    time.sleep(0.02 + (0.06 if slow else 0))
    dist.all_reduce(t)
""".replace("{slow}", str(SLOW))


def _probed(pid: int) -> bool:
    try:
        return ProbeClient.for_pid(pid).trace_status()["state"] == "tracing"
    except ProbingError:
        return False


@dataclasses.dataclass
class Watched:
    """A running ``probing agent`` and the 4-rank job it watches."""

    url: str  # the agent's GET /health and /metrics
    ranks: list[subprocess.Popen[str]]
    job: str  # the job's label in the agent's /metrics
    base: dict[str, str]  # the environment the job's processes got
    procs: list[subprocess.Popen[str]]  # stopped at the end (a test may add its own)


@contextlib.contextmanager
def watched_job(
    runtime_dir: Path, *, wrap: tuple[str, ...] = (), **agent_env: str
) -> Iterator[Watched]:
    """``probing agent`` (``agent_env`` added to its environment; run by the
    command ``wrap`` where given), then a 4-rank Gloo job with no PROBING,
    rank ``SLOW`` 60 ms slower a step; every process stopped at the end. The
    agent attaches to this test's processes only."""
    mark = {"PROBING_AGENT_TEST": uuid.uuid4().hex}  # this test's processes only
    base = {k: v for k, v in os.environ.items() if k != "PROBING"}
    base.update(PROBING_RUNTIME_DIR=str(runtime_dir), PROBING_TOKEN=TOKEN, **mark)
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    try:
        agent = subprocess.Popen(
            [*wrap, sys.executable, "-m", "probing", "agent", "--every", "0.5", "--port", "0",
             "--env", f"PROBING_AGENT_TEST={mark['PROBING_AGENT_TEST']}"],
            env={**base, **agent_env}, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        procs.append(agent)
        line = agent.stderr.readline() if agent.stderr else ""
        found = re.search(r"on 127\.0\.0\.1:(\d+)", line)
        assert found, line
        ranks = []
        for r in range(WORLD):
            env = dict(base, RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
            ranks.append(subprocess.Popen([sys.executable, "-c", JOB], env=env, text=True))
        procs += ranks
        yield Watched(f"http://127.0.0.1:{found.group(1)}", ranks, f"rendezvous=127.0.0.1:{port}",
                      base, procs)  # fmt: skip
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def wait_traced(ranks: list[subprocess.Popen[str]]) -> float:
    """Until every rank traces; the seconds it took."""
    t0 = time.monotonic()
    deadline = t0 + 60 * SLOWDOWN
    while not all(_probed(p.pid) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_probed(p.pid) for p in ranks), [p.pid for p in ranks if not _probed(p.pid)]
    return time.monotonic() - t0


def active_findings(text: str) -> set[tuple[str, str]]:
    """(kind, rank) of each ``probing_finding_active`` series of an exposition."""
    return {
        (s.labels["kind"], s.labels.get("rank", ""))
        for f in text_string_to_metric_families(text)
        if f.name == "probing_finding_active"
        for s in f.samples
        if s.value > 0
    }


def one_verdict(detector: int, asked: int, metrics: str) -> None:
    """What the job's detector found (its findings, asked over the cluster
    through rank ``asked``; /metrics) is what ``diagnose`` says (MCP's): one
    straggler finding, by torch's name for its group, and no rank gone (the
    ranks not discovered yet while the probes joined are not gone); over the
    cluster ``rank`` is the rank it blames; the same step; MCP's verdict names
    the rank and has nothing the findings say that it does not."""
    from probing.cli.mcp import tools

    every = ProbeClient.for_pid(detector).query_rows(
        "SELECT kind, rank, comm, text, node FROM analyze.findings"
    )[1]
    stragglers = [(r, c) for k, r, c, *_ in every if k == "straggler"]
    assert stragglers == [(SLOW, "gloo/pg0")], every
    # (a rank too slow to answer twice on a loaded machine is gone; one never discovered not)
    assert not [f for f in every if f[0] == "rank_gone" and f[4] == "?"], every
    found, _ = tools.findings(asked, 50, 1 << 16, 10.0 * SLOWDOWN)
    blamed = [(r["rank"], r["probe_rank"]) for r in found.rows if r["kind"] == "straggler"]
    assert blamed == [(SLOW, 0)], found.rows
    verdict, _ = tools.diagnose(asked, 30.0, 10.0, None, 10.0 * SLOWDOWN)
    assert [s["rank"] for s in verdict.diagnosis["stragglers"]] == [SLOW], verdict.verdict
    assert verdict.unconfirmed is None and [f["rank"] for f in verdict.findings] == [SLOW]
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    [step] = [s.value for s in families["probing_step_seconds"].samples]
    want = verdict.diagnosis["summary"]["step_ms"] / 1e3
    assert abs(step - want) < 0.2 * want, (step, want)  # two windows of one job: one step
    shares = {s.labels["rank"] for s in families["probing_straggler_step_share"].samples}
    assert shares == {str(SLOW)}, shares


def test_the_agent_attaches_to_a_job_nobody_probed(runtime_dir) -> None:  # type: ignore[no-untyped-def]
    require_bpf()
    with watched_job(runtime_dir) as w:
        url, ranks, base = w.url, w.ranks, w.base
        opted_out = subprocess.Popen(
            [sys.executable, "-c", IDLE_LOOP],
            env=dict(base, PROBING="0", RANK="0", MASTER_PORT="1"),
            text=True,
        )
        plain = subprocess.Popen([sys.executable, "-c", IDLE_LOOP], env=base, text=True)
        w.procs += [opted_out, plain]
        print(f"every rank traced {wait_traced(ranks):.1f} s after the job started")
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            health = json.load(r)
        attached = {a["pid"]: a for a in health["processes"]}
        assert sorted(attached) == sorted(p.pid for p in ranks), health
        assert all(a["why"] == "MASTER_PORT and RANK" for a in attached.values()), health
        print("attach s:", sorted(a["attached_s"] for a in attached.values()))
        # the job is watched: the slowed rank becomes a finding, and a metric
        deadline = time.monotonic() + 60 * SLOWDOWN
        text = ""
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
                text = r.read().decode()
            if ("straggler", str(SLOW)) in active_findings(text):
                break
            time.sleep(1)
        assert ("straggler", str(SLOW)) in active_findings(text), text
        assert "probing_agent_attached 4" in text, text
        assert re.search(rf'probing_rank_lateness_seconds{{rank="{SLOW}",[^}}]*pid=', text), text
        # every rank's probe, labelled with its job, rank and node; counters with _created
        families = {f.name: f for f in text_string_to_metric_families(text)}
        samples = families["probing_detections"].samples
        detections = [s for s in samples if s.name.endswith("_total")]
        assert sorted(s.labels["rank"] for s in detections) == [str(r) for r in range(WORLD)]
        assert {s.labels["job"] for s in detections} == {w.job}
        assert all(s.labels["node"] for s in detections)
        created = [s for s in samples if s.name.endswith("_created")]
        assert len(created) == WORLD and all(s.value > 1e9 for s in created), created
        got = ProbeClient.for_pid(ranks[0].pid).query_rows(
            "SELECT kind, rank, text FROM analyze.findings WHERE cleared_ns IS NULL"
        )
        kinds = [(row[0], row[1]) for row in got[1]]
        assert ("straggler", SLOW) in kinds, got
        one_verdict(ranks[0].pid, ranks[-1].pid, text)
        # its port is read-only
        req = urllib.request.Request(f"{url}/metrics", data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 501
        # never touched: PROBING=0, and a process no launcher started
        for p in (opted_out, plain):
            with pytest.raises(ProbingError):
                ProbeClient.for_pid(p.pid).health()
