"""The fleet on first contact (issue 51), with real jobs, BPF and the agent:

- two plain torchrun jobs at once under ``probing agent`` (torchrun's
  default run id ``none`` in both) are two jobs in its ``/health`` and
  ``/metrics``;
- a job run with ``> log 2>&1`` whose slowed rank becomes a finding keeps
  its log byte for byte what it wrote: the finding goes to the engine's log
  and ``findings.jsonl``, never into the job's file;
- the first trace on a node whose compile cache is empty, under CPU load,
  says it waits for the BPF compile and answers, where a probe's answer
  timeout (2 s here) would have given up.

The port items (the agent's port held, a second engine) are in
tests/test_fleet_ports.py: they need no BPF.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from probing.cli.demo import free_port
from tests.conftest import SLOWDOWN, cli, require_bpf
from tests.jobs.framework import kill_trees
from tests.test_cluster import TOKEN

pytestmark = pytest.mark.privileged

# a gloo job that keeps the record of what it writes: each line it writes to its
# stdout (the job's log, shared by every rank as `> log 2>&1` shares it) goes to
# a file of the rank's own too; rank SLOW waits SLOW_S more a step (a straggler)
JOB = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
t = torch.ones(256)
mine = open(f"{sys.argv[1]}.{r}", "ab", buffering=0)
slow = r == int(sys.argv[2])
i = 0
while True:
    time.sleep(0.02 + (float(sys.argv[3]) if slow else 0))
    t.fill_(1)
    dist.all_reduce(t)
    line = f"rank {r} step {i} sum {t[0].item():.0f}\\n".encode()
    os.write(1, line)
    mine.write(line)
    i += 1
"""
SLOW, SLOW_S = 2, 0.3  # far beyond this machine's noise: the log is under test
# a probe's answer timeout for the first trace: a compile on busy cores takes longer
ANSWER_S = 2


def _base(runtime_dir: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PROBING"}
    env.update(PROBING_RUNTIME_DIR=str(runtime_dir), **more)
    return env


def _until(what, timeout: float, every: float = 0.5):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout * SLOWDOWN
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10 * SLOWDOWN) as r:
        return str(r.read().decode())


