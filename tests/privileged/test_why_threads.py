"""``why``, whichever thread trains: a launcher that runs the training loop in
a ``threading.Thread`` while its main thread idles in the launcher's own
loop. One rank's function sleeps 60 ms a step in that worker thread (its
Gloo all-reduces run on ProcessGroupGloo's workers, for it): ``diagnose
--cluster`` names the rank, and the function as its cause, not "nothing of
its own". The slowed rank is drawn at random (printed). Root-only."""

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
from tests.conftest import SLOWDOWN, cli, require_bpf

pytestmark = pytest.mark.privileged
WORLD = 4

JOB = """
import os, threading, time
import torch, torch.distributed as dist

SLOW = int(os.environ["SLOW_RANK"])


def attention_block():
    if dist.get_rank() == SLOW:
        time.sleep(0.06)  # the slowed rank's extra 60 ms a step, off CPU


def train():
    t = torch.ones(1024)
    while True:
        time.sleep(0.01)  # the step's work
        attention_block()
        dist.all_reduce(t)


dist.init_process_group("gloo")
worker = threading.Thread(target=train, name="trainer", daemon=True)
worker.start()
print(f"ready rank={dist.get_rank()} pid={os.getpid()}", flush=True)
while worker.is_alive():  # the launcher's own loop, in the main thread
    time.sleep(0.05)
"""


def test_the_slowed_function_of_a_loop_in_a_thread_is_the_cause(
    runtime_dir: Path, tmp_path: Path
) -> None:
    require_bpf()
    slow = random.randrange(WORLD)
    print(f"straggler: rank {slow}")
    script = tmp_path / "threaded_job.py"  # a file of the user's: its frames are user code
    script.write_text(JOB)
    port = free_port()
    procs = []
    for r in range(WORLD):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PROBING", "RANK"))}
        env.update(PROBING="1", PROBING_RUNTIME_DIR=str(runtime_dir), RANK=str(r),
                   LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), SLOW_RANK=str(slow))  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                      stdout=subprocess.PIPE, text=True, cwd=tmp_path))  # fmt: skip
    try:
        pids = [int(p.stdout.readline().split("pid=")[1]) for p in procs]  # type: ignore[union-attr]
        assert not trace_all(pids, ["gloo"])
        deadline = time.monotonic() + 60 * SLOWDOWN
        while True:
            said = cli("diagnose", "--pid", str(pids[(slow + 1) % WORLD]), "--cluster",
                       "--window", "8", "--format", "json", timeout=120)  # fmt: skip
            assert said.returncode == 0, said.stderr
            d = json.loads(said.stdout)
            fn = [w for w in d["why"] if w["kind"] == "function" and w["rank"] == slow]
            if (d["stragglers"] and fn) or time.monotonic() > deadline:
                break
            time.sleep(1)
        print(d["verdict"])
        assert d["stragglers"] and d["stragglers"][0]["rank"] == slow, d["verdict"]
        assert fn and fn[0]["what"] == "attention_block", d["why"]
        assert fn[0]["off_cpu_ms"] > 30 and fn[0]["others_ms_per_step"] < 10, fn[0]
        assert f": attention_block ({script}:" in d["verdict"], d["verdict"]
        assert "nothing of its own" not in d["verdict"], d["verdict"]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
