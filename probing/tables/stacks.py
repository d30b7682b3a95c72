"""``process.stacks``: every Python thread's stack, from inside the probe.

One row per frame, innermost first (``depth`` 0), like ``py-spy dump``:
the thread's name and native tid, whether it is running (``active``),
blocked on a lock, a condition or the GIL (``waiting``, in ``futex``) or
blocked elsewhere in the kernel (``idle``, with the syscall), and
file:line:function. CPU use over a short window tells a busy thread that
happened to be waiting for the GIL (the probe holds it while it samples)
from one that sleeps. The probe's own threads are left out.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pyarrow as pa

from probing.inject.arch import syscall_name
from probing.procs import task_stat, task_syscall

WINDOW_S = 0.02
ACTIVE_CPU = 0.05  # share of the window on CPU that makes a thread active

SCHEMA = pa.schema(
    [
        ("tid", pa.int64()),
        ("thread", pa.string()),
        ("state", pa.string()),
        ("syscall", pa.string()),
        ("cpu_pct", pa.float64()),
        ("daemon", pa.bool_()),
        ("depth", pa.int32()),
        ("func", pa.string()),
        ("file", pa.string()),
        ("line", pa.int32()),
    ]
)

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _states(tids: list[int]) -> dict[int, tuple[str, str | None, float]]:
    before = {tid: task_stat(tid) for tid in tids}
    time.sleep(WINDOW_S)  # lets the GIL go: busy Python threads run meanwhile
    out = {}
    for tid in tids:
        now, then = task_stat(tid), before.get(tid)
        if now is None:
            continue
        cpu = (now[1] - then[1]) / _CLK_TCK / WINDOW_S if then else 0.0
        nr = task_syscall(tid) if now[0] != "R" else -1
        if now[0] == "R" or cpu >= ACTIVE_CPU:
            state = "active"
        elif nr < 0:
            state = "idle"
        else:
            state = "waiting" if syscall_name(nr) == "futex" else "idle"
        out[tid] = (state, syscall_name(nr) if nr >= 0 else None, round(100 * min(cpu, 1.0), 1))
    return out


def _own_threads() -> set[int]:
    """The probe's server and request threads (a query from user code keeps its own)."""
    return {t.ident for t in threading.enumerate() if t.name.startswith("probing-") and t.ident}


def stacks() -> pa.Table:
    threads = {t.ident: t for t in threading.enumerate()}
    skip = _own_threads()
    tids = [t.native_id for t in threads.values() if t.native_id and t.ident not in skip]
    states = _states(tids)
    rows: list[dict[str, Any]] = []
    for ident, frame in sys._current_frames().items():
        if ident in skip:
            continue
        t = threads.get(ident)
        tid = t.native_id if t is not None else None
        state, syscall, cpu = states.get(tid or -1, ("unknown", None, None))
        head = {
            "tid": tid,
            "thread": t.name if t is not None else f"thread {ident:#x}",
            "state": state,
            "syscall": syscall,
            "cpu_pct": cpu,
            "daemon": t.daemon if t is not None else None,
        }
        depth = 0
        f = frame
        while f is not None:
            code = f.f_code
            rows.append(
                {
                    **head,
                    "depth": depth,
                    "func": getattr(code, "co_qualname", code.co_name),
                    "file": code.co_filename,
                    "line": f.f_lineno,
                }
            )
            f = f.f_back
            depth += 1
    return pa.Table.from_pylist(rows, schema=SCHEMA)
