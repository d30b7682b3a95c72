"""A newcomer's tour (issue 43): the README's "A 5-minute tour", its commands
parsed from README.md and run as written (bash, ``probing`` on the PATH)
against a 4-rank job torchrun started in a venv without probing, whose rank
1 reads its batches 30 ms slower; each step's output checked, the README's
sample verdict included. And ``diagnose --cluster --record`` given
torchrun's own pid: it records and diagnoses the ranks, not the launcher."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from probing.cli.client import ProbeClient
from probing.cli.demo import free_port
from probing.errors import NoProbe
from tests.conftest import REPO, SLOWDOWN, require, require_bpf, stop_engine
from tests.jobs.framework import kill_trees
from tests.test_export import parse

pytestmark = pytest.mark.privileged

WORLD, SLOW = 4, 1
JOB_ENV = Path(os.environ.get("PROBING_JOB_ENVS", REPO / ".venv-jobs")) / "torch-np126"
TRAIN = """
import os, time
import torch, torch.distributed as dist
from torch import nn


def load_batch(rank):
    time.sleep(0.005 + (0.03 if rank == 1 else 0.0))  # rank 1 reads its data slower
    return torch.randn(32, 64), torch.randint(0, 10, (32,))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    print(f"ready rank={rank} pid={os.getpid()}", flush=True)
    while True:
        x, y = load_batch(rank)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


main()
"""
# the verdict's first words, in the README's sample and as diagnose prints it
VERDICT = re.compile(
    r"^rank (\d+) on node \S+ is \d+ ms late each \d+ ms step \(last at \d+ % of\s+allreduces\)"
    r"\s+on\s+\S+\s+since\s+at\s+least"
)


def tour() -> tuple[list[str], str]:
    """The shell commands of README.md's tour (a command goes on while a quote
    is open) and its sample verdict; the python block is the job's own code."""
    readme = (REPO / "README.md").read_text()
    text = readme.split("## A 5-minute tour", 1)[1].split("\n## ", 1)[0]
    commands, sample = [], ""
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        if lang:
            continue
        lines = iter(body.splitlines())
        for line in lines:
            if line.startswith("rank "):
                sample = body
                break
            if not line.startswith("probing "):
                continue
            while line.count('"') % 2:
                line += "\n" + next(lines)
            commands.append(line)
    return commands, sample


