"""The node's engines of this user (``probing ps``'s second table) and
``probing engine stop``: each engine with its version, install, processes,
memory and threads; a graceful stop (SIGTERM: its guests do not start it
again until a process asks for a probe)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import psutil

from probing import config
from probing.errors import NoSuchProcess, ProbingError
from probing.guest import place, wire

STOP_S = 30.0  # how long a stopped engine has to stop its tracers and exit


@dataclasses.dataclass
class EngineInfo:
    pid: int
    key: str
    install: str  # <version>@<package directory>
    processes: int  # live ones
    dead: int  # exited, their data still answered for
    rss_mb: float
    threads: int


def engines(directory: str | None = None) -> list[EngineInfo]:
    """The engines that run for this user (their lock files name them)."""
    directory = directory or place.user_dir(root=config.load().runtime_dir)
    out = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        if not (name.startswith("engine-") and name.endswith(".lock")):
            continue
        key = name[len("engine-") : -len(".lock")]
        pid = place.engine_pid(directory, key)
        try:
            proc = psutil.Process(pid)
            rss, threads = proc.memory_info().rss / 2**20, proc.num_threads()
        except (psutil.Error, ValueError):
            continue  # no engine holds it now
        if not place.is_engine(pid):
            continue
        try:
            said = wire.request(place.engine_path(directory, key), "GET", "/health", None, 5.0)
        except wire.WireError:
            said = {}
        procs = said.get("processes", {}).values()
        live = sum(1 for p in procs if p.get("alive"))
        install = str(said.get("install") or "?")
        out.append(EngineInfo(pid, key, install, live, len(procs) - live, round(rss, 1), threads))
    return out


def stop(pid: int | None, directory: str | None = None) -> list[EngineInfo]:
    """Stop the engine ``pid`` (every engine of this user with None),
    gracefully; the engines stopped. Its processes go on; a probe of one
    starts an engine again (``probing inject``, or its next ``PROBING=1``
    child)."""
    running = engines(directory)
    chosen = [e for e in running if pid is None or e.pid == pid]
    if pid is not None and not chosen:
        known = ", ".join(str(e.pid) for e in running) or "none"
        raise NoSuchProcess(f"no engine of this user has pid {pid} (engines: {known})", pid=pid)
    for e in chosen:
        os.kill(e.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_S
    for e in chosen:
        while psutil.pid_exists(e.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if psutil.pid_exists(e.pid) and psutil.Process(e.pid).status() != psutil.STATUS_ZOMBIE:
            raise ProbingError(
                f"engine {e.pid} did not stop in {STOP_S:g} s",
                hint=f"kill it with: kill -9 {e.pid} (its guests then start a new one)",
            )
    return chosen


ENGINE_COLUMNS = ["PID", "INSTALL", "PROCESSES", "DEAD", "RSS MB", "THREADS"]


def engine_rows(running: list[EngineInfo]) -> list[list[object]]:
    return [[e.pid, e.install, e.processes, e.dead, e.rss_mb, e.threads] for e in running]


def ps_text() -> str:
    """``probing ps``: the Python processes, and this user's engines."""
    from probing.cli.render import format_rows
    from probing.procs import python_processes

    rows = [[p.pid, p.user, p.probe, p.cmdline] for p in python_processes()]
    text = format_rows(["PID", "USER", "PROBE", "COMMAND"], rows)
    running = engines()
    if running:  # the node's engines that serve the probes
        text += "\n\nengines:\n" + format_rows(ENGINE_COLUMNS, engine_rows(running))
    return text
