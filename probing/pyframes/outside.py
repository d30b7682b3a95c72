"""``probing stack`` without the probe: ``process.stacks`` rows read from outside."""

from __future__ import annotations

from typing import Any

from probing import proc
from probing.errors import no_such_pid
from probing.procs import syscall_name
from probing.pyframes import remote


def _comm(pid: int, tid: int) -> str:
    try:
        return proc.read(pid, f"task/{tid}/comm").strip()
    except OSError:
        return f"thread {tid}"


def _state(pid: int, tid: int) -> tuple[str, str | None]:
    stat = proc.task_stat(tid, pid)
    if stat is None:
        return "exited", None
    if stat[0] == "R":
        return "active", None
    nr = proc.task_syscall(tid, pid)
    if nr < 0:
        return "idle", None
    return ("waiting" if syscall_name(nr) == "futex" else "idle"), syscall_name(nr)


def stacks_from_outside(pid: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(process info, frame rows) as ``probing stack`` prints them."""
    if not proc.exists(pid):
        raise no_such_pid(pid)
    interp, threads = remote.dump(pid)
    try:
        raw = proc.read_bytes(pid, "cmdline")
        cmdline = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmdline = "?"
    try:
        exe = proc.readlink(pid, "exe")
    except OSError:
        exe = interp.executable
    info = {"pid": pid, "cmdline": cmdline, "python": interp.python, "python_executable": exe}
    rows = []
    for t in reversed(threads):  # the interpreter lists the newest first: main first
        state, syscall = _state(pid, t.native_id) if t.native_id > 0 else ("unknown", None)
        head = {
            "tid": t.native_id if t.native_id > 0 else None,
            "thread": _comm(pid, t.native_id),
            "state": state,
            "syscall": syscall,
            "cpu_pct": None,
            "daemon": None,
        }
        for depth, fr in enumerate(t.frames):
            rows.append({**head, "depth": depth, "func": fr.func, "file": fr.file, "line": fr.line})
    return info, rows
