"""The process a probe describes: this one, or a job's process beside us.

A probe (``ProbeContext``) asks its target what only the process knows
(``probing.guest.inside``): its Python, threads, stacks, ``python.`expr```,
``eval``, torch's groups. ``Local`` calls those functions in this process;
``GuestProcess`` asks the guest inside another process over its socket, and keeps
the last answer of ``info`` so a process that died is still described.
Both answer with the same plain data.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

from probing import proc
from probing.errors import ERRORS, EvalError, NoProbe, NoSuchProcess, ProbingError, QueryError
from probing.guest import flight, inside, wire


class Target(Protocol):
    pid: int
    local: bool

    def alive(self) -> bool: ...
    def info(self) -> dict[str, Any]: ...
    def about(self) -> dict[str, Any]: ...
    def threads(self) -> list[dict[str, Any]]: ...
    def environ(self) -> Mapping[str, str]: ...
    def distributed(self) -> dict[str, Any] | None: ...
    def stacks(self, window_s: float = inside.WINDOW_S) -> list[dict[str, Any]]: ...
    def expr(self, text: str) -> dict[str, list[Any]]: ...
    def eval(self, code: str) -> dict[str, Any]: ...
    def groups(self, comms: list[int]) -> list[dict[str, Any]]: ...
    def external(self) -> dict[str, dict[str, Any]]: ...
    def hook_threads(self, on: bool) -> None: ...
    def flight(self) -> dict[str, Any]: ...


def _raised(err: wire.GuestError | wire.WireError, pid: int | None = None) -> ProbingError:
    """The probing error a guest's answer stands for (its ``type``)."""
    kind = ERRORS.get(err.kind, QueryError)
    if kind is EvalError:
        return EvalError(str(err), pid=pid, detail=err.detail)
    return kind(str(err), pid=pid)