@contextlib.contextmanager
def _agent(env: dict[str, str], mark: str) -> Iterator[str]:
    """``probing agent`` for this test's processes only; its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "probing", "agent", "--every", "0.5", "--port", "0",
         "--families", "gloo", "--env", f"PROBING_AGENT_TEST={mark}"],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stderr.readline() if proc.stderr else ""
        found = re.search(r"on 127\.0\.0\.1:(\d+)", line)
        assert found, line
        yield f"http://127.0.0.1:{found.group(1)}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30 * SLOWDOWN)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_two_torchrun_jobs_at_once_are_two_jobs(runtime_dir: Path, tmp_path: Path) -> None:
    """Before: both were ``job="torchelastic_run_id=none"``."""
    require_bpf()
    mark = uuid.uuid4().hex
    env = _base(runtime_dir, PROBING_AGENT_TEST=mark)
    script = tmp_path / "job.py"
    script.write_text(JOB)
    launchers: list[subprocess.Popen[bytes]] = []
    with _agent(env, mark) as url:
        try:
            ports = [free_port(), free_port()]
            for n, port in enumerate(ports):
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       "--master-port", str(port), str(script), str(tmp_path / f"rec{n}"),
                       "-1", "0"]  # fmt: skip
                launchers.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                                  start_new_session=True))  # fmt: skip

            def traced() -> dict[str, list[int]]:
                health = json.loads(_get(f"{url}/health"))
                jobs: dict[str, list[int]] = {}
                for p in health["processes"]:
                    if p["state"] == "tracing":
                        jobs.setdefault(p["job"], []).append(p["pid"])
                return jobs if sum(map(len, jobs.values())) == 4 else {}

            jobs = _until(traced, 240)
            assert jobs, _get(f"{url}/health")
            assert sorted(jobs) == sorted(f"rendezvous=127.0.0.1:{p}" for p in ports), jobs
            assert all(len(pids) == 2 for pids in jobs.values()), jobs

            def labelled() -> set[str]:
                families = text_string_to_metric_families(_get(f"{url}/metrics"))
                return {s.labels["job"] for f in families if f.name == "probing_detections"
                        for s in f.samples if s.name.endswith("_total")}  # fmt: skip

            assert _until(lambda: labelled() == set(jobs), 60), labelled()
        finally:
            kill_trees(launchers)


def test_a_finding_leaves_a_jobs_log_as_it_wrote_it(runtime_dir: Path, tmp_path: Path) -> None:
    """``> log 2>&1``: every rank's stdout and stderr are one file opened once,
    without O_APPEND. Before, the engine opened it again (/proc/PID/fd/2) and
    its lines ("probing: cluster: joined ...", "probing: finding: ...") were
    overwritten by the job's, and garbled them."""
    require_bpf()
    script, log, rec = tmp_path / "job.py", tmp_path / "train.log", tmp_path / "rec"
    script.write_text(JOB)
    port = free_port()
    ranks: list[subprocess.Popen[bytes]] = []
    try:
        with open(log, "wb") as out:  # the shell's `> train.log 2>&1`
            for r in range(4):
                env = _base(runtime_dir, PROBING="1", PROBING_TOKEN=TOKEN, RANK=str(r),
                            WORLD_SIZE="4", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port))  # fmt: skip
                cmd = [sys.executable, str(script), str(rec), str(SLOW), str(SLOW_S)]
                ranks.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        user_dir = runtime_dir / f"probing-{os.getuid()}"
        assert _until(lambda: (user_dir / f"{ranks[0].pid}.sock").exists(), 60), log.read_text()
        _until(lambda: all(Path(f"{rec}.{r}").exists() for r in range(4)), 120)
        r = cli("trace", "--pid", str(ranks[0].pid), "--cluster", "--background", "--no-cuda",
                "--no-nccl", timeout=600)  # fmt: skip
        assert r.returncode == 0, (r.stdout, r.stderr)

        def straggler() -> bool:
            try:
                lines = (user_dir / "findings.jsonl").read_text().splitlines()
            except OSError:
                return False
            return any(json.loads(x)["kind"] == "straggler" for x in lines if x.strip())

        assert _until(straggler, 120), log.read_text()[-2000:]
        engine_log = "".join(p.read_text() for p in user_dir.glob("engine-*.log"))
        ours = re.search(r"^probing engine \d+: \d\d:\d\d:\d\d finding: ", engine_log, re.M)
        assert ours, engine_log[-2000:]  # our own log has it
    finally:
        for p in ranks:
            p.kill()
        for p in ranks:
            p.wait()
    written = log.read_bytes()
    own = {r: Path(f"{rec}.{r}").read_bytes() for r in range(4)}
    assert len(written) == sum(map(len, own.values())), written[-2000:]  # nothing of ours
    for r, mine in own.items():  # each rank's lines, in its order, whole
        theirs = b"".join(x for x in written.splitlines(keepends=True)
                          if x.startswith(f"rank {r} ".encode()))  # fmt: skip
        assert theirs == mine, (r, theirs[-300:], mine[-300:])
    assert b"probing" not in written


def test_the_first_trace_on_a_cold_node_waits_for_the_compile(
    spawn, runtime_dir: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """An empty compile cache, every core busy twice over, and a probe's
    answer timeout of ``ANSWER_S``: ``probing trace`` says it waits for the
    compile, and answers. Before: "the probe of pid N did not answer in 2 s"
    (exit status 1) while tracing did start."""
    require_bpf()
    cache = tmp_path / "bpf-cache"  # this node's compile cache, cleared
    env = {"PROBING_BPF_CACHE": str(cache)}
    target = spawn("import time\nwhile True: time.sleep(0.05)\n", env=env)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(2 * (os.cpu_count() or 2))]  # fmt: skip
    try:
        t0 = time.monotonic()
        r = cli("trace", "--pid", str(target.pid), "--background", "--no-cuda", "--no-nccl",
                env={**env, "PROBING_ANSWER_TIMEOUT_S": str(ANSWER_S)}, timeout=900)  # fmt: skip
        took = time.monotonic() - t0
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    print(f"the first trace answered in {took:.1f} s: {r.stderr.strip()}")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "tracing in the background" in r.stdout
    assert "did not answer" not in r.stderr
    waited = "probing: waiting for the BPF programs to compile (first trace on this node) ..."
    if took > ANSWER_S * SLOWDOWN:  # longer than the answer timeout: it said why it waited
        assert waited in r.stderr.splitlines(), r.stderr
    assert list(cache.glob("gloo-*.json")) and list(cache.glob("sampler-*.json"))
    status = cli("trace", "--pid", str(target.pid), "--stop", timeout=300)
    assert status.returncode == 0, status.stderr
