"""The fleet on first contact (issue 51): ports that never collide, a label
per job, nothing written into a job's files, no fixed timeout at a compile.

Ports: an engine takes its peer port from ``PROBING_PORT_RANGE``, which the
agent's port is outside of, and never the agent's port; a port another
process holds gives every daemon of ours one line naming that process (pid
and command), and the agent exit status 78, never a traceback. Labels: two
plain torchrun jobs (torchrun's default run id ``none``) are two jobs, and
every node of one job says the same. ``tell``: a finding goes to a job's
stderr only where that is a terminal or a pipe. ``wait_out``: a wait for an
answer goes on for as long as a BPF compile does.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pty
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from probing import config, errors
from probing.node import agent
from probing.node.cluster import identity, port
from probing.node.service import warm
from tests.conftest import IDLE_LOOP, SLOWDOWN

TOKEN = "t0ken-for-tests"

# this process's command, as /proc says it (argv[0] as the test runner was started)
THIS = open(f"/proc/{os.getpid()}/cmdline", "rb").read().split(b"\0")[0].decode()


@contextlib.contextmanager
def held(n: int = 1) -> Iterator[list[int]]:
    """``n`` consecutive ports of this node listened on by this process (the
    "another program" of the issue), released at the end."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + n > 65535:
            continue
        socks = []
        try:
            for p in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
                s.listen(1)
        except OSError:
            for s in socks:
                s.close()
            continue
        try:
            yield list(range(first, first + n))
        finally:
            for s in socks:
                s.close()
        return
    raise AssertionError("no run of free ports on this node")


def free_run(n: int) -> int:
    """The first of ``n`` consecutive ports free now."""
    with held(n) as ports:
        return ports[0]


def _python_agent(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "probing", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout * SLOWDOWN,
    )


# -- ports -----------------------------------------------------------------------------


def test_the_engines_ports_leave_the_agents_out() -> None:
    defaults = config.from_env({})
    ports = port.peer_ports(defaults)
    assert defaults.agent_port == 9978 and 9978 not in ports
    assert ports[0] == 9979 and len(ports) == 32 and ports == sorted(ports)
    lo, hi = port.port_range(defaults.port_range)
    assert not lo <= defaults.agent_port <= hi  # outside the range, as docs/config.md says
    # a range set to hold the agent's port: it is left out all the same
    inside = config.from_env({"PROBING_PORT_RANGE": "9977-9980"})
    assert port.peer_ports(inside) == [9977, 9979, 9980]
    moved = config.from_env({"PROBING_PORT_RANGE": "9977-9980", "PROBING_AGENT_PORT": "9979"})
    assert port.peer_ports(moved) == [9977, 9978, 9980]
    for bad in ("9980", "a-b", "10-5", "0-3", "9000-70000"):  # never a reason to stop an engine
        assert port.port_range(bad) == port.DEFAULT_RANGE, bad


class FakeServer:
    """``listen_tcp`` as the engine's server does it, the ports in ``taken``
    held by others; the ports tried, in order."""

    def __init__(self, taken: set[int]) -> None:
        self.taken = taken
        self.tried: list[int] = []

    def listen_tcp(self, host: str, p: int, token: Any) -> tuple[str, int]:
        self.tried.append(p)
        if p in self.taken:
            raise OSError(errno.EADDRINUSE, "Address already in use")
        return host, p or 40000


