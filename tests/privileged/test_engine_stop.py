"""A stop that always stops: SIGTERM at random instants to the node's engine
while it traces a torch process (or while it starts, attaches and loads the
trace), again and again; each time it exits, and takes its sockets with it.

``PROBING_SIGTERMS`` sets how many (20 here; 200 for the figure in
docs/measurements.md, ~10 min). The engine's handler only writes a byte to
a pipe (``worker.stop_on_signals``): one that took a lock hung an engine for
good when the signal landed inside that lock.
"""

from __future__ import annotations

import os
import random
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import SLOWDOWN, live_engines, require_bpf

pytestmark = pytest.mark.privileged

# one process with a Gloo group of its own, all-reducing every 5 ms
TARGET = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
t = torch.ones(16)
print("ready", flush=True)
while True:
    dist.all_reduce(t)
    time.sleep(0.005)
"""
EXIT_BOUND_S = 10.0  # the target is 2 s; a hang never exits (a 10x regression fails)


def _engine(runtime_dir: Path, timeout: float) -> int:
    """The pid of the live engine serving ``runtime_dir`` (waited for)."""
    deadline = time.monotonic() + timeout * SLOWDOWN
    while time.monotonic() < deadline:
        pids = live_engines(runtime_dir)
        if pids:
            return pids[0]
        time.sleep(0.01)
    raise AssertionError(f"no engine in {runtime_dir} after {timeout} s")


def _exit_s(pid: int) -> float:
    """SIGTERM to ``pid``; seconds until it is gone (EXIT_BOUND_S: it was not)."""
    fd = os.pidfd_open(pid)
    try:
        t0 = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        ready, _, _ = select.select([fd], [], [], EXIT_BOUND_S * SLOWDOWN)
        return time.monotonic() - t0 if ready else EXIT_BOUND_S * SLOWDOWN
    finally:
        os.close(fd)


def test_sigterm_at_random_instants_always_stops_the_engine(runtime_dir: Path) -> None:
    require_bpf()
    runs = int(os.environ.get("PROBING_SIGTERMS", "20"))
    rng = random.Random(os.environ.get("PROBING_SIGTERM_SEED") or time.time_ns())
    target = subprocess.Popen([sys.executable, "-c", TARGET], stdout=subprocess.PIPE, text=True)
    directory = runtime_dir / f"probing-{os.getuid()}"
    exits: list[float] = []
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        for k in range(runs):
            trace = subprocess.Popen(
                [sys.executable, "-m", "probing", "trace", "--pid", str(target.pid),
                 "--background", "--no-nccl", "--no-cuda"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            if k % 2 == 0:  # tracing: at a random instant after the trace started
                out, err = trace.communicate(timeout=120 * SLOWDOWN)
                # a new engine goes on with what the one before traced (its <pid>.trace)
                assert trace.returncode == 0 or "already tracing" in err, err
                time.sleep(rng.uniform(0, 0.5))
            else:  # at any instant of its start: imports, attach, the trace's load
                time.sleep(rng.uniform(0, 1.5))
            engine = _engine(runtime_dir, 60)
            took = _exit_s(engine)
            exits.append(took)
            assert took < EXIT_BOUND_S * SLOWDOWN, f"run {k}: engine {engine} never exited"
            trace.communicate(timeout=120 * SLOWDOWN)  # it may fail: its engine was stopped
            left = [p.name for p in directory.glob("*.sock")]
            assert not left, f"run {k}: sockets left by engine {engine}: {left}"
            assert target.poll() is None, "the traced process died"
    finally:
        target.kill()
        target.wait(timeout=30)
    print(f"{len(exits)} SIGTERMs: exit in median {statistics.median(exits):.2f} s, "
          f"max {max(exits):.2f} s")  # fmt: skip
