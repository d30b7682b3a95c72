"""``probing.proc``, the one reader of /proc outside the guest: read against
this process and a child it starts, one that is gone, and canned text."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from probing import proc
from probing.errors import NoSuchProcess
from probing.procs import syscall_name

# a child that renames its main thread (a name with a space and ")", as a
# thread may have), sets a variable after it started, says so, and blocks in
# read(2) on its stdin until the test closes it
CHILD = """
import os, sys
with open("/proc/self/comm", "w") as f:
    f.write("odd) name")
os.environ["SET_LATER"] = "1"
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def child() -> Iterator[subprocess.Popen[str]]:
    env = dict(os.environ, PROBING_TEST_PROC="given at start")
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    yield p
    p.kill()
    p.wait()


@pytest.fixture
def gone_pid() -> int:
    """The pid of a process that exited and was reaped: nothing has it now."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _blocked(pid: int, timeout: float = 5.0) -> str:
    """The state of ``pid`` once it leaves R (it is on its way into read(2))."""
    deadline = time.monotonic() + timeout
    state = proc.stat(pid)[0]
    while state == "R" and time.monotonic() < deadline:
        time.sleep(0.01)
        state = proc.stat(pid)[0]
    return state


def test_the_environment_is_the_one_the_child_started_with(child) -> None:
    env = proc.environ(child.pid)
    assert env["PROBING_TEST_PROC"] == "given at start"
    assert env["PATH"] == os.environ["PATH"]
    assert "SET_LATER" not in env  # set in itself after it started: not in /proc


def test_the_maps_hold_libpython_or_the_python_binary(child) -> None:
    exe = os.path.realpath(sys.executable)
    for pid in ("self", child.pid):
        paths = {m.path for m in proc.maps(pid)}
        assert exe in paths or any("libpython" in p for p in paths), pid
    stack = [m for m in proc.maps() if m.path == "[stack]"]
    assert len(stack) == 1 and stack[0].start < stack[0].end and "rw" in stack[0].perms


def test_status_fields_name_the_child_its_parent_and_user(child) -> None:
    st = proc.status(child.pid)
    assert st["Name"] == "odd) name"
    assert st["Pid"] == str(child.pid) and st["PPid"] == str(os.getpid())
    assert int(st["Uid"].split()[0]) == os.getuid()
    assert st["TracerPid"] == "0"


def test_stat_skips_a_name_with_spaces_and_a_parenthesis(child) -> None:
    fields = proc.stat(child.pid)
    assert int(fields[1]) == os.getpid()  # field 4, ppid: the name did not shift it
    assert _blocked(child.pid) == "S"
    assert proc.read(child.pid, f"task/{child.pid}/comm").strip() == "odd) name"


def test_a_stopped_child_is_state_t(child) -> None:
    os.kill(child.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5.0
        while proc.stat(child.pid)[0] != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.stat(child.pid)[0] == "T"
        assert proc.task_stat(child.pid, child.pid) is not None
    finally:
        os.kill(child.pid, signal.SIGCONT)


def test_a_thread_reads_its_state_cpu_and_syscall(child) -> None:
    state, ticks = proc.task_stat(os.getpid()) or ("?", -1)
    assert state == "R" and ticks >= 0  # this thread, reading it
    assert proc.tasks(child.pid)[0] == child.pid
    assert _blocked(child.pid) == "S"
    nr = proc.task_syscall(child.pid, child.pid)
    assert nr == -1 or syscall_name(nr) == "read"  # -1: not ours to read (ptrace rules)


def test_links_and_paths_point_into_the_process(child) -> None:
    assert os.path.realpath(proc.readlink(child.pid, "exe")) == os.path.realpath(sys.executable)
    assert proc.path(child.pid, "fd/2") == f"/proc/{child.pid}/fd/2"
    assert proc.exists(child.pid) and proc.exists(child.pid, f"task/{child.pid}")
    assert os.stat(proc.path(child.pid)).st_uid == os.getuid()


def test_the_node_files_are_read_too() -> None:
    assert proc.node("stat").startswith("cpu ")
    assert proc.node_path("sys/kernel/yama/ptrace_scope") == "/proc/sys/kernel/yama/ptrace_scope"


def test_a_gone_process_raises_process_lookup_error_naming_its_pid(gone_pid) -> None:
    assert not proc.exists(gone_pid)
    for read in (
        lambda: proc.read(gone_pid, "status"),
        lambda: proc.status(gone_pid),
        lambda: proc.stat(gone_pid),
        lambda: proc.maps(gone_pid),
        lambda: proc.readlink(gone_pid, "exe"),
        lambda: proc.tasks(gone_pid),
    ):
        with pytest.raises(ProcessLookupError, match=f"no process with pid {gone_pid}"):
            read()
    # the readers of one value answer "nothing" instead, as their callers want
    assert proc.environ(gone_pid) == {}
    assert proc.task_stat(gone_pid, gone_pid) is None
    assert proc.task_syscall(gone_pid, gone_pid) == -1


def test_a_gone_thread_of_a_live_process_is_a_missing_file() -> None:
    with pytest.raises(FileNotFoundError) as err:
        proc.read(os.getpid(), "task/999999999/comm")
    assert not isinstance(err.value, ProcessLookupError)


def test_the_callers_turn_a_gone_process_into_no_such_process(gone_pid) -> None:
    from probing.inject import injector
    from probing.pyframes import outside, remote

    with pytest.raises(NoSuchProcess, match=f"{gone_pid}"):
        injector._status(gone_pid)
    with pytest.raises(NoSuchProcess, match=f"process {gone_pid} has exited"):
        remote.locate(gone_pid)
    with pytest.raises(NoSuchProcess, match=f"no process with pid {gone_pid}"):
        outside.stacks_from_outside(gone_pid)


def test_maps_text_parses_to_mappings() -> None:
    text = (
        "55d0a0000000-55d0a0001000 r--p 00000000 08:01 11   /usr/bin/python3.11\n"
        "7f0000000000-7f0000001000 rw-p 00000000 00:00 0 \n"
        "7f1000000000-7f1000002000 r-xp 00002000 08:01 33   /tmp/x.so (deleted)\n"
        "short line\n"
    )
    maps = proc.parse_maps(text)
    assert [m.path for m in maps] == ["/usr/bin/python3.11", "", "/tmp/x.so (deleted)"]
    assert maps[2] == proc.Mapping(0x7F1000000000, 0x7F1000002000, "r-xp", 0x2000, maps[2].path)
