"""``probing trace --pid <rank 0> --cluster``: tracing started and stopped on
every rank of a ``PROBING=1`` job from one of them, over the peer port with
the job's token; a rank that cannot is named with the reason, and the
others trace anyway."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from probing.cli.client import ProbeClient
from probing.cli.demo import free_port
from probing.errors import ProbingError
from tests.conftest import SLOWDOWN, cli, require_bpf
from tests.test_cluster import TOKEN, wait_ready

pytestmark = pytest.mark.privileged
WORLD = 4

JOB = """
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(256)
while True:
    time.sleep(0.02)
    dist.all_reduce(t)
"""

# a job whose ranks outlive a peer that dies: a Gloo rank aborts when a peer's
# connection resets under a collective (what a real job does), so these leave
# their loop together, at one all-reduce of a flag, once PAUSE_FILE exists,
# and idle there: a peer killed then ends no collective of theirs
SURVIVING_JOB = """
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(256)
while True:
    time.sleep(0.02)
    dist.all_reduce(t)
    flag = torch.tensor([float(os.path.exists(os.environ["PAUSE_FILE"]))])
    dist.all_reduce(flag)
    if flag.item() > 0:
        break
print("paused", flush=True)
while True:
    time.sleep(1)
"""

PER_RANK = "SELECT rank, count(*) AS n FROM comm.collectives GROUP BY rank ORDER BY rank"


def _job(spawn, code: str = JOB, **extra: str) -> list[int]:  # type: ignore[no-untyped-def]
    port = free_port()
    ranks = [
        spawn(
            code,
            env={
                **extra,
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(WORLD),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PROBING_TOKEN": TOKEN,
            },
        )  # fmt: skip
        for r in range(WORLD)
    ]
    for t in ranks:
        wait_ready(t.pid, 60 * SLOWDOWN)
    return [t.pid for t in ranks]


def _traced_ranks(pid: int) -> dict[int, int]:
    r = cli("query", "--pid", str(pid), "--cluster", "--format", "json", PER_RANK)
    assert r.returncode == 0, r.stderr
    return {row["rank"]: row["n"] for row in json.loads(r.stdout)}


def test_one_command_traces_and_stops_every_rank(spawn) -> None:  # type: ignore[no-untyped-def]
    require_bpf()
    pids = _job(spawn)
    r = cli("trace", "--pid", str(pids[0]), "--cluster", "--background", "--no-nccl",
            "--no-cuda", timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"{WORLD} of {WORLD} ranks tracing\n"), r.stdout
    for pid in pids:  # each rank's own probe traces
        assert ProbeClient.for_pid(pid).trace_status()["state"] == "tracing"
    deadline = time.monotonic() + 30 * SLOWDOWN
    while True:
        counts = _traced_ranks(pids[2])
        if (len(counts) == WORLD and min(counts.values()) > 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(counts) == list(range(WORLD)) and min(counts.values()) > 0, counts
    r = cli("trace", "--pid", str(pids[0]), "--cluster", "--stop", timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"{WORLD} of {WORLD} ranks stopped\n"), (
        r.stdout + r.stderr
    )
    for pid in pids:
        assert ProbeClient.for_pid(pid).trace_status()["state"] != "tracing"


def _idle(pid: int) -> bool:
    """Whether the rank's main thread idles after its loop (SURVIVING_JOB)."""
    frames = ProbeClient.for_pid(pid).query_rows(
        "SELECT func, line FROM process.stacks WHERE thread = 'MainThread'"
    )[1]
    idle = SURVIVING_JOB.splitlines().index("    time.sleep(1)") + 1
    return any(f[0] == "<module>" and f[1] == idle for f in frames)


