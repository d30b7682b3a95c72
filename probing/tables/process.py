"""``process.info`` and ``process.threads``: the process the probe lives in."""

from __future__ import annotations

import socket
import sys
import threading
import time

import psutil
import pyarrow as pa

from probing.config import VERSION
from probing.procs import task_stat

_STARTED_NS = time.time_ns()


def info() -> pa.Table:
    proc = psutil.Process()
    with proc.oneshot():
        mem = proc.memory_info()
        cpu = proc.cpu_times()
        row = {
            "pid": proc.pid,
            "ppid": proc.ppid(),
            "hostname": socket.gethostname(),
            "exe": _safe(proc.exe),
            "cmdline": " ".join(_safe(proc.cmdline) or []),
            "cwd": _safe(proc.cwd),
            "username": _safe(proc.username),
            "python": sys.version.split()[0],
            "python_executable": sys.executable,
            "started_ns": int(proc.create_time() * 1e9),
            "rss_bytes": mem.rss,
            "vms_bytes": mem.vms,
            "num_threads": proc.num_threads(),
            "cpu_user_s": cpu.user,
            "cpu_system_s": cpu.system,
            "probing_version": VERSION,
            "probe_started_ns": _STARTED_NS,
        }
    return pa.Table.from_pylist([row])


def _safe(fn):  # type: ignore[no-untyped-def]
    try:
        return fn()
    except (psutil.Error, OSError):
        return None


def _task_field(tid: int, name: str) -> str | None:
    try:
        with open(f"/proc/self/task/{tid}/{name}") as f:
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


def threads() -> pa.Table:
    """Every OS thread; Python threads carry their ``threading`` names."""
    py = {t.native_id: t for t in threading.enumerate() if t.native_id is not None}
    main_tid = threading.main_thread().native_id
    rows = []
    for t in psutil.Process().threads():
        pt = py.get(t.id)
        comm = _task_field(t.id, "comm")
        rows.append(
            {
                "tid": t.id,
                "name": pt.name if pt is not None else comm,
                "comm": comm,
                "state": (task_stat(t.id) or (None,))[0],
                "is_python": pt is not None,
                "python_ident": pt.ident if pt is not None else None,
                "daemon": pt.daemon if pt is not None else None,
                "is_main": t.id == main_tid,
                "cpu_user_s": t.user_time,
                "cpu_system_s": t.system_time,
            }
        )
    return pa.Table.from_pylist(rows, schema=THREAD_SCHEMA)
