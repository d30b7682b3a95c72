"""Python processes on this machine, whether each carries a probe, and what its
threads are blocked in."""

from __future__ import annotations

import os
import platform
import re
import socket
from typing import NamedTuple

import psutil

from probing import paths
from probing.errors import NoProbe
from probing.proc import environ, maps

_PY_EXE = re.compile(r"^python(\d+(\.\d+)*)?$")

# the syscalls a thread is seen blocked in (``proc.task_syscall``), by number, on each
# machine
_X86_64_SYSCALLS = {
    0: "read", 1: "write", 7: "poll", 16: "ioctl", 23: "select", 35: "nanosleep",
    43: "accept", 42: "connect", 44: "sendto", 45: "recvfrom", 46: "sendmsg",
    47: "recvmsg", 61: "wait4", 202: "futex", 230: "clock_nanosleep", 232: "epoll_wait",
    257: "openat", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 288: "accept4",
    441: "epoll_pwait2",
}  # fmt: skip
_AARCH64_SYSCALLS = {
    63: "read", 64: "write", 29: "ioctl", 101: "nanosleep", 115: "clock_nanosleep",
    98: "futex", 22: "epoll_pwait", 72: "pselect6", 73: "ppoll", 202: "accept",
    203: "connect", 206: "sendto", 207: "recvfrom", 211: "sendmsg", 212: "recvmsg",
    242: "accept4", 260: "wait4", 56: "openat", 441: "epoll_pwait2",
}  # fmt: skip
_SYSCALL_NAMES = {"x86_64": _X86_64_SYSCALLS, "amd64": _X86_64_SYSCALLS,
                  "aarch64": _AARCH64_SYSCALLS, "arm64": _AARCH64_SYSCALLS}  # fmt: skip


def syscall_name(nr: int) -> str:
    """The name of syscall ``nr`` on this machine's architecture."""
    names = _SYSCALL_NAMES.get(platform.machine().lower(), {})
    return names.get(nr, f"syscall {nr}")


class ProcInfo(NamedTuple):
    pid: int
    user: str
    probe: str  # "yes", "stale" (socket left, nothing answers) or "-"
    cmdline: str


def _maps_has_libpython(pid: int) -> bool:
    try:
        return any("libpython" in m.path for m in maps(pid))
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


def no_probe(pid: int) -> NoProbe:
    """The error of a process ``pid`` without a probe, with what to do: inject
    one into a Python process; nothing, into any other."""
    try:
        proc = psutil.Process(pid)
        python, name = is_python(proc), proc.name()
    except psutil.Error:  # gone meanwhile, or not ours to read: say what it usually is
        python, name = True, "?"
    if not python:
        return NoProbe(
            f"process {pid} ({name}) is not a Python process: it has no probe, "
            "and none can be injected",
            pid=pid,
            hint="probing ps lists the Python processes",
        )
    return NoProbe(
        f"process {pid} has no probe",
        pid=pid,
        hint=f"start it with PROBING=1, or attach with: probing inject --pid {pid}",
    )


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
    """This user's Python processes (every user's, as root), with their probes."""
    sockets = paths.all_sockets()
    me = os.getpid()
    out = []
    for proc in psutil.process_iter(["pid", "username", "cmdline"]):
        pid = proc.info["pid"]
        if pid == me or not paths.mine(pid) or not (pid in sockets or is_python(proc)):
            continue  # another user's processes are theirs to list (root sees all)
        path = sockets.get(pid)
        probe = "-" if path is None else ("yes" if socket_alive(path) else "stale")
        cmd = " ".join(proc.info.get("cmdline") or []) or f"[{proc.name()}]"
        out.append(ProcInfo(pid, proc.info.get("username") or "?", probe, cmd))
    return sorted(out)


# what the ranks of one job on a node share in the environment they started
# with (a launcher sets them for each rank it starts): torchrun, srun, mpirun
JOB_KEYS = (
    "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID",
    "OMPI_MCA_orte_hnp_uri", "PMIX_NAMESPACE",
)  # fmt: skip


# of which one a job step has to itself (an allocation's SLURM_JOB_ID, an exported
# MASTER_ADDR, are shared by every process of the user's shell)
STEP_KEYS = ("TORCHELASTIC_RUN_ID", "MASTER_PORT", "SLURM_STEP_ID", "OMPI_MCA_orte_hnp_uri",
             "PMIX_NAMESPACE")  # fmt: skip


def _job_key(pid: int) -> dict[str, str]:
    env = environ(pid)
    key = {k: env[k] for k in JOB_KEYS if k in env}
    return key if any(k in key for k in STEP_KEYS) else {}


def job_pids(pid: int) -> list[int]:
    """Every rank on this machine of the job ``pid`` belongs to: the Python
    processes of its user that started with the launcher's variables it
    started with (``JOB_KEYS``), less their own children (DataLoader
    workers), plus a Python parent with the same command line (Lightning's
    rank 0 starts the others, and set those variables in itself only).
    A process with none of those variables (rank 0 of such a job, a
    launcher) is keyed by its Python children's; a launcher is not a rank.
    Just ``[pid]`` where nothing tells."""
    try:
        me = psutil.Process(pid)
        uid = me.uids().real
    except psutil.Error:
        return [pid]
    key = _job_key(pid)
    if not key:
        kids = [c.pid for c in me.children() if is_python(c)]
        key = next((k for k in map(_job_key, kids) if k), {})
    if not key:
        return [pid]
    matched: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.info["uids"].real != uid or not is_python(proc):
                continue
        except (psutil.Error, AttributeError):
            continue
        theirs = _job_key(proc.pid)
        if all(theirs.get(k) == v for k, v in key.items()):
            matched[proc.pid] = proc
    ranks = {p for p, proc in matched.items() if _ppid(proc) not in matched}
    for p in list(ranks):
        parent = _parent(matched[p])
        if parent is not None and is_python(parent) and _argv(parent) == _argv(matched[p]):
            ranks.add(parent.pid)
    return sorted(ranks) or [pid]  # a launcher's pid (torchrun's agent): its ranks


# why a rank is not heard from when its launcher started it on this machine and
# no process of the job has its rank here any more
NO_PROCESS = "no process left on its node (it exited or was killed)"


def exited_ranks(pid: int) -> list[int]:
    """The ranks the launcher of ``pid``'s job started on this machine (its
    ``LOCAL_WORLD_SIZE`` ranks from ``RANK - LOCAL_RANK``, as torchrun and a
    launcher that sets them number them) of which no process of the job is
    left here: exited or killed. Nothing where the variables do not say
    (ranks set in code, ``mp.spawn``'s, Lightning's)."""
    try:
        env = environ(pid)
        rank, local, size = (int(env[k]) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    except (OSError, KeyError, ValueError):
        return []
    if not _job_key(pid) or not 0 <= local < size:
        return []
    here = set()
    for p in job_pids(pid):
        try:
            here.add(int(environ(p).get("RANK", "")))
        except (OSError, ValueError):
            continue
    return [r for r in range(rank - local, rank - local + size) if r not in here]


def _ppid(proc: psutil.Process) -> int | None:
    try:
        return proc.ppid()
    except psutil.Error:
        return None


def _parent(proc: psutil.Process) -> psutil.Process | None:
    try:
        return proc.parent()
    except psutil.Error:
        return None


def _argv(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []
