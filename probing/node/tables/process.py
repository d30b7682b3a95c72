"""``process.info`` and ``process.threads``: the process the probe describes.

Read from outside (``/proc``, psutil) and from the process itself (its
Python and its ``threading`` names, through its target). A process that
has exited still has its last ``info``; its ``threads`` are none.

``info``'s place in the job's parallel layout (``tp``, ``pp``, ``dp``, ``cp``,
``ep``: its index along each; ``coords``: ``tp 1/2, pp 0/2, dp 0/1``, a
DeviceMesh's own dimensions too) is its rank in each of its ``comm.groups``
that has a role (``probing.analyze.mesh``): NULL until a group that says one
is traced, and read again every ``PLACE_TTL_S``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psutil
import pyarrow as pa

from probing import proc
from probing.errors import ProbingError
from probing.guest.place import VERSION

T = TypeVar("T")

# the roles with a column of their own: probing.analyze.mesh.ORDER (analyze is
# imported on first use, not with the tables: tests/test_engine.py)
ROLES = ("tp", "pp", "dp", "cp", "ep")

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
        ("died_ns", pa.int64()),  # when the engine saw it exit (wall ns); NULL while alive
        ("coords", pa.string()),  # "tp 1/2, pp 0/2, dp 0/1": index/size along each role
        *((role, pa.int64()) for role in ROLES),  # its index along each
    ]
)


def _about(target: Any) -> dict[str, Any]:
    try:
        about: dict[str, Any] = target.info()
        return about
    except ProbingError:
        return {}


def place(groups: Callable[[], pa.Table]) -> dict[str, Any]:
    """``info``'s ``coords`` and per-role columns, from the process's own
    ``comm.groups`` (``groups()``); none where no group says a role."""
    try:
        rows = groups().select(["role", "group_rank", "nranks"]).to_pylist()
    except ProbingError:
        return {}
    if not any(r["role"] for r in rows):
        return {}
    from probing.analyze.mesh import coords_text, own_coordinates

    at = own_coordinates((r["role"], r["group_rank"], r["nranks"]) for r in rows)
    if not at:
        return {}
    return {"coords": coords_text(at), **{r: at[r][0] for r in ROLES if r in at}}


# a process's groups are made at its start and rarely after, and finding its
# traced ones scans gloo.calls (~25 ms a million rows): its place is read again
# after this long, not at every query (the watch asks process.info every 5 s)
PLACE_TTL_S = 10.0


class PlaceCache:
    """``place(groups)``, read again once ``ttl_s`` old; a place once known is
    kept when no group says one any more (the process ended, or destroyed its
    groups)."""

    def __init__(self, groups: Callable[[], pa.Table], ttl_s: float = PLACE_TTL_S) -> None:
        self.groups, self.ttl_s = groups, ttl_s
        self._last: tuple[float, dict[str, Any]] | None = None

    def __call__(self) -> dict[str, Any]:
        now, last = time.monotonic(), self._last
        if last is None or now - last[0] >= self.ttl_s:
            last = self._last = (now, place(self.groups) or (last[1] if last else {}))
        return last[1]


def info(target: Any, where: Callable[[], dict[str, Any]] | None = None) -> pa.Table:
    """One row: the process; ``where()`` (a ``PlaceCache``) gives its place."""
    about = _about(target)
    row: dict[str, Any] = {
        **(where() if where is not None else {}),
        "pid": target.pid,
        "hostname": socket.gethostname(),
        "python": about.get("python"),
        "python_executable": about.get("executable"),
        "probing_version": VERSION,
        "probe_started_ns": about.get("probe_started_ns"),
        "alive": target.alive(),
        "died_ns": getattr(target, "died_ns", None),
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


def _safe(fn: Callable[[], T]) -> T | None:
    try:
        return fn()
    except (psutil.Error, OSError):
        return None


def _task_field(pid: int, tid: int, name: str) -> str | None:
    try:
        return proc.read(pid, f"task/{tid}/{name}").strip()
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
                "state": (proc.task_stat(t.id, target.pid) or (None,))[0],
                "is_python": pt is not None,
                "python_ident": pt["ident"] if pt is not None else None,
                "daemon": pt["daemon"] if pt is not None else None,
                "is_main": t.id == target.pid,
                "cpu_user_s": t.user_time,
                "cpu_system_s": t.system_time,
            }
        )
    return pa.Table.from_pylist(rows, schema=THREAD_SCHEMA)


CPU_SCHEMA = pa.schema(
    [
        ("cpu", pa.int32()),  # the CPU its main thread last ran on
        ("mhz", pa.float64()),  # that CPU's clock now (cpufreq, else /proc/cpuinfo)
        ("max_mhz", pa.float64()),  # its highest clock (cpufreq; NULL where not exposed)
        ("steal_pct", pa.float64()),  # the node's CPU time the hypervisor took, over STEAL_S
        ("busy_pct", pa.float64()),  # the node's CPUs busy over the same time
    ]
)
STEAL_S = 0.1  # /proc/stat is read twice, this far apart


def cpu(target: Any, wait_s: float = STEAL_S) -> pa.Table:
    """The CPU the process runs on (one row): its clock, and the node's steal
    (time a hypervisor gave to other guests) and busy shares now, from /proc
    and /sys where the kernel exposes them (NULL where it does not)."""
    try:
        on = int(proc.stat(target.pid)[36])  # field 39: processor
    except (OSError, IndexError, ValueError):
        return CPU_SCHEMA.empty_table()
    first = _cpu_times()
    time.sleep(wait_s)
    second = _cpu_times()
    steal = busy = None
    if first and second and len(first) == len(second):
        delta = [b - a for a, b in zip(first, second, strict=True)]
        total = sum(delta)
        if total > 0:  # user nice system idle iowait irq softirq steal
            steal = 100.0 * delta[7] / total if len(delta) > 7 else None
            busy = 100.0 * (total - delta[3] - delta[4]) / total
    row = {"cpu": on, "mhz": _cpu_mhz(on), "max_mhz": _khz(on, "cpuinfo_max_freq"),
           "steal_pct": steal, "busy_pct": busy}  # fmt: skip
    return pa.Table.from_pylist([row], schema=CPU_SCHEMA)


def _cpu_times() -> list[int]:
    try:
        return [int(v) for v in proc.node("stat").split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return []


def _khz(cpu_id: int, name: str) -> float | None:
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu_id}/cpufreq/{name}") as f:
            return int(f.read()) / 1000.0
    except (OSError, ValueError):
        return None


def _cpu_mhz(cpu_id: int) -> float | None:
    """CPU ``cpu_id``'s clock: cpufreq's, else what /proc/cpuinfo says of it."""
    got = _khz(cpu_id, "scaling_cur_freq")
    if got is not None:
        return got
    try:
        blocks = proc.node("cpuinfo").split("\n\n")
    except OSError:
        return None
    for block in blocks:
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if fields.get("processor") == str(cpu_id) and "cpu MHz" in fields:
            return float(fields["cpu MHz"])
    return None
