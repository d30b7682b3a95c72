"""``probing inject`` against real processes started without probing.

Needs ptrace (root here); PROBING_REQUIRE_PRIVILEGED=1 (CI) turns the skip
into a failure. Targets run three different interpreters: this venv's
python (probing importable), the pyenv base python (libpython, another
environment) and Debian's statically linked /usr/bin/python3.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from probing import paths
from probing.cli import doctor
from probing.cli.client import ProbeClient
from probing.guest import place
from probing.inject import inject
from tests.conftest import SLOWDOWN, cli, require

pytestmark = pytest.mark.privileged

BASE_PYTHON = os.path.join(
    sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}"
)
STATIC_PYTHON = "/usr/bin/python3"

CHECKSUM = """
import hashlib, sys, time
k = 0
while True:
    h = hashlib.sha256()
    for i in range(20000):
        h.update(i.to_bytes(4, "little"))
    print(k, h.hexdigest(), flush=True)
    k += 1
    time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def expected_checksum() -> str:
    h = hashlib.sha256()
    for i in range(20000):
        h.update(i.to_bytes(4, "little"))
    return h.hexdigest()


@pytest.fixture(autouse=True)
def _ptrace_allowed() -> None:
    require(doctor.check_ptrace().ok, "ptrace is not permitted here")


def _tracer(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("TracerPid:")).split()[1])


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _untouched(pid: int) -> None:
    assert os.path.exists(f"/proc/{pid}"), "target died"
    assert _tracer(pid) == 0, "a tracer is still attached"
    assert _state(pid) not in ("t", "T"), "target left stopped"


def _lines_ok(out: str, want: str, first: int = 1) -> int:
    """Every complete line is ``k checksum`` with k counting up from ``first``."""
    lines = out.splitlines()[: out.count("\n")]  # a kill may cut the last line short
    assert lines, "the target printed nothing"
    for n, line in enumerate(lines, first):
        k, digest = line.split()
        assert int(k) == n and digest == want, f"line {n} wrong: {line}"
    return len(lines)


def _first_line(t) -> str:  # type: ignore[no-untyped-def]
    """Read one line unbuffered, so communicate() later gets every byte after it."""
    fd, line = t.proc.stdout.fileno(), b""
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            raise AssertionError(f"target exited: {t.proc.communicate()}")
        line += byte
    return line.decode()


def _available(path: str) -> None:
    if not os.access(path, os.X_OK):
        pytest.skip(f"{path} is not installed")


def test_inject_busy_loop_answers_sql_and_computes_right(spawn) -> None:
    t = spawn(CHECKSUM, probing=False)
    _first_line(t)  # running
    res = inject(t.pid, timeout=10 * SLOWDOWN)
    assert not res.already and res.tid == t.pid and res.engine_pid > 0
    client = ProbeClient.for_pid(t.pid, timeout=30 * SLOWDOWN)
    assert client.query("SELECT pid FROM process.info").to_pylist() == [{"pid": t.pid}]
    for _ in range(49):  # later injects are no-ops; every query is answered
        again = inject(t.pid)
        assert again.already and again.socket == res.socket
        assert client.query("SELECT count(*) AS n FROM process.threads").column(0)[0].as_py() >= 2
    _untouched(t.pid)
    t.proc.kill()
    out, _ = t.proc.communicate(timeout=10)
    assert _lines_ok(out, expected_checksum()) >= 1


def test_the_engine_loads_its_libraries_before_the_first_query_and_the_job_none(spawn) -> None:
    """After an inject the engine (beside the job) loads datafusion at once,
    for the query that follows; the job itself never maps it."""
    t = spawn(CHECKSUM, probing=False)
    _first_line(t)
    res = inject(t.pid, timeout=30 * SLOWDOWN)
    deadline = time.monotonic() + 30 * SLOWDOWN
    while "datafusion" not in Path(f"/proc/{res.engine_pid}/maps").read_text():  # no query asked
        assert time.monotonic() < deadline, "the engine never loaded its libraries"
        time.sleep(0.05)
    stacks = cli("query", "-p", str(t.pid), "-f", "json", "SELECT thread FROM process.stacks")
    assert stacks.returncode == 0 and "probing-" not in stacks.stdout  # the guest's threads
    maps = Path(f"/proc/{t.pid}/maps").read_text()
    assert "datafusion" not in maps and "libarrow" not in maps and "numpy" not in maps
    _untouched(t.pid)
    t.proc.kill()
    out, _ = t.proc.communicate(timeout=10)
    assert _lines_ok(out, expected_checksum()) >= 1