def test_a_second_engine_never_takes_the_agents_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case: 9977 held by an engine, the next engine took 9978."""
    for name in ("PROBING_PORT_RANGE", "PROBING_AGENT_PORT", "PROBING_PORT"):
        monkeypatch.delenv(name, raising=False)
    server = FakeServer(taken={9977, 9979})
    node = port.NodePort(server)
    assert node._listen("127.0.0.1") == ("127.0.0.1", 9980)
    assert 9978 not in server.tried and server.tried == [9979, 9980]
    # the whole range held: any free port, never the agent's
    server = FakeServer(taken=set(range(9979, 10011)))
    assert port.NodePort(server)._listen("127.0.0.1") == ("127.0.0.1", 40000)
    assert server.tried[-1] == 0 and 9978 not in server.tried


def test_an_explicit_port_held_names_its_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    with held() as [p]:
        server = FakeServer(taken={p})
        with pytest.raises(port.PortHeld) as err:
            port.NodePort(server, port=p)._listen("127.0.0.1")
    # the holder's command line as it was typed (a relative .venv/bin/python, as make test's)
    assert f"held by pid {os.getpid()} (" in str(err.value) and THIS in str(err.value)
    assert "PROBING_PORT" in str(err.value)


def test_the_holder_of_a_port_is_named_by_pid_and_command() -> None:
    with held() as [p]:
        who = port.holder(p)
    assert who.startswith(f"pid {os.getpid()} (") and THIS in who, who
    assert port.holder(p) == ""  # released: nobody
    err = port.cannot_bind("x", "127.0.0.1", p, OSError(errno.EACCES, "Permission denied"), "h")
    assert not isinstance(err, port.PortHeld) and "Permission denied" in str(err)


def test_the_agent_says_who_holds_its_port_in_one_line_and_exits_78(tmp_path: Path) -> None:
    """Before: a traceback ending ``OSError: [Errno 98] Address already in
    use``, exit status 1, which systemd's Restart=always ran again every 2 s."""
    env = {"PROBING_RUNTIME_DIR": str(tmp_path)}
    with held() as [p]:
        r = _python_agent("agent", "--no-attach", "--port", str(p), env=env)
    assert r.returncode == agent.EX_CONFIG == 78, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.fullmatch(
        rf"probing: error: the agent cannot listen on 127\.0\.0\.1:{p}: held by pid "
        rf"{os.getpid()} \(.*python.*\) \(stop it, or give the agent another port: .*\)",
        lines[0],
    ), lines[0]


def test_the_agent_refuses_a_port_an_engine_could_take(tmp_path: Path) -> None:
    r = _python_agent("agent", "--no-attach", "--port", "9990",
                      env={"PROBING_RUNTIME_DIR": str(tmp_path)})  # fmt: skip
    assert r.returncode == 78 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "PROBING_PORT_RANGE 9979-10010" in r.stderr and "Traceback" not in r.stderr


def test_the_unit_does_not_restart_an_agent_that_cannot_start_as_set_up() -> None:
    text = (Path(__file__).parent.parent / "deploy/systemd/probing-agent.service").read_text()
    assert f"RestartPreventExitStatus={agent.EX_CONFIG}" in text
    assert "StartLimitIntervalSec=" in text and "StartLimitBurst=" in text


@pytest.mark.parametrize("daemon", ["mcp", "ui"])
def test_ui_and_mcp_name_who_holds_their_port(daemon: str, tmp_path: Path) -> None:
    with held() as [p]:
        if daemon == "mcp":
            r = _python_agent("mcp", "--http", "--port", str(p))
        else:
            r = _python_agent("ui", "--pid", str(os.getpid()), "--port", str(p))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert f"probing {daemon} cannot listen on 127.0.0.1:{p}: held by pid {os.getpid()}" in line


