"""Another local user cannot impersonate a probe or redirect its directory.

A second uid is created for the test (``useradd``, so root); without root the
tests skip, and PROBING_REQUIRE_PRIVILEGED=1 (CI) turns the skip into a
failure. The runtime root is a sticky, world-writable directory like /tmp.
"""

from __future__ import annotations

import os
import pwd
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from probing.cli.client import ProbeClient
from probing.errors import AccessDenied, NoProbe
from tests.conftest import IDLE_LOOP, cli, require

pytestmark = pytest.mark.privileged

FAKE_PROBE = """
import os, socket, sys
path, log = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX)
s.bind(path)
os.chmod(path, 0o777)
s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    try:
        data = c.recv(65536)
        if data:
            with open(log, "ab") as f:
                f.write(data)
            c.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Type: application/json\\r\\n"
                      b"Content-Length: 32\\r\\n\\r\\n" + b'{"result": "42", "output": "  "}')
    except OSError:
        pass
    c.close()
"""


class Attacker:
    def __init__(self, name: str) -> None:
        self.name = name
        info = pwd.getpwnam(name)
        self.uid, self.gid = info.pw_uid, info.pw_gid
        self.procs: list[subprocess.Popen[str]] = []

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self._as(list(argv)), capture_output=True, text=True, timeout=30, check=True
        )

    def start(self, *argv: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(self._as(list(argv)), stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def _as(self, argv: list[str]) -> list[str]:
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", *argv]


@pytest.fixture
def attacker() -> Iterator[Attacker]:
    require(os.geteuid() == 0, "needs root to create a second user (useradd)")
    require(shutil.which("useradd") is not None, "needs useradd")
    require(shutil.which("setpriv") is not None, "needs setpriv (util-linux)")
    name = f"prb-att-{os.getpid() % 100000}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )
    a = Attacker(name)
    try:
        yield a
    finally:
        for p in a.procs:
            p.kill()
            p.wait()
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def shared_root(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A sticky world-writable runtime root, like /tmp (instead of ``runtime_dir``)."""
    root = Path(f"/tmp/probing-imp-{os.getpid()}")
    root.mkdir()
    root.chmod(0o1777)
    monkeypatch.setenv("PROBING_RUNTIME_DIR", str(root))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _python() -> str:
    """An interpreter the other user can run (the venv may be private)."""
    return shutil.which("python3", path="/usr/bin:/bin") or sys.executable


def _stderr_until(proc: subprocess.Popen[str], text: str, timeout: float = 20) -> str:
    fd = proc.stderr.fileno()  # type: ignore[union-attr]
    buf = b""
    deadline = time.monotonic() + timeout
    while text.encode() not in buf or not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        assert left > 0, f"never said {text!r}: {buf!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"exited before saying {text!r}: {buf!r}"
            buf += chunk
    return buf.decode()


def test_a_socket_planted_in_another_users_dir_is_never_used(
    attacker: Attacker, shared_root: Path, spawn
) -> None:
    victim = spawn(IDLE_LOOP, probing=False, env={"PROBING_RUNTIME_DIR": str(shared_root)})
    own = shared_root / f"probing-{attacker.uid}"
    attacker.run(_python(), "-c", f"import os; os.mkdir({str(own)!r}, 0o700)")
    log = f"/tmp/probing-imp-log-{os.getpid()}"
    fake = attacker.start(_python(), "-c", FAKE_PROBE, str(own / f"{victim.pid}.sock"), log)
    assert fake.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
    with pytest.raises(NoProbe):
        ProbeClient.for_pid(victim.pid).eval("open('/etc/hostname').read()")
    r = cli("eval", "--pid", str(victim.pid), "open('/etc/hostname').read()")
    assert r.returncode == 1 and r.stdout == "" and "has no probe" in r.stderr
    assert r.stderr.endswith("\n") and "probing inject" in r.stderr
    assert not os.path.exists(log)  # not one byte reached the attacker
    assert victim.proc.poll() is None


@pytest.mark.parametrize("shape", ["symlink", "their_dir"])
def test_a_dir_another_user_prepared_is_refused(
    attacker: Attacker, shared_root: Path, spawn, shape: str
) -> None:
    mine = shared_root / f"probing-{os.getuid()}"
    theirs = shared_root / "theirs"
    script = f"import os; os.mkdir({str(theirs)!r}, 0o777); os.chmod({str(theirs)!r}, 0o777)"
    if shape == "symlink":
        script += f"; os.symlink({str(theirs)!r}, {str(mine)!r})"
    else:
        script += f"; os.mkdir({str(mine)!r}, 0o700)"
    attacker.run(_python(), "-c", script)
    host = spawn(IDLE_LOOP, wait=False, env={"PROBING_RUNTIME_DIR": str(shared_root)})
    said = _stderr_until(host.proc, "probe not started")
    why = "symbolic link" if shape == "symlink" else f"belongs to uid {attacker.uid}"
    assert why in said and said.endswith("\n")
    assert host.proc.poll() is None  # the host runs on, without a probe
    assert (theirs.stat().st_mode & 0o777) == 0o777 and list(theirs.iterdir()) == []
    with pytest.raises(AccessDenied) as err:
        ProbeClient.for_pid(host.pid)
    assert why.split(" uid")[0] in str(err.value)
    r = cli("query", "--pid", str(host.pid), "SELECT 1")
    assert r.returncode == 1 and r.stderr.endswith("\n") and "remove it" in r.stderr