def test_the_hosts_gil_switch_interval_comes_back_after_the_load(spawn) -> None:
    """The guest loads with a short switch interval (the injector's boot
    holds it); once it is loaded and has answered, the host has its own
    interval back, not a default and not ours."""
    t = spawn(
        "import sys, time\nsys.setswitchinterval(0.007)\nwhile True:\n"
        "    print(time.monotonic(), round(sys.getswitchinterval(), 6), flush=True)\n"
        "    time.sleep(0.02)\n",
        probing=False,
    )
    _first_line(t)
    start = time.monotonic()
    inject(t.pid, timeout=10 * SLOWDOWN)
    client = ProbeClient.for_pid(t.pid, timeout=30 * SLOWDOWN)
    assert client.query("SELECT pid FROM process.info").num_rows == 1
    deadline = time.monotonic() + 30 * SLOWDOWN
    while not client.health()["database_loaded"]:
        assert time.monotonic() < deadline, "the engine was never preloaded"
        time.sleep(0.05)
    loaded = time.monotonic()
    seen = set()
    while True:
        at, interval = map(float, _first_line(t).split())
        if at > start:
            seen.add(interval)
        if at > loaded and interval == 0.007:
            break
        assert time.monotonic() < deadline, f"the host's interval stays {interval}, not 0.007"
    assert seen - {0.007} <= {0.00005, 0.0005}, seen  # ours while loading or serving
    _untouched(t.pid)


def test_fifty_fresh_processes(spawn, tmp_path: Path) -> None:
    """50 processes (static Debian python: another environment), each injected once."""
    _available(STATIC_PYTHON)
    want = expected_checksum()
    for batch in range(10):
        targets = [
            spawn(None, probing=False, argv=[STATIC_PYTHON, "-c", CHECKSUM, "0.02"], cwd=tmp_path)
            for _ in range(5)
        ]
        for t in targets:
            assert _first_line(t).startswith("0 ")
            res = inject(t.pid)
            assert not res.already and res.engine_pid > 0, res
            rows = ProbeClient.for_pid(t.pid).query("SELECT pid FROM process.info").to_pylist()
            assert rows == [{"pid": t.pid}], f"batch {batch}"
        for t in targets:
            _untouched(t.pid)
            t.proc.kill()
            out, err = t.proc.communicate(timeout=10)
            _lines_ok(out, want)
            assert "Traceback" not in err


def test_main_thread_blocked_in_recv(spawn, tmp_path: Path) -> None:
    """The GIL is released in recv(): the boot thread takes it; recv restarts intact."""
    path = str(tmp_path / "s")
    code = f"""
    import socket
    srv = socket.socket(socket.AF_UNIX)
    srv.bind({path!r})
    srv.listen(1)
    print("listening", flush=True)
    conn, _ = srv.accept()
    print("got", conn.recv(100).decode(), flush=True)
    """
    t = spawn(code, probing=False, argv=[BASE_PYTHON, "-c", textwrap.dedent(code)], cwd=tmp_path)
    assert _first_line(t).strip() == "listening"
    peer = socket.socket(socket.AF_UNIX)
    peer.connect(path)
    time.sleep(0.2)  # the main thread is now inside recv
    with open(f"/proc/{t.pid}/syscall") as f:
        assert f.read().split()[0] in ("45", "207", "63")  # recvfrom / read
    inject(t.pid, timeout=2.0)  # the probe must start while main never takes the GIL
    rows = (
        ProbeClient.for_pid(t.pid)
        .query("SELECT name, is_main FROM process.threads WHERE is_main")
        .to_pylist()
    )
    assert rows == [{"name": "MainThread", "is_main": True}]
    _untouched(t.pid)
    peer.sendall(b"hello")
    out, err = t.proc.communicate(timeout=10)
    assert out.splitlines()[-1] == "got hello" and t.proc.returncode == 0
    assert err == "", "the target's exit complained"