def test_with_the_first_port_held_the_engine_leaves_the_agents_port_free(
    spawn: Any, runtime_dir: Path, tmp_path: Path
) -> None:
    """The issue's "done when", on ports of this test's own: the first port
    of the engines' range held by another program and a job's engine up
    (the range set to hold the agent's port, to show it is left out all the
    same), the agent's port stays free and the agent starts on it."""
    dist = pytest.importorskip("torch.distributed")
    from tests.test_cluster import wait_ready

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first = free_run(4)
    with socket.socket() as holder:  # another program's: the range's first port
        holder.bind(("127.0.0.1", first))
        holder.listen(1)
        mine = first + 1
        env = {
            "PROBING_PORT_RANGE": f"{first}-{first + 3}", "PROBING_AGENT_PORT": str(mine),
            "PROBING_TOKEN": TOKEN, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master.port), "TORCHELASTIC_RUN_ID": f"ports-{os.getpid()}",
            "RANK": "0", "LOCAL_RANK": "0",
        }  # fmt: skip
        try:
            rank = spawn(IDLE_LOOP, env=env)
            addr = wait_ready(rank.pid, timeout=90 * SLOWDOWN)["cluster"]["addr"]
            assert addr == f"127.0.0.1:{first + 2}", addr  # past the held port and the agent's
            assert port.holder(mine) == ""
            agent_env = {**os.environ, "PROBING_RUNTIME_DIR": str(tmp_path)}
            proc = subprocess.Popen(
                [sys.executable, "-m", "probing", "agent", "--no-attach", "--port", str(mine)],
                env=agent_env, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            try:
                line = proc.stderr.readline() if proc.stderr else ""
                assert f"on 127.0.0.1:{mine};" in line, line
            finally:
                proc.terminate()
                proc.wait(timeout=30 * SLOWDOWN)
        finally:
            del master


# -- a label per job -------------------------------------------------------------------


def _torchrun_env(master_port: int, node: int, local: int, run_id: str = "none") -> dict[str, str]:
    """A worker's environment as torchrun (2 nodes x 2 processes) gives it."""
    return {
        "TORCHELASTIC_RUN_ID": run_id, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": str(master_port),
        "RANK": str(2 * node + local), "LOCAL_RANK": str(local), "GROUP_RANK": str(node),
        "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0",
    }  # fmt: skip


def test_two_plain_torchrun_jobs_on_a_node_are_two_jobs_and_one_on_every_node() -> None:
    """Before: ``torchelastic_run_id=none`` for every plain torchrun job."""
    a = {identity.job_label(_torchrun_env(29500, 0, r)) for r in (0, 1)}
    b = {identity.job_label(_torchrun_env(29501, 0, r)) for r in (0, 1)}
    assert a == {"rendezvous=10.0.0.1:29500"} and b == {"rendezvous=10.0.0.1:29501"}
    other_node = {identity.job_label(_torchrun_env(29500, 1, r)) for r in (0, 1)}
    assert other_node == a  # every node of the job: the same label
    assert agent._job(_torchrun_env(29500, 0, 0)) != agent._job(_torchrun_env(29501, 0, 0))


def test_a_run_id_the_launcher_set_names_the_job() -> None:
    env = _torchrun_env(29500, 1, 1, run_id="7f3a")
    assert identity.job_label(env) == "torchelastic_run_id=7f3a"
    assert identity.job_label({**env, "SLURM_JOB_ID": "12"}) == "torchelastic_run_id=7f3a"
    plain_in_slurm = {**_torchrun_env(29500, 0, 0), "SLURM_JOB_ID": "12", "SLURM_PROCID": "0"}
    assert identity.job_label(plain_in_slurm) == "slurm_job_id=12"
    assert identity.job_label({"PMIX_NAMESPACE": "prterun-n0-1@1", "PMIX_RANK": "3"}) == (
        "pmix_namespace=prterun-n0-1@1"
    )
    assert identity.job_label({"MASTER_PORT": "1", "RANK": "0"}) == "master_port=1"
    assert identity.job_label({}) == "?"


# -- nothing written into the job's files -----------------------------------------------


def _stderr_of(pid: int) -> str:
    return f"/proc/{pid}/fd/2"


def test_a_finding_never_goes_into_a_file_the_job_writes(tmp_path: Path, capfd: Any) -> None:
    """``probing: finding ...`` for a job run with ``> log 2>&1``: its log keeps
    exactly what the job wrote, and the line goes to our own log."""
    log = tmp_path / "train.log"
    with open(log, "wb") as out:  # as a shell's `>` opens it: no O_APPEND
        job = subprocess.Popen(
            [sys.executable, "-c", "import sys, time\nsys.stderr.write('step 1\\n')\n"
             "sys.stderr.flush()\ntime.sleep(60)"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30 * SLOWDOWN
        while log.read_bytes() != b"step 1\n":
            assert time.monotonic() < deadline, log.read_bytes()
            time.sleep(0.05)
        mtime = log.stat().st_mtime_ns
        errors.tell("finding: rank 1 is 60 ms late each step", job.pid)
        assert log.read_bytes() == b"step 1\n" and log.stat().st_mtime_ns == mtime
        assert "probing: finding: rank 1 is 60 ms late" in capfd.readouterr().err
    finally:
        job.kill()
        job.wait()


def test_a_finding_goes_to_a_jobs_terminal_or_pipe(capfd: Any) -> None:
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                           stderr=subprocess.PIPE)  # fmt: skip
    leader, follower = pty.openpty()
    tty_job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               stderr=follower)  # fmt: skip
    os.close(follower)
    try:
        errors.tell("finding: through the pipe", job.pid)
        errors.tell("finding: on the terminal", tty_job.pid)
        assert job.stderr is not None
        assert job.stderr.readline() == b"probing: finding: through the pipe\n"
        got = b""
        deadline = time.monotonic() + 10 * SLOWDOWN
        while b"\n" not in got and time.monotonic() < deadline:
            got += os.read(leader, 1024)
        assert got.replace(b"\r", b"") == b"probing: finding: on the terminal\n"
        assert "through the pipe" not in capfd.readouterr().err  # told once, there
    finally:
        for p in (job, tty_job):
            p.kill()
            p.wait()
        os.close(leader)


def test_a_pipe_nobody_reads_never_blocks_a_finding(capfd: Any) -> None:
    """A job whose stderr pipe is full (its reader stopped reading): the
    engine's line goes to its own log instead of waiting."""
    r, w = os.pipe()
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stderr=w)
    os.close(w)
    try:
        os.set_blocking(r, False)
        fd = os.open(_stderr_of(job.pid), os.O_WRONLY | os.O_NONBLOCK)
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(fd, b"x" * 65536)
        os.close(fd)
        t0 = time.monotonic()
        errors.tell("finding: a full pipe", job.pid)
        assert time.monotonic() - t0 < 5
        assert "probing: finding: a full pipe" in capfd.readouterr().err
    finally:
        job.kill()
        job.wait()
        os.close(r)


