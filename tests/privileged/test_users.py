"""Users apart: two users' jobs on one node get two engines, and neither
user can query, trace or list the other's processes (root can).

Each user runs probing from an environment they can read (a venv of the
system's Python that sees this checkout and its packages: the project's own
venv lives under root's home), with ``PROBING=1`` hooked into it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, SLOWDOWN, require

pytestmark = pytest.mark.privileged

USERS = ("probing-a", "probing-b")
JOB = "import time\nwhile True: time.sleep(0.1)\n"


def _system_python() -> str:
    """The system's Python of probing's minor version (its packages are built for it)."""
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return shutil.which(minor, path="/usr/bin:/usr/local/bin") or ""


@pytest.fixture(scope="module")
def shared() -> Iterator[Path]:
    """A directory both users can read: a venv that sees probing, a runtime dir."""
    require(os.geteuid() == 0, "needs root (to run processes as two users)")
    python = _system_python()
    require(bool(python), "no system Python of probing's minor version for the users")
    require(bool(shutil.which("useradd")), "useradd missing")
    for user in USERS:
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                            "/usr/sbin/nologin", user], check=True)  # fmt: skip
    top = Path(tempfile.mkdtemp(prefix="probing-users-"))
    top.chmod(0o755)
    try:
        venv = top / "venv"
        subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = next((venv / "lib").glob("python3*/site-packages"))
        ours = next((REPO / ".venv" / "lib").glob("python3*/site-packages"))
        (site / "probing-checkout.pth").write_text(f"{REPO}\n{ours}\n")
        runtime = top / "run"
        runtime.mkdir(mode=0o1777)
        runtime.chmod(0o1777)
        python = str(venv / "bin" / "python")
        seen = subprocess.run(["runuser", "-u", USERS[0], "--", python, "-c",
                               "import probing, pyarrow, datafusion"],
                              capture_output=True, text=True)  # fmt: skip
        init = str(REPO / "probing" / "__init__.py")
        probe = ["runuser", "-u", USERS[0], "--", "test", "-r", init]
        readable = subprocess.run(probe).returncode == 0
        if seen.returncode != 0 and not readable:  # where the machine put the checkout
            pytest.skip(f"this checkout ({REPO}) or its venv is not readable by other users: "
                        "clone it where they can read it to run this test")  # fmt: skip
        assert seen.returncode == 0, seen.stderr
        hook = subprocess.run([python, "-m", "probing", "hook", "--python", python],
                              capture_output=True, text=True)  # fmt: skip
        assert hook.returncode == 0, hook.stderr
        yield top
    finally:
        for user in USERS:
            subprocess.run(["pkill", "-KILL", "-u", user], check=False)
        shutil.rmtree(top, ignore_errors=True)


def _as(user: str, shared: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``probing ARGS`` run by ``user``."""
    python = str(shared / "venv" / "bin" / "python")
    environ = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(shared),
        "PROBING_RUNTIME_DIR": str(shared / "run"),
        **env,
    }
    cmd = ["runuser", "-u", user, "--", "env", "-i", *[f"{k}={v}" for k, v in environ.items()],
           python, "-m", "probing", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120 * SLOWDOWN)


def _job(user: str, shared: Path) -> subprocess.Popen[bytes]:
    python = str(shared / "venv" / "bin" / "python")
    env = ["PATH=/usr/bin:/bin", f"HOME={shared}", f"PROBING_RUNTIME_DIR={shared / 'run'}",
           "PROBING=1", "PROBING_ENGINE_IDLE_S=2"]  # fmt: skip
    return subprocess.Popen(["runuser", "-u", user, "--", "env", "-i", *env, python, "-c", JOB])


def _child(proc: subprocess.Popen[bytes]) -> int:
    """The job's pid (runuser's child)."""
    import psutil

    deadline = time.monotonic() + 20 * SLOWDOWN
    while time.monotonic() < deadline:
        kids = psutil.Process(proc.pid).children()
        if kids:
            return int(kids[0].pid)
        time.sleep(0.05)
    raise AssertionError("the job did not start")


def test_two_users_get_two_engines_and_neither_sees_the_other(shared: Path) -> None:
    jobs = {user: _job(user, shared) for user in USERS}
    try:
        pids = {user: _child(p) for user, p in jobs.items()}
        for user, pid in pids.items():  # each user's own probe answers that user
            deadline = time.monotonic() + 30 * SLOWDOWN
            while True:
                r = _as(user, shared, "query", "--pid", str(pid), "SELECT pid FROM process.info")
                if r.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
            assert r.returncode == 0, r.stderr
            assert str(pid) in r.stdout
        engines = {}
        for user in USERS:
            uid = pwd.getpwnam(user).pw_uid
            [lock] = (shared / "run" / f"probing-{uid}").glob("engine-*.lock")
            engines[user] = int(lock.read_text().split()[0])
        assert engines[USERS[0]] != engines[USERS[1]]  # one engine per user
        for me, other in (USERS, USERS[::-1]):
            theirs = str(pids[other])
            for args in (("query", "--pid", theirs, "SELECT 1"),
                         ("trace", "--pid", theirs, "--background", "--no-nccl", "--no-cuda"),
                         ("stack", "--pid", theirs)):  # fmt: skip
                r = _as(me, shared, *args)
                assert r.returncode != 0, (args, r.stdout)
                assert f"belongs to user {other}" in r.stderr, (args, r.stderr)
                assert "Traceback" not in r.stderr, r.stderr
            listed = _as(me, shared, "ps")
            assert listed.returncode == 0, listed.stderr
            assert str(pids[me]) in listed.stdout
            assert theirs not in listed.stdout and str(engines[other]) not in listed.stdout
    finally:
        for p in jobs.values():
            p.send_signal(signal.SIGKILL)
            p.wait()
