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
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from probing.demo import free_port, trace_all
from tests.conftest import REPO, cli, require_bpf

pytestmark = pytest.mark.privileged

JOB = REPO / "tests" / "jobs" / "ddp_job.py"
WORLD = 4
SLOW_RANK, SLOW_MS = 2, 400  # far beyond this machine's noise: the launch path is under test
LINE = re.compile(r"^rank (\d+) step (\d+) loss ([0-9.]+)$")
GROUP_BY_RANK = "SELECT rank, count(*) AS n FROM process.threads GROUP BY rank ORDER BY rank"
REF_STEPS = 4


class Launch:
    """One job started one way; its ranks' stdout lines in ``out``."""

    def __init__(
        self, how: str, tmp: Path, *job_args: str, env: dict[str, str] | None = None
    ) -> None:
        self.how = how
        self.out = tmp / f"{how}.out"
        self.port = free_port()
        base = {k: v for k, v in os.environ.items() if k != "PROBING"}
        base.update(env or {})
        if how in ("torchrun", "probing-run"):
            base["PROBING"] = "1" if how == "torchrun" else "0"
        self.procs: list[subprocess.Popen[bytes]] = []
        with open(self.out, "wb") as out:
            if how == "env":
                for r in range(WORLD):
                    env_r = dict(base, PROBING="1", RANK=str(r), LOCAL_RANK=str(r))
                    env_r.update(WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
                    env_r.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port))
                    cmd = [sys.executable, str(JOB), *job_args]
                    self.procs.append(self._popen(cmd, env_r, out))
            else:
                run = ["-m", "probing", "run", str(JOB)] if how == "probing-run" else [str(JOB)]
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node"]
                cmd += [str(WORLD), "--master-port", str(self.port), *run, *job_args]
                self.procs.append(self._popen(cmd, base, out))

    @staticmethod
    def _popen(cmd: list[str], env: dict[str, str], out) -> subprocess.Popen[bytes]:  # type: ignore[no-untyped-def]
        return subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def ranks(self) -> dict[int, int]:
        """rank -> pid of each rank process (not torchrun's agent, not forked workers)."""
        found: dict[int, int] = {}
        for launcher in self.procs:
            try:
                procs = [psutil.Process(launcher.pid)]
                procs += procs[0].children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for p in procs:
                try:
                    env = p.environ()
                    if "RANK" not in env or str(JOB) not in " ".join(p.cmdline()):
                        continue
                    parent = p.parent()
                    if parent is not None and parent.environ().get("RANK") == env["RANK"]:
                        continue  # a forked child of a rank (a DataLoader worker)
                    found[int(env["RANK"])] = p.pid
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
        return found

    def losses(self) -> dict[int, dict[int, str]]:
        got: dict[int, dict[int, str]] = {}
        for line in self.out.read_text(errors="replace").splitlines():
            if m := LINE.match(line.strip()):
                got.setdefault(int(m[1]), {})[int(m[2])] = m[3]
        return got

    def wait_steps(self, steps: int, timeout: float = 120) -> float:
        """Until every rank has printed ``steps`` steps; returns when that was."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.losses()
            if len(got) == WORLD and all(len(v) >= steps for v in got.values()):
                return time.monotonic()
            if all(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.1)
        raise AssertionError(f"{self.how}: not every rank reached step {steps}:\n{self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.out.read_text(errors="replace").splitlines()[-30:])

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
            p.wait(timeout=30)


@pytest.fixture
def launch(tmp_path: Path) -> Iterator:
    started: list[Launch] = []

    def start(how: str, *job_args: str, **kw) -> Launch:  # type: ignore[no-untyped-def]
        job = Launch(how, tmp_path, *job_args, **kw)
        started.append(job)
        return job

    yield start
    for job in started:
        job.stop()


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


def _uprobe_pids() -> set[int]:
    """The pids that hold uprobes now (``bpftool perf``)."""
    out = subprocess.run(["bpftool", "perf", "-j"], capture_output=True, text=True, check=True)
    return {e["pid"] for e in json.loads(out.stdout or "[]") if e.get("fd_type") == "uprobe"}


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
    workers = {
        c.pid for pid in ranks.values() for c in psutil.Process(pid).children() if c.is_running()
    }
    assert len(workers) == 2 * WORLD, workers
    rt = Path(os.environ.get("PROBING_RUNTIME_DIR", "/tmp")) / f"probing-{os.getuid()}"
    assert not [w for w in workers if (rt / f"{w}.sock").exists()]  # no second probe
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
    from probing.analyze.diagnose import diagnose

    _, table = diagnose(pids=[ranks[0]], cluster=True, timeout=10)
    assert "pg" in table.column_names, table.schema
    members: dict[str, set[int]] = {}
    for c in coll.match(table):
        if c.nranks == 2:
            members.setdefault(c.comm, set()).update(c.ts)
    # each 2-rank group's collectives matched across its own two ranks, never mixed
    assert sorted(map(sorted, members.values())) == [[0, 1], [0, 2], [1, 3], [2, 3]], members
