"""``process.stacks``: every Python thread's stack, as the process sees it.

One row per frame, innermost first (``depth`` 0), like ``py-spy dump``:
the thread's name and native tid, whether it is running (``active``),
blocked on a lock, a condition or the GIL (``waiting``, in ``futex``) or
blocked elsewhere in the kernel (``idle``, with the syscall), and
file:line:function. CPU use over a short window tells a busy thread that
happened to be waiting for the GIL from one that sleeps. The process walks
its own frames (``probing.guest.inside.stacks``); the probe's own threads
are left out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa

from probing.procs import syscall_name

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


def state_of(letter: str, cpu: float, nr: int) -> str:
    """``active``, ``waiting`` (a futex: a lock, a condition, the GIL) or ``idle``."""
    if letter == "?":
        return "unknown"
    if letter == "R" or cpu >= ACTIVE_CPU:
        return "active"
    if nr < 0:
        return "idle"
    return "waiting" if syscall_name(nr) == "futex" else "idle"


def table(rows: list[dict[str, Any]]) -> pa.Table:
    out = []
    for r in rows:
        letter, cpu, nr = r["letter"], float(r["cpu"]), int(r["syscall_nr"])
        out.append(
            {
                "tid": r["tid"],
                "thread": r["thread"],
                "state": state_of(letter, cpu, nr),
                "syscall": syscall_name(nr) if nr >= 0 else None,
                "cpu_pct": None if letter == "?" else round(100 * cpu, 1),
                "daemon": r["daemon"],
                "depth": r["depth"],
                "func": r["func"],
                "file": r["file"],
                "line": r["line"],
            }
        )
    return pa.Table.from_pylist(out, schema=SCHEMA)


def provider(rows_of: Callable[[], list[dict[str, Any]]]) -> Callable[[], pa.Table]:
    """``process.stacks`` over a target's ``stacks`` (``probing.target``)."""
    return lambda: table(rows_of())
