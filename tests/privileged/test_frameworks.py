"""Real frameworks from PyPI, launched their own way (``tests/jobs/frameworks``,
environment ``frameworks`` from ``.ci/jobenvs.sh``: no probing in it).

For each: one rank, drawn at random, is slowed in a function of the user's
own file; probes start with ``PROBING=1`` (the hook installed in the job's
environment) or are injected later; ``query --cluster`` lists every rank
and ``diagnose --cluster`` names the slowed rank (for a pipeline: the stage).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from probing.demo import free_port, trace_all
from tests.conftest import REPO, SLOWDOWN, cli, require, require_bpf

pytestmark = pytest.mark.privileged

ENV = Path(os.environ.get("PROBING_JOB_ENVS", REPO / ".venv-jobs")) / "frameworks"
JOBS = REPO / "tests" / "jobs" / "frameworks"
WORLD = 4
READY = re.compile(r"ready rank=(\d+) pid=(\d+)")
ALL_RANKS = "SELECT rank FROM process.info ORDER BY rank"


def python() -> str:
    py = ENV / "bin" / "python"
    require(py.exists(), f"job env {ENV.name} missing: run .ci/jobenvs.sh (make setup)")
    return str(py)


class Job:
    """A framework job started as its users start it; ``ranks``: rank -> pid."""

    def __init__(self, argv: list[str], tmp: Path, env: dict[str, str]) -> None:
        self.out = tmp / "job.out"
        full = {k: v for k, v in os.environ.items() if not k.startswith(("PROBING", "RANK"))}
        full.update(PROBING_RUNTIME_DIR=os.environ["PROBING_RUNTIME_DIR"], STEPS="0")
        full.update(env)
        with open(self.out, "wb") as out:  # not from the checkout: probing is not importable
            self.proc = subprocess.Popen(
                argv, env=full, cwd=tmp, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.ranks: dict[int, int] = {}

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180) -> dict[int, int]:
        deadline = time.monotonic() + timeout * SLOWDOWN
        while len(self.ranks) < WORLD:
            self.ranks = {int(r): int(p) for r, p in READY.findall(self.text())}
            assert self.proc.poll() is None, f"the job ended:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"ranks never ready:\n{self.text()[-3000:]}"
            time.sleep(0.2)
        return self.ranks

    def stop(self) -> None:
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=30)
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def hooked() -> Iterator[str]:
    """The frameworks environment with probing's start-up hook (for ``PROBING=1``)."""
    py = python()
    r = cli("hook", "--python", py)
    assert r.returncode == 0, r.stderr
    yield py
    cli("hook", "--python", py, "--remove")


def torchrun(py: str, script: str) -> list[str]:
    run = str(Path(py).parent / "torchrun")
    return [run, "--nproc-per-node", str(WORLD), "--master-port", str(free_port()), script]


LAUNCH = {
    "hf_trainer": lambda py: torchrun(py, str(JOBS / "hf_trainer.py")),
    # accelerate on a machine without GPUs: --multi_gpu is its torchrun (the
    # Trainer asks for the CPU); --cpu would start one process
    "accelerate": lambda py: [
        str(Path(py).parent / "accelerate"),
        "launch",
        "--multi_gpu",
        "--num_processes",
        str(WORLD),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        str(JOBS / "hf_trainer.py"),
    ],  # fmt: skip
    "fsdp2": lambda py: torchrun(py, str(JOBS / "fsdp2.py")),
    "fsdp2_tp": lambda py: torchrun(py, str(JOBS / "fsdp2.py")),
    "lightning_ddp": lambda py: [py, str(JOBS / "lightning_job.py")],
    "lightning_ddp_spawn": lambda py: [py, str(JOBS / "lightning_job.py")],
    "mp_spawn": lambda py: [py, str(JOBS / "mp_spawn.py")],
    "pipeline": lambda py: torchrun(py, str(JOBS / "pipeline.py")),
}
ENVS = {
    "lightning_ddp": {"STRATEGY": "ddp"},
    "lightning_ddp_spawn": {"STRATEGY": "ddp_spawn"},
    "fsdp2_tp": {"MESH": "2d"},  # FSDP on a "dp" dimension, tensor parallel on "tp"
}
SLOW_MS = {"pipeline": "60", "hf_trainer": "60", "fsdp2": "60"}


def start(name: str, py: str, tmp: Path, probing: bool, slow: int, **more: str) -> Job:
    env = {"SLOW_RANK": str(slow), "SLOW_MS": SLOW_MS.get(name, "60"), **ENVS.get(name, {})}
    env.update(more)
    if probing:
        env["PROBING"] = "1"
    return Job(LAUNCH[name](py), tmp, env)


def diagnosed(job: Job, rank: int, pipeline: bool, timeout: float = 60) -> dict:
    """``diagnose --cluster`` (JSON) until it names ``rank``; its last answer."""
    deadline = time.monotonic() + timeout * SLOWDOWN
    pid = job.ranks[0 if rank else 1]  # asked through another rank's probe
    while True:
        r = cli("diagnose", "--pid", str(pid), "--cluster", "--window", "15", "--format", "json",
                timeout=120)  # fmt: skip
        assert r.returncode in (0, 2), r.stderr
        got = json.loads(r.stdout)
        if named(got, pipeline) == rank or time.monotonic() > deadline:
            return got
        time.sleep(1)


def named(d: dict, pipeline: bool) -> int | None:
    if pipeline:
        return (d.get("pipeline") or {}).get("slow")
    return d["stragglers"][0]["rank"] if d["stragglers"] else None


