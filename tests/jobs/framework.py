"""Real-framework jobs (``tests/jobs/frameworks/``, environment ``frameworks``
from ``.ci/jobenvs.sh``) started the way their users start them, with one
rank slowed, stuck or starved: for ``tests/privileged/test_frameworks.py``
and ``benchmarks/why_bench.py``."""

from __future__ import annotations

import os
import random
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from probing.cli.demo import free_port

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


def deepspeed(py: str, script: str) -> list[str]:
    """The ``deepspeed`` launcher: its runner starts ``deepspeed.launcher.launch``,
    which starts the ranks, all in the launcher's process group and session,
    with ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` (29500 unless
    told: a free one here, as jobs run side by side) and ``CUDA_VISIBLE_DEVICES``
    even on CPU (but torch's default threads: no ``OMP_NUM_THREADS=1`` as
    torchrun sets), and appends ``--local_rank=N`` to each rank's arguments."""
    run = str(Path(py).parent / "deepspeed")
    return [run, "--num_gpus", str(WORLD), "--master_port", str(free_port()), script]


def zero(launch: Callable[[str, str], list[str]], stage: int) -> Callable[[str], list[str]]:
    """The DeepSpeed job with ZeRO stage ``stage``, started by ``launch``."""
    return lambda py: [*launch(py, str(JOBS / "deepspeed_job.py")), "--zero", str(stage)]


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
    "megatron": lambda py: torchrun(py, str(JOBS / "megatron_job.py")),
    # DeepSpeed ZeRO stage z under its own launcher (deepspeed_z<z>) and torchrun
    **{f"deepspeed_z{z}": zero(deepspeed, z) for z in (1, 2, 3)},
    **{f"deepspeed_torchrun_z{z}": zero(torchrun, z) for z in (1, 2, 3)},
    "threaded": lambda py: torchrun(py, str(JOBS / "threaded_job.py")),
}
ENVS = {
    "lightning_ddp": {"STRATEGY": "ddp"},
    "lightning_ddp_spawn": {"STRATEGY": "ddp_spawn"},
    "fsdp2_tp": {"MESH": "2d"},  # FSDP on a "dp" dimension, tensor parallel on "tp"
    # the deepspeed launcher sets no OMP_NUM_THREADS (torchrun sets 1): ZeRO-3's 4
    # ranks each spinning torch's default threads on 2 cores took ~1 s a step
    "deepspeed_z3": {"OMP_NUM_THREADS": "1"},
}
# ZeRO-3's step is the longest (a gather per layer, twice): slowed more, to stand out
SLOW_MS = {"pipeline": "60", "hf_trainer": "60", "fsdp2": "60", "deepspeed_z3": "100",
           "deepspeed_torchrun_z3": "100"}  # fmt: skip


def start(name: str, py: str, tmp: Path, probing: bool, slow: int, **more: str) -> Job:
    env = {"SLOW_RANK": str(slow), "SLOW_MS": SLOW_MS.get(name, "60"), **ENVS.get(name, {})}
    env.update(more)
    if probing:
        env["PROBING"] = "1"
    return Job(LAUNCH[name](py), tmp, env)