def test_a_rank_that_cannot_is_named_and_the_others_trace(spawn, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import psutil

    require_bpf()
    pause = tmp_path / "pause"
    pids = _job(spawn, SURVIVING_JOB, PAUSE_FILE=str(pause))
    pause.touch()
    deadline = time.monotonic() + 60 * SLOWDOWN
    while not all(_idle(pid) for pid in pids):  # every rank out of its collectives
        assert time.monotonic() < deadline, "the ranks never paused"
        time.sleep(0.1)
    os.kill(pids[3], signal.SIGKILL)  # gone: its probe is kept, but nothing is left to trace
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(pids[3]).wait(10)
    r = cli("trace", "--pid", str(pids[1]), "--cluster", "--background", "--no-nccl",
            "--no-cuda", timeout=180)  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout.startswith(f"{WORLD - 1} of {WORLD} ranks tracing\n"), r.stdout
    [row] = [line for line in r.stdout.splitlines()[1:] if line.split()[:1] == ["3"]]
    assert " - " in row and len(row.split()) > 4, r.stdout  # no state, a reason
    for pid in pids[:3]:
        assert ProbeClient.for_pid(pid).trace_status()["state"] == "tracing"


def test_over_tcp_a_trace_needs_the_token_and_writes_no_file(spawn, tmp_path) -> None:  # type: ignore[no-untyped-def]
    require_bpf()
    pids = _job(spawn)
    addr = wait_ready(pids[1], 60 * SLOWDOWN)["cluster"]["addr"]
    anyone = ProbeClient.for_addr(addr, token="not-the-token")
    with pytest.raises(ProbingError, match="refused the token"):
        anyone.trace_start(["gloo"])
    peer = ProbeClient.for_addr(addr, token=TOKEN)
    with pytest.raises(ProbingError, match="writes no file"):
        peer.trace_start(["gloo"], output=str(tmp_path / "x.parquet"))
    assert peer.trace_start(["gloo"])["state"] == "tracing"
    assert not (tmp_path / "x.parquet").exists()


def test_diagnose_records_an_untraced_job_and_leaves_it_as_it_was(spawn) -> None:  # type: ignore[no-untyped-def]
    require_bpf()
    pids = _job(spawn)
    assert ProbeClient.for_pid(pids[2]).trace_start(["gloo"])["state"] == "tracing"
    r = cli("diagnose", "--pid", str(pids[0]), "--cluster", "--record", "4s", "--format", "json",
            timeout=180)  # fmt: skip
    assert r.returncode in (0, 2), r.stderr
    assert f"tracing {WORLD} of {WORLD} ranks" in r.stderr and "recording 4 s" in r.stderr, r.stderr
    d = json.loads(r.stdout)
    assert d["summary"]["collectives"] > 0 and sorted(x["rank"] for x in d["ranks"]) == [0, 1, 2, 3]
    states = {i: ProbeClient.for_pid(pid).trace_status()["state"] for i, pid in enumerate(pids)}
    assert states[2] == "tracing" and all(states[i] != "tracing" for i in (0, 1, 3)), states


def test_trace_job_reaches_every_rank_torchrun_started_here(runtime_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A job started without probing by torchrun: ``trace --job`` from any
    rank injects and traces all four (not torchrun's agent), ``inject --job``
    finds them probed, ``--job --stop`` stops them."""
    import re
    import subprocess
    import sys

    from tests.jobs.framework import kill_trees

    require_bpf()
    script = tmp_path / "job.py"
    script.write_text('import os\nprint(f"ready pid={os.getpid()}", flush=True)\n' + JOB)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBING")}
    env["PROBING_RUNTIME_DIR"] = str(runtime_dir)
    out = tmp_path / "out"
    with open(out, "w") as f:
        run = subprocess.Popen(
            [torchrun, "--nproc-per-node", str(WORLD), "--master-port", str(free_port()),
             str(script)], env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120 * SLOWDOWN
        while (
            len(pids := [int(p) for p in re.findall(r"ready pid=(\d+)", out.read_text())]) < WORLD
        ):
            assert run.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        r = cli("trace", "--pid", str(pids[2]), "--job", "--background", "--no-nccl",
                "--no-cuda", timeout=240)  # fmt: skip
        assert r.returncode == 0 and r.stdout.startswith(f"{WORLD} of {WORLD} ranks tracing\n"), (
            r.stdout + r.stderr
        )
        assert sorted(
            int(line.split()[0]) for line in r.stdout.splitlines()[3 : 3 + WORLD]
        ) == sorted(pids)
        again = cli("inject", "--pid", str(pids[0]), "--job")
        assert again.returncode == 0 and again.stdout.count("already has a probe") == WORLD
        for pid in pids:
            n = ProbeClient.for_pid(pid).query("SELECT count(*) AS n FROM comm.collectives")
            assert n.column("n")[0].as_py() >= 0
        r = cli("trace", "--pid", str(pids[1]), "--job", "--stop", timeout=120)
        assert r.returncode == 0 and r.stdout.startswith(f"{WORLD} of {WORLD} ranks stopped\n")
    finally:
        kill_trees([run])


SLOWED_JOB = (Path(__file__).parents[1] / "jobs" / "slowable.py").read_text()


def test_the_job_is_watched_with_no_client(spawn, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Traced from one command, healthy for 15 s (no finding), then one rank
    60 ms slower a step: analyze.findings names it within 30 s with no
    diagnose run, and /metrics (with the token) shows its lateness."""
    import random
    import urllib.request

    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    require_bpf()
    slow, flag = random.randrange(WORLD), tmp_path / "slow"
    port = free_port()
    pids = []
    for r in range(WORLD):
        t = spawn(SLOWED_JOB, env={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(WORLD),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "PROBING_TOKEN": TOKEN, "SLOW_RANK": str(slow),
                                   "SLOW_FILE": str(flag)})  # fmt: skip
        pids.append(t.pid)
    for pid in pids:
        wait_ready(pid, 60 * SLOWDOWN)
    r = cli("trace", "--pid", str(pids[1]), "--cluster", "--background", "--no-nccl",
            "--no-cuda", timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    findings = "SELECT kind, rank, text, cleared_ns FROM analyze.findings"

    def found() -> list[dict]:  # type: ignore[type-arg]
        return ProbeClient.for_pid(pids[0]).query(findings).to_pylist()

    time.sleep(15)
    assert found() == [], "a healthy job got a finding"
    flag.touch()
    t0 = time.monotonic()
    while not (got := [f for f in found() if f["kind"] == "straggler"]):
        assert time.monotonic() - t0 < 30 * SLOWDOWN, found()
        time.sleep(0.5)
    print(f"straggler rank {slow} found {time.monotonic() - t0:.1f} s after its slowdown")
    assert [f["rank"] for f in got] == [slow], got
    addr = wait_ready(pids[0])["cluster"]["addr"]
    req = urllib.request.Request(f"http://{addr}/metrics",
                                 headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
    deadline = time.monotonic() + 40 * SLOWDOWN  # the gauge is the mean over the last 30 s
    while True:
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            text = resp.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        lateness = families["probing_rank_lateness_seconds"].samples
        late = {int(s.labels["rank"]): s.value for s in lateness}
        if late.get(slow, 0) > 0.03 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert max(late, key=late.__getitem__) == slow and late[slow] > 0.03, late
    assert {s.labels["kind"]: s.value for s in families["probing_findings"].samples}[
        "straggler"
    ] == 1


def test_a_killed_rank_still_answers_and_is_named_dead(spawn) -> None:  # type: ignore[no-untyped-def]
    """kill -9 on a traced rank: its pid answers with its last collectives,
    and diagnose --cluster says it died, when, and where."""
    require_bpf()
    pids = _job(spawn)
    r = cli("trace", "--pid", str(pids[0]), "--cluster", "--background", "--no-nccl",
            "--no-cuda", timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    deadline = time.monotonic() + 30 * SLOWDOWN
    while min(_traced_ranks(pids[0]).values(), default=0) < 5:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    os.kill(pids[3], signal.SIGKILL)
    time.sleep(1)
    q = cli("query", "--pid", str(pids[3]), "--format", "json",
            "SELECT count(*) AS n FROM comm.collectives")  # fmt: skip
    assert q.returncode == 0 and json.loads(q.stdout)[0]["n"] > 0, q.stdout + q.stderr
    r = cli("diagnose", "--pid", str(pids[0]), "--cluster", "--window", "30", "--hang-after",
            "3s", "--format", "json", timeout=120)  # fmt: skip
    assert r.returncode in (0, 2), r.stdout + r.stderr
    d = json.loads(r.stdout)
    # Gloo's own thread aborts the others once a peer's connection resets: they may
    # die too, after it; the first to die is said first
    assert "3" in d["dead"] and d["dead"]["3"]["pid"] == pids[3], d["dead"]
    assert d["verdict"].startswith(f"rank 3 (pid {pids[3]}) died at "), d["verdict"]
    assert "allreduce #" in d["verdict"].split(";")[0], d["verdict"]


def test_a_trace_stopped_while_the_job_trains_is_no_hang(spawn) -> None:  # type: ignore[no-untyped-def]
    """Issue 43: ``trace --stop``, then the job trains on; a diagnosis once
    ``HANG_AFTER_S`` has passed is no hang, over the cluster or the pids, and
    says the ranks stopped tracing."""
    from probing.analyze.hangs import HANG_AFTER_S

    require_bpf()
    pids = _job(spawn)
    r = cli("trace", "--pid", str(pids[0]), "--cluster", "--background", "--no-nccl",
            "--no-cuda", timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    deadline = time.monotonic() + 30 * SLOWDOWN
    while min(_traced_ranks(pids[0]).values() or [0]) < 20 and time.monotonic() < deadline:
        time.sleep(0.5)
    r = cli("trace", "--pid", str(pids[0]), "--cluster", "--stop", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    stopped = time.monotonic()
    while time.monotonic() - stopped < HANG_AFTER_S + 5:  # a stall the trace would date
        time.sleep(1)
    for how in (["--cluster"], [a for p in pids[1:] for a in ("--pid", str(p))]):
        # a window that holds the trace however long this machine took to get here
        r = cli("diagnose", "--pid", str(pids[0]), *how, "--window", "900", "--format", "json",
                timeout=120)  # fmt: skip
        assert r.returncode in (0, 2), r.stderr
        d = json.loads(r.stdout)
        assert d["hangs"] == [], (how, d["verdict"])
        assert "stopped tracing since" in d["verdict"], (how, d["verdict"])
        assert sorted(u["rank"] for u in d["untraced"]) == list(range(WORLD)), d["untraced"]


def test_one_command_traces_a_job_started_without_probing(spawn) -> None:  # type: ignore[no-untyped-def]
    """Issue 43: ``trace --pid P --cluster --background`` on a job nobody
    probed injects every rank of it on this machine, which join, and traces
    all four from one of them."""
    require_bpf()
    port = free_port()
    env = {"WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PROBING_TOKEN": TOKEN}  # fmt: skip
    ranks = [
        spawn(JOB, probing=False, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
        for r in range(WORLD)
    ]
    r = cli("trace", "--pid", str(ranks[2].pid), "--cluster", "--background", "--no-nccl",
            "--no-cuda", timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"{WORLD} of {WORLD} ranks tracing\n"), r.stdout + r.stderr
    for t in ranks:
        assert ProbeClient.for_pid(t.pid).trace_status()["state"] == "tracing"
    # stopping one rank says the others still trace, and how to stop them all
    r = cli("trace", "--pid", str(ranks[1].pid), "--stop", timeout=120)
    assert r.returncode == 0, r.stderr
    others = ", ".join(str(t.pid) for t in ranks if t is not ranks[1])
    assert f"{WORLD - 1} more rank(s) of its job still trace (pids {others})" in r.stdout, r.stdout
    assert f"probing trace --pid {ranks[1].pid} --cluster --stop" in r.stdout