@pytest.mark.parametrize(
    ("name", "probing"),
    [
        ("lightning_ddp", True),
        ("lightning_ddp", False),
        ("lightning_ddp_spawn", True),
        ("lightning_ddp_spawn", False),
        ("mp_spawn", True),
        ("hf_trainer", False),
        ("accelerate", True),
        ("fsdp2", False),
        ("fsdp2_tp", False),
        ("pipeline", False),
    ],
)
def test_a_framework_job_forms_a_cluster_and_its_slow_rank_is_named(
    name: str, probing: bool, hooked: str, runtime_dir: Path, tmp_path: Path
) -> None:
    require_bpf()
    slow = random.Random(f"{name}{probing}{time.time_ns()}").randrange(WORLD)
    job = start(name, hooked, tmp_path, probing, slow)
    try:
        ranks = job.wait_ready()
        assert not trace_all(list(ranks.values()), ["gloo"])
        r = cli("query", "--pid", str(ranks[3]), "--cluster", "--format", "json", ALL_RANKS)
        assert r.returncode == 0, r.stderr
        assert [row["rank"] for row in json.loads(r.stdout)] == list(range(WORLD))
        d = diagnosed(job, slow, pipeline=name == "pipeline")
        assert named(d, name == "pipeline") == slow, d["verdict"]
        assert f"rank {slow}" in d["verdict"] and not d["healthy"]
        if name == "fsdp2_tp":  # named with the groups it slows, one per mesh dimension
            groups = d["stragglers"][0]["groups"]
            assert len(groups) == 2 and {"mesh_dp", "mesh_tp"} == {
                g.split("(")[-1].rstrip(")") for g in groups
            }, groups
        if name == "pipeline":  # the others wait on it: victims, not stragglers
            assert sorted(d["pipeline"]["victims"]) == sorted(set(range(WORLD)) - {slow})
            assert not d["stragglers"] and "slow stage" in d["verdict"]
    finally:
        job.stop()


def test_python_is_what_the_job_runs() -> None:
    """The job environment is its own: another numpy than probing's, no probing."""
    py = python()
    got = subprocess.run(
        [py, "-c", "import numpy, importlib.util as u; print(numpy.__version__, "
         "u.find_spec('probing') is None)"],
        capture_output=True, text=True, cwd="/", check=True,
    )  # fmt: skip
    assert got.stdout.split() == ["1.26.4", "True"]
    assert sys.executable != py


def test_a_hung_pipeline_names_the_stage_that_never_sent(
    hooked: str, runtime_dir: Path, tmp_path: Path
) -> None:
    require_bpf()
    stuck = random.randrange(WORLD)
    flag = tmp_path / "hang"
    job = Job(torchrun(hooked, str(JOBS / "pipeline.py")), tmp_path,
              {"HANG_RANK": str(stuck), "HANG_FILE": str(flag)})  # fmt: skip
    try:
        ranks = job.wait_ready()
        assert not trace_all(list(ranks.values()), ["gloo"])
        flag.touch()  # traced first: the neighbours' waits begin under the probes
        deadline = time.monotonic() + 60 * SLOWDOWN
        while True:
            r = cli("diagnose", "--pid", str(ranks[(stuck + 1) % WORLD]), "--cluster",
                    "--hang-after", "2s", "--format", "json", timeout=120)  # fmt: skip
            d = json.loads(r.stdout)
            if d["hangs"] or time.monotonic() > deadline:
                break
            time.sleep(1)
        [h] = d["hangs"]
        assert h["missing_ranks"] == [stuck] and h["op"] == "recv", d["verdict"]
        assert h["waiting_ranks"] and stuck not in h["waiting_ranks"]
        assert f"rank {stuck} never sent" in d["verdict"]
        assert any("stage_work" in line for line in h["stacks"][str(stuck)])
    finally:
        job.stop()


def _losses(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("name", ["pipeline", "lightning_ddp"])
def test_a_traced_framework_job_trains_with_the_losses_of_an_untraced_one(
    name: str, hooked: str, runtime_dir: Path, tmp_path: Path
) -> None:
    require_bpf()
    traced, untraced = tmp_path / "traced", tmp_path / "untraced"
    traced.mkdir()
    untraced.mkdir()
    job = start(name, hooked, traced, True, -1, LOSS_FILE=str(traced / "loss"))
    try:
        ranks = job.wait_ready()
        assert not trace_all(list(ranks.values()), ["gloo"])
        start_step = len(_losses(traced / "loss"))
        deadline = time.monotonic() + 120 * SLOWDOWN
        while len(_losses(traced / "loss")) < start_step + 30:
            assert time.monotonic() < deadline, job.text()[-3000:]
            time.sleep(0.2)
        r = cli("query", "--pid", str(ranks[1]), "--format", "json",
                "SELECT count(*) AS n FROM comm.collectives")  # fmt: skip
        assert json.loads(r.stdout)[0]["n"] > 0, r.stderr  # the steps compared were traced
    finally:
        job.stop()
    got = _losses(traced / "loss")
    ref = start(name, hooked, untraced, False, -1, LOSS_FILE=str(untraced / "loss"),
                STEPS=str(len(got)))  # fmt: skip
    try:
        assert ref.proc.wait(timeout=300 * SLOWDOWN) == 0, ref.text()[-3000:]
    finally:
        ref.stop()
    want = _losses(untraced / "loss")
    assert len(got) > start_step + 20 and got == want[: len(got)]