THREE_THREADS = """
import socket, threading, time

def sleeper():
    while True:
        time.sleep(0.05)  # @sleeper

def receiver():
    a, b = socket.socketpair()
    a.recv(10)  # @receiver

def spinner():
    x = 0
    while True: x += 1  # @spinner

for fn in (sleeper, receiver, spinner):
    threading.Thread(target=fn, name=fn.__name__ + "-thread", daemon=True).start()
print("started", flush=True)
threading.Event().wait()  # @main
"""


def test_stack_shows_three_named_threads(spawn) -> None:
    t = spawn(THREE_THREADS, probing=False)
    _first_line(t)
    marks = {
        line.rsplit("# @", 1)[1]: n
        for n, line in enumerate(textwrap.dedent(THREE_THREADS).splitlines(), 1)
        if "# @" in line
    }
    out = cli("stack", "--pid", str(t.pid))  # injects first
    assert out.returncode == 0, out.stderr
    assert "injected a probe" in out.stderr
    blocks = {b.splitlines()[0]: b for b in out.stdout.split("\n\n")[1:]}
    for name in ("sleeper", "receiver", "spinner"):
        head = next(h for h in blocks if f'"{name}-thread"' in h)
        assert f"    {name} (<string>:{marks[name]})" in blocks[head], blocks[head]
    assert next(h for h in blocks if "(idle, in recvfrom)" in h or "(idle, in read)" in h)
    assert any('(active): "spinner-thread"' in h for h in blocks)
    main = next(h for h in blocks if '"MainThread"' in h)
    assert f"<module> (<string>:{marks['main']})" in blocks[main]
    assert not any("probing-" in h for h in blocks), "the probe's own threads are hidden"
    # the same from SQL and as JSON
    js = cli("stack", "--pid", str(t.pid), "--format", "json")
    assert '"thread": "spinner-thread"' in js.stdout


def test_eval(spawn) -> None:
    t = spawn("import time\nCOUNTER = 41\nwhile True: time.sleep(0.05)\n", probing=False)
    time.sleep(0.3)
    none = cli("eval", "--pid", str(t.pid), "COUNTER + 1")
    assert none.returncode == 1 and "has no probe" in none.stderr
    out = cli("eval", "--pid", str(t.pid), "--inject", "COUNTER + 1")
    assert out.returncode == 0 and out.stdout.strip() == "42", out.stderr
    out = cli("eval", "-p", str(t.pid), "COUNTER = 7; print('set', COUNTER)")
    assert out.stdout == "set 7\n"
    assert cli("eval", "-p", str(t.pid), "COUNTER").stdout.strip() == "7"
    bad = cli("eval", "-p", str(t.pid), "print('before'); 1/0")
    assert bad.returncode == 1
    assert "before" in bad.stderr and "ZeroDivisionError" in bad.stderr
    assert "probing/" not in bad.stderr, "probing's own frames are not shown"