class Local:
    """This process."""

    local = True

    def __init__(self) -> None:
        self.pid = os.getpid()

    def alive(self) -> bool:
        return True

    def info(self) -> dict[str, Any]:
        return {**inside.info(), "threads": inside.threads()}

    def about(self) -> dict[str, Any]:
        return inside.info()

    def threads(self) -> list[dict[str, Any]]:
        return inside.threads()

    def environ(self) -> Mapping[str, str]:
        return os.environ

    def distributed(self) -> dict[str, Any] | None:
        return inside.distributed()

    def stacks(self, window_s: float = inside.WINDOW_S) -> list[dict[str, Any]]:
        return inside.stacks(window_s)

    def expr(self, text: str) -> dict[str, list[Any]]:
        try:
            return inside.expr(text)
        except wire.GuestError as err:
            raise _raised(err) from None

    def eval(self, code: str) -> dict[str, Any]:
        try:
            return inside.run(code)
        except wire.GuestError as err:
            raise _raised(err) from None

    def groups(self, comms: list[int]) -> list[dict[str, Any]]:
        return inside.groups(comms)

    def external(self) -> dict[str, dict[str, Any]]:
        return {}  # this process's ExternalTables write to its store directly

    def hook_threads(self, on: bool) -> None:
        pass  # the tracer hooks this process's threads itself (PyStacks.hook_threads)

    def flight(self) -> dict[str, Any]:
        return flight.flight()


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (state T: SIGSTOP; not t, a tracer's stop,
    which our own injection makes for a few milliseconds)."""
    try:
        return proc.stat(pid)[0] == "T"
    except (OSError, ValueError, IndexError):
        return False


class GuestProcess:
    """A process of the job, through the guest inside it (``socket``)."""

    local = False

    def __init__(self, pid: int, socket: str, timeout: float = 30.0) -> None:
        self.pid = pid
        self.socket = socket
        self.timeout = timeout
        self.last_info: dict[str, Any] = {}
        self.died_ns: int | None = None  # set by the engine when the process exits

    def alive(self) -> bool:
        return self.died_ns is None and proc.exists(self.pid)

    def _ask(self, method: str, url: str, payload: Any = None) -> Any:
        if not self.alive():
            raise NoSuchProcess(
                f"process {self.pid} has exited: only what it left is here", pid=self.pid
            )
        if _stopped(self.pid):  # its guest cannot answer: never wait for it (a query,
            # the always-on watch, would hold the engine's workers and its shares' slots)
            raise NoProbe(
                f"process {self.pid} is stopped (SIGSTOP): its guest cannot "
                "answer; what the engine keeps still can",
                pid=self.pid,
                hint=f"resume it with kill -CONT {self.pid}",
            )
        try:
            return wire.request(self.socket, method, url, payload, timeout=self.timeout)
        except wire.WireError as err:
            if err.status == 0:
                raise NoSuchProcess(
                    f"the guest of process {self.pid} does not answer ({err})", pid=self.pid
                ) from None
            raise _raised(err, self.pid) from None

    def about(self) -> dict[str, Any]:
        """Its Python, executable and arguments: asked once (they do not change)."""
        return self.last_info or self.info()

    def info(self) -> dict[str, Any]:
        """What the process says of itself; once it is gone, what it said last."""
        try:
            self.last_info = self._ask("GET", "/info")
        except NoSuchProcess:
            if not self.last_info:
                raise
        return self.last_info

    def threads(self) -> list[dict[str, Any]]:
        """Its ``threading`` threads (tid, ident, name, daemon, main); a dead
        process has none."""
        if not self.alive():
            return []
        rows: list[dict[str, Any]] = self._ask("GET", "/threads")
        return rows

    def distributed(self) -> dict[str, Any] | None:
        """Its default process group (rank, world, store), None until torch has one."""
        got: dict[str, Any] | None = self._ask("GET", "/distributed")
        return got

    def environ(self) -> Mapping[str, str]:
        """The job's variables (``inside.ENV_PREFIXES``): as the process started
        (``/proc/P/environ``: no need for it to answer), overlaid with what it
        last told (``info``: what it set since)."""
        env = {k: v for k, v in proc.environ(self.pid).items()
               if k.startswith(inside.ENV_PREFIXES)}  # fmt: skip
        env.update(self.last_info.get("environ", {}))
        return env

    def stacks(self, window_s: float = inside.WINDOW_S) -> list[dict[str, Any]]:
        if not self.alive():  # a dead process has no stack (its last calls are traced)
            return []
        rows: list[dict[str, Any]] = self._ask("POST", "/stacks", {"window_s": window_s})
        return rows

    def expr(self, text: str) -> dict[str, list[Any]]:
        cols: dict[str, list[Any]] = self._ask("POST", "/expr", {"expr": text})
        return cols

    def eval(self, code: str) -> dict[str, Any]:
        answer: dict[str, Any] = self._ask("POST", "/eval", {"code": code})
        return answer

    def groups(self, comms: list[int]) -> list[dict[str, Any]]:
        if not self.alive():  # what it told before it died is kept by comm.groups
            return []
        rows: list[dict[str, Any]] = self._ask("POST", "/groups", {"comms": comms})
        return rows

    def external(self) -> dict[str, dict[str, Any]]:
        """The rows the process's ExternalTables took since the last call."""
        if not self.alive():
            return {}
        tables: dict[str, dict[str, Any]] = self._ask("POST", "/external")
        return tables

    def hook_threads(self, on: bool) -> None:
        """New threads tell the probe their state as they start (or no more)."""
        if self.alive():
            self._ask("POST", "/threads", {"on": on})

    def flight(self) -> dict[str, Any]:
        """Its Flight Recorder (``probing.guest.flight``): state, reason, rows."""
        if not self.alive():
            return {"state": "off", "reason": "the process has exited", "rows": []}
        answer: dict[str, Any] = self._ask("GET", "/flight")
        return answer
