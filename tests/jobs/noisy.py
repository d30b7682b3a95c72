"""Start and steer ``noisy_job.py`` (4 ranks, the srun/mpirun way), for the
diagnose tests and ``benchmarks/diagnose_bench.py``: the slowdown is changed
while the job runs (``slow()``), and a rank can be starved of CPU (``starve()``:
pinned to one CPU with busy processes beside it, the others on the rest)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from probing.cli.demo import DemoJob, free_port

JOB = Path(__file__).resolve().parent / "noisy_job.py"
WORLD = 4


class NoisyJob(DemoJob):
    """The ranks of one noisy job; started, waited for and stopped as a DemoJob is."""

    def __init__(self, tmp: Path, *job_args: str, world: int = WORLD) -> None:
        self.world = world
        self.control = tmp / f"control-{os.getpid()}-{time.monotonic_ns()}"
        self.control.write_text("-1 none 0")
        self.port = port = free_port()
        base = {k: v for k, v in os.environ.items() if k != "PROBING"}
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
        base.update(LOCAL_WORLD_SIZE=str(world))
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(JOB), "--control", str(self.control), *job_args],
                env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )  # fmt: skip
            for r in range(world)
        ]
        self.hogs: list[subprocess.Popen[bytes]] = []

    def wait_ready(self, timeout: float = 120.0) -> None:
        super().wait_ready(timeout)

    def slow(self, rank: int, kind: str, ms: float) -> None:
        """From the ranks' next step on: ``rank`` slowed by ``ms`` in ``kind``."""
        tmp = self.control.with_suffix(".new")
        tmp.write_text(f"{rank} {kind} {ms:.1f}")
        tmp.replace(self.control)

    def starve(self, rank: int | None, hogs: int = 6) -> None:
        """``rank`` alone on one CPU with ``hogs`` spinning processes (each in its
        own session: autogroup shares a CPU per session); None: undo."""
        for h in self.hogs:
            h.kill()
            h.wait()
        self.hogs = []
        cpus = sorted(os.sched_getaffinity(0))
        if rank is None or len(cpus) < 2:
            for pid in self.pids:
                _set_affinity(pid, set(cpus))
                _autogroup_nice(pid, 0)
            return
        busy, rest = cpus[0], set(cpus[1:])
        for r, pid in enumerate(self.pids):
            _set_affinity(pid, {busy} if r == rank else rest)
        _autogroup_nice(self.pids[rank], 3)  # and behind them in line for it
        self.hogs = [
            subprocess.Popen(
                ["taskset", "-c", str(busy), sys.executable, "-c", "while 1: pass"],
                start_new_session=True,
            )
            for _ in range(hogs)
        ]

    def stop(self) -> None:
        self.starve(None)
        super().stop()
        self.control.unlink(missing_ok=True)


def _autogroup_nice(pid: int, nice: int) -> None:
    """The nice value of ``pid``'s session group (each rank is a session of its
    own; with autogroup scheduling that, not the task's own nice, weighs)."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except OSError:
        pass


def _set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` (torch's pools included) onto ``cpus``."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass
