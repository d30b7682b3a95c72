"""The GPU in ``why``, on CPU jobs: each rank has a GPU of the stand-in NVML
(``tests/fixtures/fake_nvml.c``) and synchronises every step through the
stand-in runtime (``fake_cudart.c``). One rank's GPU is held by its power
cap, and that rank's synchronisation waits 40 ms a step (what a slower GPU
does to it): ``diagnose --cluster`` names the rank, and its headline cause
is the GPU, with its clocks."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from probing.cli.demo import free_port, trace_all
from tests.conftest import SLOWDOWN, build_lib, cli, require_bpf

pytestmark = pytest.mark.privileged
WORLD = 4

JOB = """
import ctypes, os, sys, time
import torch, torch.distributed as dist

cudart = ctypes.CDLL(sys.argv[1])

def sync_gpu():
    cudart.cudaStreamSynchronize(None)  # waits FAKE_CUDA_SYNC_MS on the slow GPU's rank

dist.init_process_group("gloo")
print(f"ready rank={dist.get_rank()} pid={os.getpid()}", flush=True)
t = torch.ones(1024)
while True:
    time.sleep(0.01)  # the step's work
    sync_gpu()
    dist.all_reduce(t)
"""


def test_a_throttled_gpu_is_named_as_the_cause_with_its_clocks(
    runtime_dir: Path, tmp_path: Path
) -> None:
    require_bpf()
    nvml = tmp_path / "nvml"
    nvml.mkdir()
    build_lib("fake_nvml.c", nvml / "libnvidia-ml.so.1", "-Werror")
    cudart = build_lib("fake_cudart.c", tmp_path / "libcudart.so.99", "-s", "-ldl")
    slow = random.randrange(WORLD)
    port = free_port()
    engine = {"LD_LIBRARY_PATH": str(nvml), "FAKE_NVML_GPUS": str(WORLD),
              "FAKE_NVML_THROTTLED": str(slow)}  # fmt: skip
    procs = []
    for r in range(WORLD):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PROBING", "RANK"))}
        env.update(engine, PROBING="1", PROBING_RUNTIME_DIR=str(runtime_dir),
                   PROBING_NVML_INTERVAL="100ms", PROBING_ENGINE_ENV=",".join(engine),
                   RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES=str(r),
                   FAKE_CUDA_SYNC_MS="40" if r == slow else "0")  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-c", JOB, cudart], env=env,
                                      stdout=subprocess.PIPE, text=True, cwd=tmp_path))  # fmt: skip
    try:
        pids = [int(p.stdout.readline().split("pid=")[1]) for p in procs]  # type: ignore[union-attr]
        assert not trace_all(pids, ["gloo", "cuda"])
        deadline = time.monotonic() + 60 * SLOWDOWN
        while True:
            r = cli("diagnose", "--pid", str(pids[(slow + 1) % WORLD]), "--cluster",
                    "--window", "8", "--format", "json", timeout=120)  # fmt: skip
            d = json.loads(r.stdout)
            gpu = [w for w in d["why"] if w["kind"] == "gpu" and w["rank"] == slow]
            if (d["stragglers"] and gpu) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert d["stragglers"] and d["stragglers"][0]["rank"] == slow, d["verdict"]
        clocks = "its GPU runs at 1.21 GHz vs 1.98 GHz on the others (power cap)"
        assert gpu and gpu[0]["text"] == f"rank {slow}: {clocks}", d["why"]
        assert f"{clocks}, " in d["verdict"] and "% of its lateness" in d["verdict"], d["verdict"]
        sync = [w for w in d["why"] if w["kind"] == "cuda" and w["rank"] == slow]
        assert sync and sync[0]["what"] == "cudaStreamSynchronize", d["why"]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
