"""``probing agent`` watches a job whatever started it: a ``mp.spawn`` job
and a Lightning job with its own launcher (``strategy="ddp"`` started as
``python train.py``: rank 0 the user's process, ranks 1-3 re-executed with
no ``RANK``), each started with nothing for probing (the frameworks
environment of ``.ci/jobenvs.sh``, ``tests/jobs/frameworks/``) and one rank
60 ms slower a step. Every rank is attached within 10 s of its process
group forming, as a process that formed one; all of them carry one job
label, their store's rendezvous; the slowed rank is a finding in the
agent's ``/metrics`` within 60 s of the job's start. Never attached: the
``mp.spawn`` parent, which only waits, and a process that imported torch
and formed no group."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from probing.cli.client import ProbeClient
from probing.errors import ProbingError
from tests.conftest import SLOWDOWN, require, require_bpf
from tests.jobs.framework import ENV, WORLD, Job, start
from tests.privileged.test_agent import active_findings

pytestmark = pytest.mark.privileged
ATTACH_S = 10.0  # from the group's forming to every rank traced
FINDING_S = 60.0  # from the job's start to its slowed rank a finding
GROUP = "torch process group (thread "
LABEL = re.compile(r"rendezvous=127\.0\.0\.1:(\d+)")


@contextlib.contextmanager
def agent(runtime_dir: Path, mark: str, log: Path) -> Iterator[str]:
    """``probing agent`` looking at this test's processes only (those whose
    environment has ``mark``) every 2 s, as deployed (``PROBING_AGENT_EVERY_S``'s
    default); the URL of its /health and /metrics."""
    env = {k: v for k, v in os.environ.items() if k != "PROBING"}
    env["PROBING_RUNTIME_DIR"] = str(runtime_dir)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "probing", "agent", "--every", "2", "--port", "0",
             "--env", f"JOB_MARK={mark}"],
            env=env, stderr=out,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30 * SLOWDOWN
        while not (found := re.search(r"on 127\.0\.0\.1:(\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield f"http://127.0.0.1:{found.group(1)}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read().decode()
    return json.loads(body) if url.endswith("/health") else body


def wait_formed(job: Job) -> tuple[dict[int, int], float]:
    """The ranks (rank -> pid) once every one says its group is up, and when
    that was (monotonic)."""
    ranks = job.wait_ready()
    return ranks, time.monotonic()


def wait_attached(url: str, pids: set[int], since: float) -> dict[int, dict[str, Any]]:
    """Until the agent traces every one of ``pids`` (its /health): what it
    says of each; each within ``ATTACH_S`` of ``since``."""
    deadline = since + ATTACH_S * SLOWDOWN
    while True:
        seen = {p["pid"]: p for p in get(f"{url}/health")["processes"]}
        traced = {pid for pid in pids if seen.get(pid, {}).get("state") == "tracing"}
        if traced == pids:
            took = sorted(seen[pid]["attached_s"] for pid in pids)
            print(f"every rank traced {time.monotonic() - since:.1f} s after its group formed "
                  f"(seen to traced: {took} s)")  # fmt: skip
            return seen
        assert time.monotonic() < deadline, (sorted(pids - traced), seen)
        time.sleep(0.2)


def wait_finding(url: str, slow: int, started: float) -> str:
    """The agent's /metrics once the slowed rank is an active straggler
    finding, within ``FINDING_S`` of the job's start."""
    deadline = started + FINDING_S * SLOWDOWN
    while True:
        text = str(get(f"{url}/metrics"))
        if ("straggler", str(slow)) in active_findings(text):
            print(f"rank {slow} a finding {time.monotonic() - started:.1f} s after the job started")
            return text
        assert time.monotonic() < deadline, text
        time.sleep(0.5)


def job_labels(text: str, ranks: dict[int, int], slow: int) -> tuple[str, dict[str, str]]:
    """The job label of the slowed rank's finding, and each rank's probe's
    (its ``probing_detections_total``: rank label -> job label)."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    [finding] = [
        s.labels["job"]
        for s in families["probing_finding_active"].samples
        if s.labels["kind"] == "straggler" and s.labels.get("rank") == str(slow)
    ]
    probes = {
        s.labels["pid"]: s.labels
        for s in families["probing_detections"].samples
        if s.name.endswith("_total")
    }
    assert sorted(probes) == sorted(str(p) for p in ranks.values()), probes
    return finding, {probes[str(pid)].get("rank", "?"): probes[str(pid)]["job"]
                     for pid in ranks.values()}  # fmt: skip


def store_port(pid: int) -> int:
    """The port the rank's store listens on (rank 0 serves it here)."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    ports = {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}
    return next(p for p in sorted(ports) if any(c.raddr and c.raddr.port == p for c in conns))