# -- a wait for a compile ---------------------------------------------------------------


def test_a_wait_goes_on_while_a_compile_does_and_says_so(tmp_path: Path) -> None:
    """A process holding a compile lock open (what ``loader.obtain`` does
    while BCC compiles) is compiling; an answer that takes longer than the
    quiet budget comes all the same, after one line saying why."""
    lock = tmp_path / "gloo-0123456789abcdef0123456789abcdef.json.lock"
    lock.touch()
    compiler = subprocess.Popen(
        [sys.executable, "-c", f"import time; f = open({str(lock)!r}); time.sleep(60)"]
    )
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30 * SLOWDOWN
        while not warm.compiling(compiler.pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert warm.compiling(os.getpid())  # a process it started (an engine's warm-up)
        assert not warm.compiling(idle.pid) and not warm.compiling(None)
        said: list[str] = []
        done = threading.Event()
        threading.Timer(3.0, done.set).start()
        threading.Timer(2.5, compiler.kill).start()  # the compile ends just before the answer

        def answer() -> str:
            done.wait()
            return "tracing"

        assert warm.wait_out(answer, compiler.pid, 1.0, said.append) == "tracing"
        assert said[0] == warm.WAITING and "compiled" in said[-1], said
        with pytest.raises(TimeoutError):  # no compile: the quiet budget is the limit
            warm.wait_out(lambda: time.sleep(5), compiler.pid, 0.5, said.append)
        with pytest.raises(ValueError, match="refused"):  # the call's own error, raised here

            def refused() -> None:
                raise ValueError("refused")

            warm.wait_out(refused, None, 5.0, said.append)
    finally:
        for p in (compiler, idle):
            p.kill()
            p.wait()
