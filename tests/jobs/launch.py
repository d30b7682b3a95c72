"""A 4-rank DDP job (``ddp_job.py``) started the ways users start theirs, for
the launch-matrix and fault tests (``tests/privileged``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

from probing.cli.demo import free_port
from tests.conftest import REPO
from tests.jobs.framework import kill_trees

JOB = REPO / "tests" / "jobs" / "ddp_job.py"
WORLD = 4
SLOW_RANK, SLOW_MS = 2, 400  # far beyond this machine's noise: the launch path is under test
LINE = re.compile(r"^rank (\d+) step (\d+) loss ([0-9.]+) t ([0-9.]+)$")
GROUP_BY_RANK = "SELECT rank, count(*) AS n FROM process.threads GROUP BY rank ORDER BY rank"
REF_STEPS = 4


class Launch:
    """One job started one way; its ranks' stdout lines in ``out``."""

    def __init__(
        self,
        how: str,
        tmp: Path,
        *job_args: str,
        env: dict[str, str] | None = None,
        probe: bool = True,
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
                    env_r = dict(
                        base, PROBING="1" if probe else "0", RANK=str(r), LOCAL_RANK=str(r)
                    )
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

    def step_times(self) -> dict[int, list[float]]:
        """rank -> the wall time each step ended."""
        got: dict[int, list[float]] = {}
        for line in self.out.read_text(errors="replace").splitlines():
            if m := LINE.match(line.strip()):
                got.setdefault(int(m[1]), []).append(float(m[4]))
        return got

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
        """Kill the launchers and every process under them: torchrun's workers
        run in sessions of their own and outlive a killed agent."""
        kill_trees(self.procs)


def uprobe_pids() -> set[int]:
    """The pids uprobes are attached for now: the pid filter of every multi-uprobe
    link (held by the tracer's helper process, so ``bpftool perf`` shows the helper),
    and the holders of perf-event uprobes."""
    from probing.node.bpf.kernel import uprobe_links

    out = subprocess.run(["bpftool", "perf", "-j"], capture_output=True, text=True, check=True)
    held = {e["pid"] for e in json.loads(out.stdout or "[]") if e.get("fd_type") == "uprobe"}
    return held | {link.pid for link in uprobe_links()}
