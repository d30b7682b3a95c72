"""``make demo`` / ``probing demo``: name the slow rank of a live 4-rank job.

Starts a 4-rank ``torch.distributed`` DDP job (``probing/cli/demo/job.py``: Gloo
on CPU, NCCL when a GPU is there) *without* probing, one rank's data loader
slowed (at random unless ``--slow-rank``), attaches to every rank with
``probing trace`` (dynamic injection), lets it run a few seconds, then runs
``probing diagnose`` over all ranks exactly as a user would from another
terminal, and shuts everything down. ``--hang``: one rank's loader gets
stuck before a collective instead, and the demo shows the hang report.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

JOB_SCRIPT = Path(__file__).resolve().parent / "job.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend() -> str:
    """NCCL when torch sees a GPU, else Gloo."""
    try:
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"
    except ImportError:
        return "gloo"


class DemoJob:
    """The ranks of one demo job: start, wait until they step, stop."""

    def __init__(
        self,
        world: int = 4,
        *,
        job_args: Sequence[str] = (),
        rank_prefix: dict[int, list[str]] | None = None,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
    ) -> None:
        self.world = world
        self.port = free_port()
        base = {k: v for k, v in os.environ.items() if k != "PROBING"}
        base.update(env or {})
        args = list(job_args)
        master = args[args.index("--master") + 1] if "--master" in args else "127.0.0.1"
        self.procs = []
        for r in range(world):
            cmd = [python, str(JOB_SCRIPT), "--rank", str(r), "--world", str(world)]
            cmd += ["--port", str(self.port), *job_args]
            prefix = (rank_prefix or {}).get(r, [])
            # what torchrun gives each rank (a probe attached later reads it)
            env_r = dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world))
            env_r.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR=master)
            env_r.update(MASTER_PORT=str(self.port))
            self.procs.append(
                subprocess.Popen(
                    [*prefix, *cmd],
                    env=env_r,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )  # fmt: skip
            )

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until every rank has done its first step (prints ``ready``)."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            while True:
                line = p.stdout.readline() if p.stdout else ""
                if line.strip() == "ready":
                    break
                if not line and p.poll() is not None:
                    err = p.stderr.read() if p.stderr else ""
                    raise RuntimeError(f"rank pid {p.pid} exited: {err.strip()[-500:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank pid {p.pid} did not start in {timeout:g} s")

    def exits(self) -> str:
        """The ranks that have exited, with their status and last words (for errors)."""
        gone = []
        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                err = ""
                if p.stderr is not None:  # without blocking: a child may still hold the pipe
                    os.set_blocking(p.stderr.fileno(), False)
                    err = p.stderr.read() or ""
                gone.append(f"rank {r} (pid {p.pid}) exited {p.returncode}: {err.strip()[-400:]}")
        return "; ".join(gone) or "every rank is still running"

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        # no communicate(): it waits for EOF, which anything that inherited the
        # pipes could hold; the exit itself can take a while (the kernel tears
        # down the uprobes of a traced process as it dies)
        for p in self.procs:
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()
            p.wait(timeout=120)


def _probing(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "probing", *args], capture_output=True, text=True, timeout=timeout
    )


def trace_all(pids: Sequence[int], families: Sequence[str]) -> list[str]:
    """``probing trace --pid P --background`` for every pid at once; errors, if any.
    Each may inject, then wait for its probe's answers (``answer_timeout()``)."""
    from probing.cli.client import answer_timeout

    flags = [f"--no-{f}" for f in ("nccl", "cuda", "gloo") if f not in families]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "probing", "trace", "--pid", str(pid), *flags, "--background"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for pid in pids
    ]
    errors = []
    for pid, p in zip(pids, procs, strict=True):
        out, err = p.communicate(timeout=max(120.0, 4 * answer_timeout()))
        if p.returncode:
            errors.append(f"pid {pid}: {err.strip()}")
    return errors


HANG_AFTER_S = 3.0  # the demo's hang is called one after this long


def main(
    seconds: float = 4.0, *, slow_rank: int | None = None, hang: bool = False, world: int = 4
) -> int:
    t0 = time.monotonic()
    be = backend()
    rank = random.randrange(world) if slow_rank is None else slow_rank
    if hang:
        # it gets stuck once traced (the file appears), so the trace holds the steps before
        stuck = os.path.join(tempfile.mkdtemp(prefix="probing-demo-"), "stuck")
        job_args = ["--hang-rank", str(rank), "--hang-file", stuck, "--backend", be]
        what = f"rank {rank}'s data loader gets stuck {seconds:g} s after tracing starts"
    else:
        job_args = ["--slow-rank", str(rank), "--slow-ms", "40", "--backend", be]
        what = f"rank {rank}'s data loader is 40 ms slower"
    print(f"$ torchrun-like: 4 ranks of {JOB_SCRIPT.name} ({be}); {what}", flush=True)
    job = DemoJob(world, job_args=job_args)
    try:
        job.wait_ready()
        pids = job.pids
        print(f"# ranks started without probing: pids {' '.join(map(str, pids))}")
        families = ["nccl", "cuda"] if be == "nccl" else ["gloo"]
        print(f"$ probing trace --pid P --background    # for each of the {world} ranks")
        errors = trace_all(pids, families)
        if errors:
            print("demo: tracing failed:\n  " + "\n  ".join(errors), file=sys.stderr)
            return 1
        print(f"# tracing; letting the job run {seconds:g} s", flush=True)
        time.sleep(seconds)
        if hang:  # torch's collective counts are read over each rank's local socket
            open(stuck, "w").close()
            print(f"# rank {rank} is stuck now; {HANG_AFTER_S + 0.5:g} s later:", flush=True)
            time.sleep(HANG_AFTER_S + 0.5)
            args = [a for p in pids for a in ("--pid", str(p))]
            args += ["--hang-after", f"{HANG_AFTER_S:g}s"]
        else:  # one rank's probe asks its peers (cluster mode, found through the store)
            args = ["--pid", str(pids[0]), "--cluster"]
        print(f"$ probing diagnose {' '.join(args)}", flush=True)
        r = _probing("diagnose", *args)
        print((r.stdout or r.stderr).rstrip() + "\n", flush=True)
        if r.returncode:
            return 1
        named = f"rank {rank} never entered" if hang else f"rank {rank} on node"
        ok = named in " ".join(r.stdout.split("\n\n")[0].split())
        names = "names it" if ok else "MISSES it"
        print(f"demo: the {'stuck' if hang else 'slowed'} rank was {rank}; the verdict {names}")
        return 0 if ok else 1
    finally:
        job.stop()
        if hang:
            shutil.rmtree(os.path.dirname(stuck), ignore_errors=True)
        print(f"demo: stopped the job's {world} ranks ({time.monotonic() - t0:.1f} s in all)")


if __name__ == "__main__":
    sys.exit(main())
