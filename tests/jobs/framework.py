"""Real-framework jobs (``tests/jobs/frameworks/``, environment ``frameworks``
from ``.ci/jobenvs.sh``) started the way their users start them, with one
rank slowed, stuck or starved: for ``tests/privileged/test_frameworks.py``
and ``benchmarks/why_bench.py``."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import psutil

from probing.demo import free_port

REPO = Path(__file__).resolve().parents[2]
ENV = Path(os.environ.get("PROBING_JOB_ENVS", REPO / ".venv-jobs")) / "frameworks"
JOBS = REPO / "tests" / "jobs" / "frameworks"
WORLD = 4
READY = re.compile(r"ready rank=(\d+) pid=(\d+)")


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
        deadline = time.monotonic() + timeout * float(os.environ.get("PROBING_TEST_SLOWDOWN", "1"))
        while len(self.ranks) < WORLD:
            self.ranks = {int(r): int(p) for r, p in READY.findall(self.text())}
            assert self.proc.poll() is None, f"the job ended:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"ranks never ready:\n{self.text()[-3000:]}"
            time.sleep(0.2)
        return self.ranks

    def stop(self) -> None:
        kill_trees([self.proc])


def kill_trees(launchers: list[subprocess.Popen[bytes]]) -> None:
    """Kill each launcher and every process under it (torchrun's workers and
    ``mp.spawn``'s children outlive a killed parent), and reap the launchers."""
    procs = []
    for launcher in launchers:
        try:
            root = psutil.Process(launcher.pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    for launcher in launchers:
        launcher.wait(timeout=30)


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


def starve(pid: int, cpu: int) -> subprocess.Popen[bytes]:
    """A CPU hog on ``cpu``, with every thread of ``pid`` pinned there too
    (``taskset``: what a stray process on a rank's core does to it). It runs
    at real-time priority (``chrt -f 1``, held to 95 % of the core by the
    kernel's RT throttling): the scheduler favours a rank that was waiting
    over a plain busy loop, so one at nice 0 or -10 barely delays it."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:  # a thread that ended meanwhile
            continue
    return subprocess.Popen(
        ["chrt", "-f", "1", "taskset", "-c", str(cpu), "python3", "-c", "while True: pass"],
        start_new_session=True,
    )
