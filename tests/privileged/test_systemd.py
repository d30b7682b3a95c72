"""The agent as systemd runs it: deploy/systemd/probing-agent.service installed
as shipped (a drop-in points it at this venv), started, watching a job that
nobody started with ``PROBING=1``; killed with ``systemctl kill -s KILL``, it
comes back by itself and knows the job again.

Needs systemd as PID 1, which this project's CI host is not: it runs in the
VM (``make vm-test VM_TESTS=systemd``, booted with ``init=/lib/systemd/systemd``,
part of ``.ci/run``). Elsewhere it is skipped with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, SLOWDOWN, require

pytestmark = pytest.mark.privileged

UNIT = "probing-agent.service"
PORT = 9978  # the unit's default (PROBING_AGENT_PORT)
JOB = "import time\nwhile True: time.sleep(0.1)\n"


def _booted_with_systemd() -> bool:
    return (
        os.path.isdir("/run/systemd/system")
        and Path("/proc/1/comm").read_text().strip() == "systemd"
    )


def _systemctl(*args: str) -> str:
    r = subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r.stdout.strip()


def _main_pid() -> int:
    return int(_systemctl("show", "-p", "MainPID", "--value", UNIT) or 0)


def _health() -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _until(what, timeout: float):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout * SLOWDOWN
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


@pytest.fixture
def installed() -> Iterator[None]:
    """The shipped unit in /etc/systemd/system, with a drop-in for this venv."""
    if not _booted_with_systemd():
        pytest.skip("needs systemd as PID 1: runs in the VM (make vm-test VM_TESTS=systemd)")
    require(os.geteuid() == 0, "needs root (installs a systemd unit)")
    unit = Path("/etc/systemd/system") / UNIT
    unit.write_text((REPO / "deploy" / "systemd" / UNIT).read_text())
    dropin = unit.with_name(UNIT + ".d")
    dropin.mkdir(exist_ok=True)
    (dropin / "venv.conf").write_text(
        f"[Service]\nExecStart=\nExecStart={sys.executable} -m probing agent --every 1\n"
    )
    _systemctl("daemon-reload")
    try:
        yield
    finally:
        subprocess.run(["systemctl", "stop", UNIT], capture_output=True, timeout=60)
        unit.unlink()
        (dropin / "venv.conf").unlink()
        dropin.rmdir()
        subprocess.run(["systemctl", "daemon-reload"], capture_output=True, timeout=60)


def test_systemd_runs_the_agent_and_brings_it_back_when_killed(installed: None) -> None:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29517",
    }  # a launcher's rank, no PROBING
    job = subprocess.Popen([sys.executable, "-c", JOB], env=env)
    try:
        _systemctl("start", UNIT)
        first = _main_pid()
        assert first > 0
        watched = _until(lambda: str(job.pid) in json.dumps(_health() or {}), 120)
        assert watched, _health()
        _systemctl("kill", "-s", "KILL", UNIT)
        back = _until(lambda: _main_pid() not in (0, first) and _health() is not None, 60)
        assert back, (_main_pid(), _systemctl("status", "--no-pager", UNIT))
        assert _systemctl("is-active", UNIT) == "active"
        again = _until(lambda: str(job.pid) in json.dumps(_health() or {}), 60)
        assert again, _health()  # the new agent finds the job (and its probe) again
    finally:
        job.kill()
        job.wait()
