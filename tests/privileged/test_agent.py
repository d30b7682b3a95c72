"""``probing agent``: a 4-rank job started with no PROBING and no inject is
attached, traced and watched by the node's agent by itself; its slowed
rank becomes a finding and shows in the agent's /metrics; a process with
PROBING=0, or with no launcher's variables, is never touched."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

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


def test_the_agent_attaches_to_a_job_nobody_probed(runtime_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    require_bpf()
    mark = {"PROBING_AGENT_TEST": uuid.uuid4().hex}  # this test's processes only
    base = {k: v for k, v in os.environ.items() if k != "PROBING"}
    base.update(PROBING_RUNTIME_DIR=str(runtime_dir), PROBING_TOKEN=TOKEN, **mark)
    port = free_port()
    procs = []
    try:
        agent = subprocess.Popen(
            [sys.executable, "-m", "probing", "agent", "--every", "0.5", "--port", "0",
             "--env", f"PROBING_AGENT_TEST={mark['PROBING_AGENT_TEST']}"],
            env=base, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        procs.append(agent)
        line = agent.stderr.readline() if agent.stderr else ""
        found = re.search(r"on 127\.0\.0\.1:(\d+)", line)
        assert found, line
        url = f"http://127.0.0.1:{found.group(1)}"
        ranks = []
        for r in range(WORLD):
            env = dict(base, RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
            ranks.append(subprocess.Popen([sys.executable, "-c", JOB], env=env))
        opted_out = subprocess.Popen(
            [sys.executable, "-c", IDLE_LOOP],
            env=dict(base, PROBING="0", RANK="0", MASTER_PORT="1"),
        )
        plain = subprocess.Popen([sys.executable, "-c", IDLE_LOOP], env=base)
        procs += [*ranks, opted_out, plain]
        t0 = time.monotonic()
        deadline = t0 + 60 * SLOWDOWN
        while not all(_probed(p.pid) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_probed(p.pid) for p in ranks), [p.pid for p in ranks if not _probed(p.pid)]
        print(f"every rank traced {time.monotonic() - t0:.1f} s after the job started")
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
            if f'probing_findings{{kind="straggler",pid="{ranks[0].pid}"' in text and re.search(
                rf'probing_findings{{kind="straggler",pid="{ranks[0].pid}",[^}}]*}} 1', text
            ):
                break
            time.sleep(1)
        assert "probing_agent_attached 4" in text, text
        assert re.search(rf'probing_rank_lateness_seconds{{rank="{SLOW}",[^}}]*pid=', text), text
        got = ProbeClient.for_pid(ranks[0].pid).query_rows(
            "SELECT kind, rank, text FROM analyze.findings WHERE cleared_ns IS NULL"
        )
        kinds = [(row[0], row[1]) for row in got[1]]
        assert ("straggler", SLOW) in kinds, got
        # never touched: PROBING=0, and a process no launcher started
        for p in (opted_out, plain):
            with pytest.raises(ProbingError):
                ProbeClient.for_pid(p.pid).health()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
