"""Python processes on this machine and whether each carries a probe."""

from __future__ import annotations

import os
import re
import socket
from typing import NamedTuple

import psutil

from probing import paths
from probing.guest.inside import task_stat, task_syscall  # noqa: F401 - procs is their home here

_PY_EXE = re.compile(r"^python(\d+(\.\d+)*)?$")


class ProcInfo(NamedTuple):
    pid: int
    user: str
    probe: str  # "yes", "stale" (socket left, nothing answers) or "-"
    cmdline: str


def _maps_has_libpython(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libpython" in line for line in f)
    except OSError:
        return False


def is_python(proc: psutil.Process) -> bool:
    try:
        exe = os.path.basename(proc.exe() or "")
    except (psutil.Error, OSError):
        exe = ""
    if _PY_EXE.match(exe):
        return True
    try:
        name = proc.name()
    except psutil.Error:
        name = ""
    return bool(_PY_EXE.match(name)) or _maps_has_libpython(proc.pid)


def socket_alive(path: str, timeout: float = 0.3) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def python_processes() -> list[ProcInfo]:
    sockets = paths.all_sockets()
    me = os.getpid()
    out = []
    for proc in psutil.process_iter(["pid", "username", "cmdline"]):
        pid = proc.info["pid"]
        if pid == me or not (pid in sockets or is_python(proc)):
            continue
        path = sockets.get(pid)
        probe = "-" if path is None else ("yes" if socket_alive(path) else "stale")
        cmd = " ".join(proc.info.get("cmdline") or []) or f"[{proc.name()}]"
        out.append(ProcInfo(pid, proc.info.get("username") or "?", probe, cmd))
    return sorted(out)
