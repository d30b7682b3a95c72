"""The one reader of ``/proc`` outside the guest: a process's files
(``/proc/<pid>/...``) and the node's (``/proc/stat``, ``/proc/sys/...``).

psutil answers what it knows (threads, CPU times, children); what it does not
(a thread's kernel state and syscall, the environment a process started with,
its mappings, its ``TracerPid``, a file through its root) is read here, with
one rule for a process that is gone: a file of a pid that no longer exists
raises ``ProcessLookupError`` naming the pid (an ``OSError``, the kernel's own
ESRCH), not a bare ``FileNotFoundError``, so a caller tells "it exited" from
"this file is missing" (a thread gone, a kernel thread's ``exe``).

A pid is a number or ``"self"``. Text is decoded as UTF-8, with what is not
(a thread named with other bytes) replaced, never raised.

The guest keeps its own ``task_stat`` and ``task_syscall``
(``probing.guest.inside``): it runs on the job's Python with the standard
library only. This module imports nothing of probing either, so every module
of the bottom layer (``errors`` among them) may use it.
"""

from __future__ import annotations

import errno
import os
from typing import NamedTuple

ROOT = "/proc"

Pid = int | str  # a process id, or "self"


def path(pid: Pid, name: str = "") -> str:
    """``/proc/<pid>/<name>`` (``/proc/<pid>`` without a name): for what is
    not read whole here, such as ``mem``, ``fd/2`` to write to, or a file
    through ``root``."""
    return f"{ROOT}/{pid}/{name}" if name else f"{ROOT}/{pid}"


def node_path(name: str) -> str:
    """``/proc/<name>``: a file of the node rather than of one process
    (``stat``, ``cpuinfo``, ``sys/kernel/yama/ptrace_scope``)."""
    return f"{ROOT}/{name}"


def exists(pid: Pid, name: str = "") -> bool:
    """Whether process ``pid`` (its file ``name``: ``task/<tid>``) is there now."""
    return os.path.exists(path(pid, name))


def _gone(pid: Pid, err: FileNotFoundError) -> OSError:
    """``ProcessLookupError`` when ``pid`` itself is gone, else ``err`` as it was."""
    if pid != "self" and not exists(pid):
        return ProcessLookupError(errno.ESRCH, f"no process with pid {pid}", err.filename)
    return err


def read_bytes(pid: Pid, name: str) -> bytes:
    """The whole of ``/proc/<pid>/<name>`` (``environ``, ``cmdline``: NUL-separated)."""
    try:
        with open(path(pid, name), "rb") as f:
            return f.read()
    except FileNotFoundError as err:
        raise _gone(pid, err) from None


def read(pid: Pid, name: str) -> str:
    """The whole of ``/proc/<pid>/<name>`` as text (``cgroup``, ``task/<tid>/comm``)."""
    return read_bytes(pid, name).decode(errors="replace")


def readlink(pid: Pid, name: str) -> str:
    """Where the link ``/proc/<pid>/<name>`` points (``exe``, ``ns/pid``, ``fd/2``)."""
    try:
        return os.readlink(path(pid, name))
    except FileNotFoundError as err:
        raise _gone(pid, err) from None


def tasks(pid: Pid) -> list[int]:
    """The ids of the threads of ``pid`` now, in order."""
    try:
        return sorted(int(t) for t in os.listdir(path(pid, "task")))
    except FileNotFoundError as err:
        raise _gone(pid, err) from None


def node(name: str) -> str:
    """The whole of the node's ``/proc/<name>`` as text."""
    with open(node_path(name), "rb") as f:
        return f.read().decode(errors="replace")


# -- parsed forms ----------------------------------------------------------------------


def environ(pid: Pid) -> dict[str, str]:
    """The environment process ``pid`` started with (what it set in itself
    later is not there); empty when unreadable: gone, or another user's."""
    try:
        raw = read_bytes(pid, "environ")
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def status(pid: Pid) -> dict[str, str]:
    """``/proc/<pid>/status`` by field (``Name``, ``State``, ``Uid``,
    ``TracerPid``...), each value stripped."""
    lines = read(pid, "status").splitlines()
    return {k: v.strip() for k, v in (line.split(":\t", 1) for line in lines if ":\t" in line)}


def stat(pid: Pid, tid: int | None = None) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` (of thread ``tid``: ``task/<tid>/stat``)
    after the name, so the state is first and field N of proc(5) is at N - 3;
    ValueError when there is no name to skip."""
    text = read(pid, "stat" if tid is None else f"task/{tid}/stat")
    if ")" not in text:
        raise ValueError(f"no name in {path(pid, 'stat')}: {text[:40]!r}")
    return text.rsplit(")", 1)[1].split()  # the name may hold spaces and ")"


def started(pid: Pid) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (field 22 of
    ``stat``, exactly as the kernel says it): with the pid, what tells it
    from a later process given the same pid. None when it is gone."""
    try:
        return int(stat(pid)[19])
    except (OSError, ValueError, IndexError):
        return None


def running(pid: Pid) -> bool:
    """Whether process ``pid`` runs: it exists and is no zombie (a killed
    process's pid stays until its parent reaps it)."""
    try:
        return stat(pid)[0] not in ("Z", "X")
    except (OSError, ValueError, IndexError):
        return False


def task_stat(tid: int, pid: Pid = "self") -> tuple[str, int] | None:
    """(state letter, utime + stime in clock ticks) of one thread, or None."""
    try:
        fields = stat(pid, tid)
        return fields[0], int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def task_syscall(tid: int, pid: Pid = "self") -> int:
    """The syscall a blocked (or ptrace-stopped) thread sits in; -1 for none."""
    try:
        first = read(pid, f"task/{tid}/syscall").split()[0]
    except (OSError, IndexError):
        return -1
    return -1 if first == "running" else int(first)


class Mapping(NamedTuple):
    """One line of ``/proc/<pid>/maps``."""

    start: int
    end: int
    perms: str  # "r-xp"
    offset: int  # in the file
    path: str  # "" for an anonymous mapping; "[stack]"; "/x (deleted)"


def parse_maps(text: str) -> list[Mapping]:
    """The mappings a ``maps`` file lists (lines too short to be one are skipped)."""
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        lo, hi = parts[0].split("-")
        name = parts[5].strip() if len(parts) == 6 else ""
        out.append(Mapping(int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16), name))
    return out


def maps(pid: Pid = "self") -> list[Mapping]:
    """Every mapping of process ``pid`` now."""
    return parse_maps(read(pid, "maps"))