class TourJob:
    """The job: torchrun (``launcher``) and its ranks' pids, the environment
    and folder a user's shell would have."""

    def __init__(self, launcher: subprocess.Popen[bytes], ranks: dict[int, int], env, cwd) -> None:  # type: ignore[no-untyped-def]
        self.launcher, self.ranks, self.env, self.cwd = launcher, ranks, env, cwd

    def run(self, cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", cmd], env=self.env, cwd=self.cwd, text=True,
                              capture_output=True, timeout=timeout * SLOWDOWN)  # fmt: skip

    def until(
        self, cmd: str, ok: Callable[[subprocess.CompletedProcess[str]], bool], timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """``cmd`` again until its answer is ``ok`` (the job records as it trains)."""
        deadline = time.monotonic() + timeout * SLOWDOWN
        while True:
            r = self.run(cmd)
            if ok(r) or time.monotonic() > deadline:
                return r
            time.sleep(0.5)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TourJob]:
    require_bpf()
    torchrun = JOB_ENV / "bin" / "torchrun"
    require(torchrun.exists(), f"job env {JOB_ENV.name} missing: run .ci/jobenvs.sh (make setup)")
    cwd = tmp_path_factory.mktemp("tour")
    rt = tmp_path_factory.mktemp("rt")
    (cwd / "train.py").write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBING")}
    env["PROBING_RUNTIME_DIR"] = str(rt)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    with pytest.MonkeyPatch.context() as mp, open(cwd / "job.log", "wb") as log:
        mp.setenv("PROBING_RUNTIME_DIR", str(rt))
        launcher = subprocess.Popen(
            [str(torchrun), "--nproc-per-node", str(WORLD), "--master-port", str(free_port()),
             "train.py"], env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120 * SLOWDOWN
            while len(ready := re.findall(r"ready rank=(\d) pid=(\d+)", _log(cwd))) < WORLD:
                assert launcher.poll() is None and time.monotonic() < deadline, _log(cwd)
                time.sleep(0.2)
            yield TourJob(launcher, {int(r): int(p) for r, p in ready}, env, cwd)
        finally:
            kill_trees([launcher])
            stop_engine(rt)


def _log(cwd: Path) -> str:
    return (cwd / "job.log").read_text(errors="replace")


def test_the_readme_tour_runs_as_written(job: TourJob) -> None:
    commands, sample = tour()
    assert VERDICT.match(sample), f"the README's sample verdict is not diagnose's:\n{sample}"
    pids = sorted(job.ranks.values())  # "say pids 101 to 104"
    ran = []
    for literal in commands:
        cmd = re.sub(r"\b10([1-4])\b", lambda m: str(pids[int(m[1]) - 1]), literal)
        step = literal.split("#")[0].split()
        what = " ".join(w for w in step[1:] if w.startswith("--") or w.isalpha())
        r = check(job, step[1], what, cmd)
        assert r.returncode in (0, 2), f"$ {cmd}\n{r.stdout}{r.stderr}"
        ran.append(step[1])
    assert ran[0] == "ps" and ran[-1] == "trace" and {"export", "diagnose"} <= set(ran), ran


def check(job: TourJob, verb: str, what: str, cmd: str) -> subprocess.CompletedProcess[str]:
    """Run one step of the tour; its output is what the tour says it is."""
    pids = set(job.ranks.values())
    if verb == "ps":
        r = job.run(cmd)
        listed = {
            int(line.split()[0]) for line in r.stdout.splitlines() if line[:6].strip().isdigit()
        }
        assert pids <= listed, r.stdout
    elif verb == "inject":
        r = job.run(cmd)
        assert re.search(r"probe started in pid \d+|already has a probe", r.stdout), r.stdout
    elif verb == "stack":
        r = job.run(cmd)
        assert "MainThread" in r.stdout and "train.py" in r.stdout, r.stdout
    elif verb == "tables":
        r = job.run(cmd)
        assert "comm.collectives" in r.stdout and "python.samples" in r.stdout, r.stdout
    elif verb == "trace" and "--stop" in what:
        r = job.run(cmd)
        assert r.stdout.startswith(f"{WORLD} of {WORLD} ranks stopped\n"), r.stdout + r.stderr
    elif verb == "trace":
        r = job.run(cmd)
        assert r.stdout.startswith(f"{WORLD} of {WORLD} ranks tracing\n"), r.stdout + r.stderr
    elif verb == "query" and "--cluster" in what:
        r = job.until(cmd, lambda r: _ranks(r.stdout) == set(range(WORLD)))
        assert _ranks(r.stdout) == set(range(WORLD)), r.stdout + r.stderr
    elif verb == "query":
        r = job.until(cmd, lambda r: "allreduce" in r.stdout)
        assert "allreduce" in r.stdout, r.stdout + r.stderr
        if "callsite" in cmd:  # the Python line that made each call
            assert "train.py" in r.stdout, r.stdout
    elif verb == "diagnose":
        r = job.until(cmd, lambda r: _named(r.stdout), timeout=60)
        assert _named(r.stdout), r.stdout + r.stderr
    elif verb == "export":
        r = job.run(cmd)
        assert r.returncode == 0, r.stderr
        [out] = re.findall(r"-o (\S+)", cmd)
        got = parse(job.cwd / out)
        # the cause on the timeline: load_batch on the slow rank's Python track,
        # longer there than on any other rank's
        load = {rank: sum(s["dur"] for s in slices if s["name"] == "load_batch")
                for (rank, name), slices in got["tracks"].items()
                if name.startswith("Python: MainThread")}  # fmt: skip
        assert sorted(load) == list(range(WORLD)) and max(load, key=load.__getitem__) == SLOW, load
    else:
        pytest.fail(f"a step of the tour this test does not check: {cmd}")
    return r


def _ranks(table: str) -> set[int]:
    return {int(line.split()[0]) for line in table.splitlines() if line[:4].strip().isdigit()}


def _named(verdict: str) -> bool:
    m = VERDICT.match(verdict)
    return m is not None and int(m[1]) == SLOW and "load_batch" in verdict.split("\n\n")[0]


def test_diagnose_records_the_job_from_the_launchers_pid(job: TourJob) -> None:
    """``diagnose --cluster --record`` given torchrun's pid: the ranks are
    traced (probes brought in where they have none), diagnosed, and stopped
    after; the launcher gets no probe."""
    r = job.run(f"probing diagnose --pid {job.launcher.pid} --cluster --record 6s")
    assert r.returncode in (0, 2), r.stdout + r.stderr
    assert f"tracing {WORLD} of {WORLD} ranks" in r.stderr and "recording 6 s" in r.stderr, r.stderr
    assert _named(r.stdout), r.stdout
    for pid in job.ranks.values():
        assert ProbeClient.for_pid(pid).trace_status()["state"] != "tracing"
    with pytest.raises(NoProbe):
        ProbeClient.for_pid(job.launcher.pid)
