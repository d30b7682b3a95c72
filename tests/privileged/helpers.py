"""Helpers of the privileged tests (and the GPU ones): what a test needs to
run here, the uprobes a process holds, lines from a target's output, and
the ``mark`` a target script records its call sites with."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from probing.node.bpf.kernel import uprobe_links
from tests.conftest import REPO, cli, require, require_bpf
from tests.jobs.lib_loop import installed_libraries

# the job environments of .ci/jobenvs.sh: other Pythons, numpy and pyarrow, no probing
JOB_ENVS = Path(os.environ.get("PROBING_JOB_ENVS", REPO / ".venv-jobs"))


def env_python(name: str) -> str:
    """The Python of job environment ``name`` (skipped where it is missing)."""
    python = JOB_ENVS / name / "bin" / "python"
    require(python.exists(), f"job env {name} missing: run .ci/jobenvs.sh (make setup)")
    return str(python)


def ok(*args: str) -> str:
    """``probing ARGS``'s output, asserting it succeeded."""
    r = cli(*args, timeout=120)
    assert r.returncode == 0, f"probing {' '.join(args)}: {r.stderr}"
    return r.stdout


def require_privileged() -> None:
    require_bpf()
    require(shutil.which("bpftool") is not None, "bpftool (make setup installs it)")


def installed_lib(prefix: str) -> str:
    for p in installed_libraries():
        if os.path.basename(p).startswith(prefix):
            return p
    pytest.fail(f"{prefix} is not installed (make setup installs NVIDIA's wheels)")


def perf_uprobes(pid: int) -> list[dict]:  # type: ignore[type-arg]
    """The uprobes with a BPF program that ``pid`` holds: uprobe perf events
    (``bpftool perf``) and multi-uprobe links (read from the kernel)."""
    out = subprocess.run(["bpftool", "-j", "perf"], capture_output=True, text=True, check=True)
    found = [
        e
        for e in json.loads(out.stdout or "[]")
        if e.get("pid") == pid and e.get("fd_type") in ("uprobe", "uretprobe")
    ]
    for link in uprobe_links():
        if link.pid == pid:
            kind = "uretprobe" if link.ret else "uprobe"
            found.append({"pid": pid, "fd_type": kind, "filename": link.path, "link": link.id})
    return found


def no_uprobes_left(pid: int, timeout: float = 60) -> None:
    """Until ``pid`` has no uprobe: the helper process that holds them
    (probing.node.bpf.loader.Holder) lets go just after a stop or an exit."""
    deadline = time.monotonic() + timeout
    while perf_uprobes(pid):
        assert time.monotonic() < deadline, f"uprobes of pid {pid} left: {perf_uprobes(pid)}"
        time.sleep(0.1)


def _read_until(target, match, what: str, timeout: float) -> str:  # type: ignore[no-untyped-def]
    """The first line of the target's output that ``match`` accepts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = target.proc.stdout.readline()
        if match(line):
            return line
        if not line and target.proc.poll() is not None:
            raise AssertionError(f"target exited: {target.proc.communicate()}")
    raise AssertionError(f"no {what!r} line from pid {target.pid}")


def wait_line(target, want: str, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    _read_until(target, lambda line: line.strip() == want, want, timeout)


def line_after(target, prefix: str, timeout: float = 60) -> str:  # type: ignore[no-untyped-def]
    """The rest of the first line of the target's output that starts with ``prefix``."""
    line = _read_until(target, lambda line: line.startswith(prefix), prefix, timeout)
    return line[len(prefix) :].strip()


# MARK, in a target script: mark(name, value) records, with traceback, the
# file, line and function it is called from (the line of the call it is an
# argument of) and returns value.
MARK = """
marks = {}


def mark(name, value):
    caller = traceback.extract_stack()[-2]
    marks[name] = [caller.filename, caller.lineno, caller.name]
    return value
"""
