"""The launch matrix (issue 20): every real way a job starts, with a probe in it.

A 4-rank Gloo DDP job (``tests/jobs/ddp_job.py``: torch's default threads,
a 256-512-16 MLP, 4 ranks on this machine's cores) is started

* ``torchrun`` with ``PROBING=1`` (the probe starts before ``import torch``);
* the srun/mpirun way: each rank given RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT,
  rank 0's ``init_process_group`` hosting the store, seconds after every
  probe started;
* ``torchrun ... -m probing run job.py``;
* plain ``torchrun``, with ``probing inject`` / ``probing trace`` later.

For each: every rank trains with the losses of an untraced run with the same
seed; ``probing query --cluster`` answers for all 4 ranks; ``probing trace``
on every rank then ``probing diagnose --cluster`` names the slowed rank.
Root-only (ptrace, BPF).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import psutil
import pytest

from probing.cli.client import ProbeClient
from probing.cli.demo import trace_all
from tests.conftest import cli, require_bpf
from tests.jobs.launch import GROUP_BY_RANK, REF_STEPS, SLOW_MS, SLOW_RANK, WORLD, Launch
from tests.jobs.launch import uprobe_pids as _uprobe_pids

pytestmark = pytest.mark.privileged


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[int, str]]:
    """The losses of an untraced run with the same seeds (no probe anywhere)."""
    job = Launch("reference", tmp_path_factory.mktemp("ref"), "--steps", str(REF_STEPS))
    try:
        for p in job.procs:
            p.wait(timeout=180)
    finally:
        job.stop()
    got = job.losses()
    assert len(got) == WORLD and all(len(v) == REF_STEPS for v in got.values()), job.tail()
    return got


def cluster_ranks(pid: int) -> tuple[list[int], float]:
    t0 = time.monotonic()
    r = cli("query", "--pid", str(pid), "--cluster", GROUP_BY_RANK, "--format", "json")
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    return [row["rank"] for row in json.loads(r.stdout)], took


def until_all_ranks(pid: int, timeout: float = 30) -> float:
    """Seconds until a cluster query through ``pid`` lists every rank."""
    t0 = time.monotonic()
    while True:
        ranks, _ = cluster_ranks(pid)
        if ranks == list(range(WORLD)):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"only ranks {ranks} answered"


def diagnose_names(pid: int, rank: int) -> dict:  # type: ignore[type-arg]
    r = cli("diagnose", "--pid", str(pid), "--cluster", "--format", "json", timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [s["rank"] for s in out["stragglers"]] == [rank], out["verdict"]
    return out


@pytest.mark.parametrize("how", ["torchrun", "env", "probing-run", "inject"])
def test_launch_matrix(how: str, launch, reference) -> None:  # type: ignore[no-untyped-def]
    require_bpf()
    job = launch(
        "torchrun" if how == "inject" else how,
        "--slow-rank",
        str(SLOW_RANK),
        "--slow-ms",
        str(SLOW_MS),
    )
    job.wait_steps(1)
    ranks = job.ranks()
    assert sorted(ranks) == list(range(WORLD)), ranks
    if how == "inject":  # the job runs without a probe until someone looks
        for pid in ranks.values():
            r = cli("inject", "--pid", str(pid))
            assert r.returncode == 0, r.stderr
    took = until_all_ranks(ranks[0])
    print(f"{how}: a cluster query listed all {WORLD} ranks {took:.2f} s after the job was up")
    assert took < 20  # a generous bound; the figure is printed above
    errors = trace_all(list(ranks.values()), ["gloo"])
    assert not errors, errors
    done = min(len(v) for v in job.losses().values())
    job.wait_steps(max(done, REF_STEPS) + 12)  # traced steps (the first ones compared below)
    diagnose_names(ranks[0], SLOW_RANK)
    got = job.losses()
    for r in range(WORLD):
        assert [got[r][s] for s in range(REF_STEPS)] == [
            reference[r][s] for s in range(REF_STEPS)
        ], f"rank {r}"
    assert all(p.poll() is None for p in job.procs), job.tail()  # still training


def _listening(path: Path) -> bool:
    """A probe answers there (a file left by an earlier process of that pid
    refuses the connection)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def test_dataloader_workers_fork_unharmed(launch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Traced while its DataLoader workers fork: they keep feeding the job,
    and no worker gets a probe or uprobes of its own."""
    require_bpf()
    job = launch("env", "--workers", "2")
    job.wait_steps(1)
    ranks = job.ranks()
    errors = trace_all(list(ranks.values()), ["gloo"])
    assert not errors, errors
    start = {r: len(v) for r, v in job.losses().items()}
    job.wait_steps(max(start.values()) + 5)
    # the tracer's helper process (it holds the uprobe links) is a child too
    helpers = {
        ProbeClient.for_pid(pid).trace_status()["load"]["holder_pid"] for pid in ranks.values()
    }
    workers = {
        c.pid for pid in ranks.values() for c in psutil.Process(pid).children() if c.is_running()
    } - helpers
    assert len(workers) == 2 * WORLD, workers
    rt = Path(os.environ.get("PROBING_RUNTIME_DIR", "/tmp")) / f"probing-{os.getuid()}"
    assert not [w for w in workers if _listening(rt / f"{w}.sock")]  # no second probe
    holders = _uprobe_pids()
    assert set(ranks.values()) <= holders and not holders & workers, (holders, workers)


def test_two_kinds_of_process_group(launch) -> None:  # type: ignore[no-untyped-def]
    """2 x 2 data- and tensor-parallel groups (``new_group``): each group's
    collectives are matched across its own ranks only."""
    require_bpf()
    job = launch("env", "--groups")
    job.wait_steps(1)
    ranks = job.ranks()
    errors = trace_all(list(ranks.values()), ["gloo"])
    assert not errors, errors
    job.wait_steps(max(len(v) for v in job.losses().values()) + 6)
    from probing.analyze import collectives as coll
    from probing.cli.asking import diagnose
    from probing.cli.client import JobClient

    _, table = diagnose(JobClient(pids=[ranks[0]], cluster=True, timeout=10))
    assert "pg" in table.column_names, table.schema
    members: dict[str, set[int]] = {}
    for c in coll.match(table):
        if c.nranks == 2:
            members.setdefault(c.comm, set()).update(c.ts)
    # each 2-rank group's collectives matched across its own two ranks, never mixed
    assert sorted(map(sorted, members.values())) == [[0, 1], [0, 2], [1, 3], [2, 3]], members