@dataclasses.dataclass
class Watched:
    """A framework job under this test's agent."""

    job: Job
    url: str  # the agent's /health and /metrics
    slow: int  # the rank slowed
    mark: str  # JOB_MARK: what the agent attaches to (this test's processes only)
    started: float  # the job's start (monotonic)


def watched(name: str, runtime_dir: Path, tmp_path: Path) -> Iterator[Watched]:
    """The agent, then the framework job ``name`` with nothing for probing
    (but the mark that keeps this test's agent to this test's processes)."""
    require_bpf()
    py = ENV / "bin" / "python"
    require(py.exists(), f"job env {ENV.name} missing: run .ci/jobenvs.sh (make setup)")
    mark = uuid.uuid4().hex
    slow = random.Random(f"{name}{time.time_ns()}").randrange(WORLD)
    print(f"{name}: rank {slow} slowed")
    log = tmp_path / "agent.log"
    with agent(runtime_dir, mark, log) as url:
        started = time.monotonic()
        job = start(name, str(py), tmp_path, False, slow, JOB_MARK=mark)
        try:
            yield Watched(job, url, slow, mark, started)
        except BaseException:
            print(log.read_text()[-4000:])
            raise
        finally:
            job.stop()


def check_job(w: Watched) -> dict[int, int]:
    """Every rank attached in time as a group, the slowed one a finding in
    time, one job label for them all (their store's), each rank's own."""
    ranks, formed = wait_formed(w.job)
    seen = wait_attached(w.url, set(ranks.values()), formed)
    for pid in ranks.values():
        assert seen[pid]["why"].startswith(GROUP), seen[pid]
        assert ProbeClient.for_pid(pid).trace_status()["state"] == "tracing"
    text = wait_finding(w.url, w.slow, w.started)
    assert f"probing_agent_attached {WORLD}" in text, text
    finding, jobs = job_labels(text, ranks, w.slow)
    assert jobs == {str(r): finding for r in range(WORLD)}, jobs
    port = LABEL.fullmatch(finding)
    assert port and int(port.group(1)) == store_port(ranks[0]), (finding, ranks)
    health = get(f"{w.url}/health")
    assert {p["pid"]: p["job"] for p in health["processes"]} == dict.fromkeys(
        ranks.values(), finding
    ), health
    return ranks


@pytest.fixture
def mp_spawn(runtime_dir: Path, tmp_path: Path) -> Iterator[Watched]:
    yield from watched("mp_spawn", runtime_dir, tmp_path)


@pytest.fixture
def lightning(runtime_dir: Path, tmp_path: Path) -> Iterator[Watched]:
    yield from watched("lightning_ddp", runtime_dir, tmp_path)


# a process of the job's environment that imported torch and torch.distributed
# and formed no group
BYSTANDER = "import sys, torch, torch.distributed; print('up', flush=True); sys.stdin.read()"


def test_an_mp_spawn_job_is_watched_but_not_its_parent_nor_a_torch_without_a_group(
    mp_spawn: Watched,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PROBING"}
    bystander = subprocess.Popen(
        [str(ENV / "bin" / "python"), "-c", BYSTANDER], env=dict(env, JOB_MARK=mp_spawn.mark),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert bystander.stdout is not None and bystander.stdout.readline() == "up\n"
        ranks = check_job(mp_spawn)
        attached = {p["pid"] for p in get(f"{mp_spawn.url}/health")["processes"]}
        assert attached == set(ranks.values())  # not the parent, nor its resource tracker
        for pid in (mp_spawn.job.proc.pid, bystander.pid):
            with pytest.raises(ProbingError):
                ProbeClient.for_pid(pid).health()
    finally:
        bystander.kill()
        bystander.wait(timeout=10)


def test_a_lightning_job_with_its_own_launcher_is_watched(lightning: Watched) -> None:
    ranks = check_job(lightning)
    assert ranks[0] == lightning.job.proc.pid  # rank 0: the user's process, watched
