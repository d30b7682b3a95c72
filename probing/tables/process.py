"""``process.info`` and ``process.threads``: the process the probe describes.

Read from outside (``/proc``, psutil) and from the process itself (its
Python and its ``threading`` names, through its target). A process that
has exited still has its last ``info``; its ``threads`` are none.
"""

from __future__ import annotations

import socket
from typing import Any

import psutil
import pyarrow as pa

from probing.config import VERSION
from probing.errors import ProbingError
from probing.guest.inside import task_stat

INFO_SCHEMA = pa.schema(
    [
        ("pid", pa.int64()),
        ("ppid", pa.int64()),
        ("hostname", pa.string()),
        ("exe", pa.string()),
        ("cmdline", pa.string()),
        ("cwd", pa.string()),
        ("username", pa.string()),
        ("python", pa.string()),
        ("python_executable", pa.string()),
        ("started_ns", pa.int64()),
        ("rss_bytes", pa.int64()),
        ("vms_bytes", pa.int64()),
        ("num_threads", pa.int64()),
        ("cpu_user_s", pa.float64()),
        ("cpu_system_s", pa.float64()),
        ("probing_version", pa.string()),
        ("probe_started_ns", pa.int64()),
        ("alive", pa.bool_()),
    ]
)


def _about(target: Any) -> dict[str, Any]:
    try:
        about: dict[str, Any] = target.info()
        return about
    except ProbingError:
        return {}


def info(target: Any) -> pa.Table:
    about = _about(target)
    row: dict[str, Any] = {
        "pid": target.pid,
        "hostname": socket.gethostname(),
        "python": about.get("python"),
        "python_executable": about.get("executable"),
        "probing_version": VERSION,
        "probe_started_ns": about.get("probe_started_ns"),
        "alive": target.alive(),
    }
    try:
        proc = psutil.Process(target.pid)
        with proc.oneshot():
            mem = proc.memory_info()
            cpu = proc.cpu_times()
            row.update(
                ppid=proc.ppid(),
                exe=_safe(proc.exe),
                cmdline=" ".join(_safe(proc.cmdline) or []),
                cwd=_safe(proc.cwd),
                username=_safe(proc.username),
                started_ns=int(proc.create_time() * 1e9),
                rss_bytes=mem.rss,
                vms_bytes=mem.vms,
                num_threads=proc.num_threads(),
                cpu_user_s=cpu.user,
                cpu_system_s=cpu.system,
            )
    except (psutil.Error, OSError):  # gone: what the process told us last
        row["cmdline"] = " ".join(about.get("argv") or []) or None
        row["alive"] = False
    return pa.Table.from_pylist([row], schema=INFO_SCHEMA)


def _safe(fn):  # type: ignore[no-untyped-def]
    try:
        return fn()
    except (psutil.Error, OSError):
        return None


def _task_field(pid: int, tid: int, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/task/{tid}/{name}") as f:
            return f.read().strip()
    except OSError:
        return None


THREAD_SCHEMA = pa.schema(
    [
        ("tid", pa.int64()),
        ("name", pa.string()),
        ("comm", pa.string()),
        ("state", pa.string()),
        ("is_python", pa.bool_()),
        ("python_ident", pa.int64()),
        ("daemon", pa.bool_()),
        ("is_main", pa.bool_()),
        ("cpu_user_s", pa.float64()),
        ("cpu_system_s", pa.float64()),
    ]
)


def threads(target: Any) -> pa.Table:
    """Every OS thread; Python threads carry their ``threading`` names."""
    py = {t["tid"]: t for t in _about(target).get("threads", []) if t.get("tid") is not None}
    try:
        tasks = psutil.Process(target.pid).threads()
    except (psutil.Error, OSError):
        return THREAD_SCHEMA.empty_table()
    rows = []
    for t in tasks:
        pt = py.get(t.id)
        comm = _task_field(target.pid, t.id, "comm")
        rows.append(
            {
                "tid": t.id,
                "name": pt["name"] if pt is not None else comm,
                "comm": comm,
                "state": (task_stat(t.id, target.pid) or (None,))[0],
                "is_python": pt is not None,
                "python_ident": pt["ident"] if pt is not None else None,
                "daemon": pt["daemon"] if pt is not None else None,
                "is_main": t.id == target.pid,
                "cpu_user_s": t.user_time,
                "cpu_system_s": t.system_time,
            }
        )
    return pa.Table.from_pylist(rows, schema=THREAD_SCHEMA)