def starve(pid: int, cpu: int, busy: int = 4) -> list[subprocess.Popen[bytes]]:
    """A CPU hog on ``cpu``: ``busy`` spinning processes (a stray preprocessing
    or build job), with every thread of ``pid`` pinned there too (``taskset``:
    what a stray job on a rank's core does to it). Each spins in a session of
    its own: with autogroup scheduling a session shares a CPU as one task, and
    the job's ranks share one session."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:  # a thread that ended meanwhile
            continue
    spin = ["taskset", "-c", str(cpu), "python3", "-c", "while True: pass"]
    return [subprocess.Popen(spin, start_new_session=True) for _ in range(busy)]


# a CPU hog's spinning processes: the rank gets 1/9 of its core, 10 ms of work takes
# 90 ms of a 60 ms step, late even when another load takes half the others' core
# (with 4, the rank's 50 ms fit in the step, as slow as ranks sharing a loaded core)
HOGS = 8

# what the user's own code is called in each job (where a rank is slowed)
FUNCTION = {"hf_trainer": "collate_tokens", "fsdp2": "heavy_features",
            "lightning_ddp": "heavy_features", "pipeline": "stage_work",
            "megatron": "attention_block", "deepspeed_z2": "mix_features",
            "threaded": "decode_batch"}  # fmt: skip
# the causes a job has: every job, but these
ONLY = {"loader_worker": "hf_trainer", "cpu_hog": "lightning_ddp", "gpu": "lightning_ddp"}
CAUSES = ("off_cpu", "cpu", "loader_worker", "cpu_hog", "gpu", "healthy")
# what the stand-in NVML says of a rank's GPU held by its power cap, against the others
THROTTLED = "its GPU runs at 1.21 GHz vs 1.98 GHz on the others (power cap)"


def applies(framework: str, cause: str) -> bool:
    return ONLY.get(cause, framework) == framework


class Slowed:
    """A 4-rank ``framework`` job, started without probing, whose rank ``slow``
    is slowed by ``cause`` (``CAUSES``) by about ``ms`` a step:

    * ``off_cpu``: the user's function sleeps (a slow collate, a slow read);
    * ``cpu``: the user's function computes that long more;
    * ``loader_worker``: the collate sleeps 8x that in the DataLoader's 2
      worker processes of that rank (HF): they prefetch, so the rank waits
      only where they make a batch slower than the others step (4x left it
      a few ms late on a loaded node, where the others' step is ~100 ms);
    * ``cpu_hog``: ``HOGS`` busy processes on the rank's core (``starve``), in a
      Lightning job that computes 10 ms and waits 60 ms a step (CPUs to spare);
    * ``gpu``: every rank's GPU is the stand-in NVML's (``FAKE_NVML_PROCS``
      says which is whose, as NVML's process list does), the rank's is held by
      its power cap, and its step's stream sync waits that long (Lightning);
    * ``healthy``: nothing.

    ``blamed``: what the verdict's headline should name. ``ready()`` waits for
    the ranks, ``traced()`` is called once they are traced, ``stop()`` ends
    it all."""

    def __init__(self, framework: str, cause: str, slow: int, ms: int, tmp: Path) -> None:
        assert applies(framework, cause), (framework, cause)
        self.cause, self.slow, self.tmp = cause, slow, tmp
        env = {"SLOW_MS": str(ms), "SLOW_KIND": "cpu" if cause == "cpu" else "sleep"}
        self.blamed = FUNCTION[framework]
        if cause == "loader_worker":
            env.update(WORKERS="2", SLOW_MS=str(8 * ms))
            self.blamed = "its DataLoader's worker processes"
        elif cause == "cpu_hog":
            env.update(SLOW_MS="0", PACE_MS="60", WORK_MS="10")
            self.blamed = "CPU starvation"
        elif cause == "gpu":
            env.update(self._stand_in_gpus(), SLOW_KIND="gpu")
            self.blamed = THROTTLED
        elif cause == "healthy":
            env["SLOW_MS"] = "0"
        self.job = start(framework, str(ENV / "bin" / "python"), tmp, False, slow, **env)
        self.hogs: list[subprocess.Popen[bytes]] = []

    def _stand_in_gpus(self) -> dict[str, str]:
        from tests.conftest import build_lib

        nvml = self.tmp / "nvml"
        nvml.mkdir()
        build_lib("fake_nvml.c", nvml / "libnvidia-ml.so.1", "-Werror")
        engine = {"LD_LIBRARY_PATH": str(nvml), "FAKE_NVML_GPUS": str(WORLD),
                  "FAKE_NVML_THROTTLED": str(self.slow),
                  "FAKE_NVML_PROCS": str(self.tmp / "gpu-procs")}  # fmt: skip
        cudart = build_lib("fake_cudart.c", self.tmp / "libcudart.so.99", "-s", "-ldl")
        return {**engine, "PROBING_ENGINE_ENV": ",".join(engine), "CUDART": cudart,
                "PROBING_NVML_INTERVAL": "100ms"}  # fmt: skip

    def ready(self) -> dict[int, int]:
        ranks = self.job.wait_ready()
        if self.cause == "gpu":  # rank r works on GPU r
            lines = "".join(f"{r} {pid}\n" for r, pid in ranks.items())
            (self.tmp / "gpu-procs").write_text(lines)
        return ranks

    def traced(self) -> None:
        if self.cause == "cpu_hog":
            cpus = sorted(os.sched_getaffinity(0))
            self.hogs = starve(self.job.ranks[self.slow], random.choice(cpus), HOGS)

    def families(self) -> list[str]:
        return ["gloo", "cuda"] if self.cause == "gpu" else ["gloo"]

    def stop(self) -> None:
        for h in self.hogs:
            h.kill()
            h.wait(timeout=30)
        self.job.stop()