def test_errors_leave_targets_untouched(spawn) -> None:
    sleeper = subprocess.Popen(["sleep", "100"])
    try:
        out = cli("inject", "--pid", str(sleeper.pid))
        assert out.returncode == 1
        assert out.stderr.count("\n") == 1 and "not a Python process" in out.stderr
        _untouched(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()

    gone = cli("inject", "--pid", "999999999")
    assert gone.returncode == 1 and "no process with pid" in gone.stderr

    t = spawn("import time\nwhile True: time.sleep(0.05)\n", probing=False)
    os.kill(t.pid, signal.SIGSTOP)
    try:
        time.sleep(0.1)
        out = cli("inject", "--pid", str(t.pid))
        assert out.returncode == 1 and "is stopped" in out.stderr and "kill -CONT" in out.stderr
    finally:
        os.kill(t.pid, signal.SIGCONT)


def test_no_permission(spawn) -> None:
    """root without CAP_SYS_PTRACE (a container without SYS_PTRACE) vs another user's process."""
    _available(STATIC_PYTHON)
    if not shutil.which("setpriv") or os.geteuid() != 0:
        require(False, "needs root and setpriv")
    t = spawn(
        None,
        probing=False,
        argv=["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
              STATIC_PYTHON, "-c", "import time\nwhile True: time.sleep(0.05)\n"],
    )  # fmt: skip
    time.sleep(0.3)
    out = subprocess.run(
        ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace",
         sys.executable, "-m", "probing", "inject", "--pid", str(t.pid)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1, out.stderr
    assert "not permitted" in out.stderr and "CAP_SYS_PTRACE" in out.stderr
    _untouched(t.pid)


def test_traced_target_is_refused(spawn) -> None:
    from probing.inject.arch import native
    from probing.inject.ptrace import Tracee

    t = spawn("import time\nwhile True: time.sleep(0.05)\n", probing=False)
    time.sleep(0.2)
    tracee = Tracee(t.pid, t.pid, native())
    tracee.seize_and_stop()
    try:
        out = cli("inject", "--pid", str(t.pid))
        assert out.returncode == 1 and f"being traced by pid {os.getpid()}" in out.stderr
    finally:
        tracee.detach()
    _untouched(t.pid)


SIGTERM_MIDWAY = """
import os, signal, sys, time
from probing.inject import injector
real = injector._run_in_target
def slow(target, tracee, lib, source):
    os.kill(os.getpid(), signal.SIGTERM)  # arrives while the thread is borrowed
    time.sleep(0.3)
    return real(target, tracee, lib, source)
injector._run_in_target = slow
injector.inject(int(sys.argv[1]))
print("survived SIGTERM")
"""


def test_injector_killed_midway_leaves_no_thread_stopped(spawn) -> None:
    t = spawn(CHECKSUM, probing=False)
    _first_line(t)
    out = subprocess.run(
        [sys.executable, "-c", SIGTERM_MIDWAY, str(t.pid)], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == -signal.SIGTERM and "survived" not in out.stdout
    _untouched(t.pid)
    time.sleep(0.5)  # still computing, still right
    t.proc.kill()
    done, _ = t.proc.communicate(timeout=10)
    assert _lines_ok(done, expected_checksum()) >= 2


def test_target_killed_midway_is_reported(spawn, monkeypatch) -> None:
    from probing.errors import NoSuchProcess
    from probing.inject import injector

    t = spawn(CHECKSUM, probing=False)
    _first_line(t)
    real = injector._run_in_target

    def killed(target, tracee, lib, source):  # type: ignore[no-untyped-def]
        os.kill(target.pid, signal.SIGKILL)  # dies while its thread is borrowed
        return real(target, tracee, lib, source)

    monkeypatch.setattr(injector, "_run_in_target", killed)
    with pytest.raises(NoSuchProcess, match="exited during injection"):
        inject(t.pid)


def test_unsupported_python_is_refused(spawn, monkeypatch) -> None:
    from probing import pyframes
    from probing.errors import AttachError

    t = spawn("import time\nwhile True: time.sleep(0.05)\n", probing=False)
    time.sleep(0.2)
    monkeypatch.setattr(pyframes, "SUPPORTED", ("3.99",))
    with pytest.raises(AttachError, match=r"does not support \(supported: 3\.99\)"):
        inject(t.pid)
    _untouched(t.pid)
    ps = cli("ps")
    assert any(line.split()[:3] == [str(t.pid), "root", "-"] for line in ps.stdout.splitlines())


def test_a_stale_socket_of_a_reused_pid_is_replaced(tmp_path: Path) -> None:
    """pids are reused (pid_max is often 32768): a socket file left by a killed
    process answers nobody; ``probing trace`` on the new process with that pid
    starts a probe in it rather than failing with "no probe answers"."""
    host = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"])
    try:
        path = paths.socket_path(host.pid)
        place.ensure_private_dir(os.path.dirname(path))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        with socket.socket(socket.AF_UNIX) as stale:  # bound, then closed: nobody listens
            stale.bind(path)
        os.chmod(path, 0o600)
        r = cli("trace", "--pid", str(host.pid), "--no-nccl", "--no-cuda", "--background")
        assert r.returncode == 0, r.stderr
        assert f"injected a probe into pid {host.pid}" in r.stderr
        assert ProbeClient.for_pid(host.pid).trace_status()["state"] == "tracing"
    finally:
        host.kill()
        host.wait()
