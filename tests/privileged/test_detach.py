"""Tracing off, every way it ends: ``probing trace --stop``, SIGTERM and
SIGKILL of the traced process. Each leaves no uprobe behind (multi-uprobe
links read from the kernel, perf events from ``bpftool perf``, and
``uprobe_events``), and a killed traced process is gone promptly: with one
RCU grace period per uprobe paid in series, as before multi-uprobe links,
it lingered for tens of seconds. Both attach modes: multi-uprobe links, and
one perf-event uprobe per function (``PROBING_UPROBE_MULTI=0``, what kernels
before 6.6 get); in both a helper process holds them and releases them after.
Root-only; PROBING_REQUIRE_PRIVILEGED=1 (CI) fails on a skip."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from probing import checks
from probing.cli.client import ProbeClient
from probing.node.bpf import loader
from tests.conftest import REPO, cli, require
from tests.privileged.helpers import perf_uprobes, require_privileged, wait_line

perf_uprobes_held = perf_uprobes  # by the process holding them (bpftool perf lists the holder)

pytestmark = pytest.mark.privileged

JOB = REPO / "tests" / "jobs" / "lib_loop.py"
EXIT_BOUND_S = 5.0  # generous: the serial grace periods this guards against took 10-30 s
MODES = ["multi", "single"]


def _mode_env(mode: str) -> dict[str, str]:
    if mode == "multi":
        require(loader.has_uprobe_multi(), "multi-uprobe links need Linux >= 6.6")
        return {}
    return {loader.ENV_MULTI: "0"}


def _traced(spawn, mode: str):  # type: ignore[no-untyped-def]
    """A lib_loop.py process with its libraries traced (cuda and nccl)."""
    require_privileged()
    env = _mode_env(mode)
    t = spawn("", argv=[sys.executable, str(JOB)], env=env)
    wait_line(t, "ready")
    status = ProbeClient.for_pid(t.pid).trace_start(["cuda", "nccl"])
    fams = status["families"]
    assert fams["cuda"]["uprobes"] > 0 and fams["nccl"]["uprobes"] > 0, status
    held = perf_uprobes(t.pid)
    links = [e for e in held if "link" in e]
    if mode == "multi":  # a link per library and direction (and per entry-only handler)
        assert held == links and 2 <= len(links), held
        assert sum(fams[f]["uprobes"] for f in fams) > len(links)
    else:  # held by the helper process, not by the traced one
        holder = ProbeClient.for_pid(t.pid).trace_status()["load"]["holder_pid"]
        assert held == [] and len(perf_uprobes_held(holder)) == sum(
            fams[f]["uprobes"] for f in fams
        )
    return t


def _stage_flush_links() -> int:
    """Raw-tracepoint links running probing's stage flush (``sched_switch``:
    the cuda family sends a CPU's staged launches when a thread leaves it)."""
    import json
    import subprocess

    def listed(what: str) -> list[dict]:  # type: ignore[type-arg]
        out = subprocess.run(["bpftool", what, "show", "-j"], capture_output=True, text=True)
        return json.loads(out.stdout or "[]") if out.returncode == 0 else []

    flush = {p["id"] for p in listed("prog") if p.get("name") == "probing_flush"}
    return sum(
        1
        for link in listed("link")
        if link.get("tp_name") == "sched_switch" and link.get("prog_id") in flush
    )


def _no_uprobes_left(pid: int) -> None:
    assert perf_uprobes(pid) == []
    with open(os.path.join(checks.tracefs_dir() or "/sys/kernel/tracing", "uprobe_events")) as f:
        assert f"_{pid}" not in f.read()


@pytest.mark.parametrize("mode", MODES)
def test_stop_detaches_every_uprobe(spawn, mode: str) -> None:
    before = _stage_flush_links()
    t = _traced(spawn, mode)
    assert _stage_flush_links() == before + 1  # the cuda family's, held like the uprobes
    holder = ProbeClient.for_pid(t.pid).trace_status()["load"]["holder_pid"]
    stopped = cli("trace", "--pid", str(t.pid), "--stop")
    assert stopped.returncode == 0, stopped.stderr
    assert "every uprobe detached" in stopped.stdout
    _released(t.pid, holder)
    deadline = time.monotonic() + 120
    while _stage_flush_links() != before:
        assert time.monotonic() < deadline, "the stage flush stayed attached to sched_switch"
        time.sleep(0.1)
    assert t.proc.poll() is None  # the process goes on, untraced
    status = ProbeClient.for_pid(t.pid).trace_status()
    assert status["state"] == "stopped"
    assert status["families"]["cuda"]["events"] > 0  # it was tracing for real


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("mode", MODES)
def test_a_killed_traced_process_is_gone_promptly(spawn, mode: str, sig: signal.Signals) -> None:
    t = _traced(spawn, mode)
    holder = ProbeClient.for_pid(t.pid).trace_status()["load"]["holder_pid"]
    t0 = time.monotonic()
    os.kill(t.pid, sig)
    t.proc.wait(timeout=60)
    took = time.monotonic() - t0
    assert t.proc.returncode == -sig
    assert took < EXIT_BOUND_S, f"the traced process took {took:.1f} s to go after {sig.name}"
    _released(t.pid, holder)
    while not _gone(holder):  # the helper that held them exits once it let go
        assert time.monotonic() < t0 + 120, f"holder {holder} outlived its process"
        time.sleep(0.2)


def _released(pid: int, holder: int, timeout: float = 120) -> None:
    """The helper process that holds the uprobes lets go of them (in the
    background: neither the stop nor the exit waited for it)."""
    deadline = time.monotonic() + timeout
    while perf_uprobes(pid) or perf_uprobes_held(holder):
        assert time.monotonic() < deadline, f"uprobes of {pid} kept by holder {holder}"
        time.sleep(0.1)
    _no_uprobes_left(pid)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
