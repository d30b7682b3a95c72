"""The exception tree: one base class, a few precise subclasses.

Errors are converted at module edges (``raise QueryError(...) from err``) and
carry the pid or node they are about, so the CLI can print one clear line.
"""

from __future__ import annotations

import logging
from typing import Any

from probing.log import ROOT

_log = logging.getLogger(ROOT)


class ProbingError(Exception):
    """Base class of every error probing raises on purpose."""

    def __init__(self, msg: str, *, pid: int | None = None, hint: str | None = None) -> None:
        super().__init__(msg)
        self.pid = pid
        self.hint = hint

    def __str__(self) -> str:
        msg = super().__str__()
        return f"{msg} ({self.hint})" if self.hint else msg


class NoSuchProcess(ProbingError):
    """The pid does not exist (or exited)."""


def no_such_pid(pid: int, what: str = "no process with pid {pid}") -> NoSuchProcess:
    """``pid`` names no process (or no valid one: ``what``): and where the
    ones to give are."""
    return NoSuchProcess(
        what.format(pid=pid), pid=pid, hint="probing ps lists the Python processes"
    )


class NoProbe(ProbingError):
    """The process exists but carries no probe, or its probe does not answer."""


class AccessDenied(ProbingError):
    """The OS refused: another user's probe, missing capability, ptrace scope."""


class QueryError(ProbingError):
    """The SQL was rejected: syntax, planning, a refused statement, a table error."""


# the hint of a query naming no table a probe has (the engine's); the command
# line, which knows the pid, names its own command instead
LIST_TABLES = "SHOW TABLES lists them"


class EvalError(ProbingError):
    """Code sent with ``probing eval`` raised in the target; ``detail`` is its traceback."""

    def __init__(self, msg: str, *, pid: int | None = None, detail: str = "") -> None:
        super().__init__(msg, pid=pid)
        self.detail = detail


class AttachError(ProbingError):
    """Injection into a process failed."""


class BPFUnavailable(ProbingError):
    """BCC, kernel headers, tracefs or CAP_BPF is missing."""


class PeerUnreachable(ProbingError):
    """A peer probe did not answer in time."""


class UnsupportedPython(ProbingError):
    """The target runs a CPython version whose frame layout probing lacks."""


class AlreadyTracing(ProbingError):
    """The process traces already (one trace at a time): stop it first."""


class NotTracing(ProbingError):
    """A stop asked of a process that is not tracing."""


class NotInCluster(ProbingError):
    """A question for the whole job asked of a probe that is no rank of one
    (yet): no torch.distributed, no cluster settings, or PROBING_CLUSTER=off."""


class ProviderError(ProbingError):
    """A table's provider failed: a bug in probing, not in the SQL. The probe
    answers 500 and writes the traceback to its log (the engine's)."""


# -- over HTTP: every error answer is {"error": message, "type": name}; the
# name is the nearest class of this table, and maps back to it in the client

ERRORS: dict[str, type[ProbingError]] = {
    cls.__name__: cls
    for cls in (
        ProbingError,
        NoSuchProcess,
        NoProbe,
        AccessDenied,
        QueryError,
        EvalError,
        AttachError,
        BPFUnavailable,
        PeerUnreachable,
        UnsupportedPython,
        AlreadyTracing,
        NotTracing,
        NotInCluster,
        ProviderError,
    )
}

# the HTTP status of an error type (its nearest listed class); others: 500
STATUS: dict[type[ProbingError], int] = {
    QueryError: 400,
    EvalError: 400,
    AccessDenied: 403,
    AlreadyTracing: 409,
    NotTracing: 409,
    NotInCluster: 409,
    PeerUnreachable: 503,
}


def wire_type(err: ProbingError) -> str:
    """The ``type`` an error crosses HTTP as: its nearest class in ``ERRORS``."""
    return next(c.__name__ for c in type(err).__mro__ if ERRORS.get(c.__name__) is c)


def http_status(err: ProbingError) -> int:
    return next((STATUS[c] for c in type(err).__mro__ if c in STATUS), 500)


def from_wire(
    status: int, msg: str, kind: str, *, pid: int | None = None, detail: str = ""
) -> ProbingError:
    """The error an HTTP error answer stands for (the client raises it)."""
    if status == 401:
        return AccessDenied(f"the probe refused the token: {msg}", hint="check PROBING_TOKEN")
    cls = ERRORS.get(kind)
    if cls is EvalError:
        return EvalError(msg, pid=pid, detail=detail)
    if cls is None or cls is ProbingError:
        if status == 403:
            return AccessDenied(msg, pid=pid)
        return ProbingError(f"probe answered {status}: {msg}", pid=pid)
    return cls(msg, pid=pid)


def control_outcome(
    status: int, reply: dict[str, Any], reason: str | None = None
) -> dict[str, Any]:
    """What one rank did with a start or a stop of tracing, from its answer
    (``status``; ``reply``: the JSON, or ``type``/``error`` of an error;
    ``reason``: why no answer came): ``ok`` (tracing, or stopped), ``done``
    (by this request), ``state`` and the ``reason`` when not done."""
    done = status == 200
    was = {AlreadyTracing.__name__: "tracing", NotTracing.__name__: "stopped"}.get(
        reply.get("type") or ""
    )
    if done:  # tracing, where some of its uprobes may not be (trace --pid says which)
        fams = reply.get("families") or {}
        n = sum(len(f.get("refused") or []) for f in fams.values() if isinstance(f, dict))
        note = f"{n} uprobes not attached (probing.uprobes says why)" if n else None
        return {"ok": True, "done": True, "state": reply.get("state"), "reason": note}
    if was is not None:
        return {"ok": True, "done": False, "state": was, "reason": f"already {was}"}
    why = reason or reply.get("error") or str(status)
    return {"ok": False, "done": False, "state": None, "reason": why}


def outcome_of(err: ProbingError) -> dict[str, Any]:
    """``control_outcome`` of an error raised by a client's start or stop."""
    return control_outcome(http_status(err), {"type": wire_type(err), "error": str(err)})


# -- the probe's log: an error caught where nothing may get through ------------

_LOGGED_AT_MOST = 64  # distinct errors a ``seen`` set remembers; past it, they are only counted


def tell(msg: str, pid: int | None = None, level: int = logging.WARNING) -> None:
    """``msg`` where the process ``pid`` writes its errors when that is a
    terminal or a pipe (its stderr, through ``/proc/PID/fd/2``: a probe served
    beside the job speaks where the job's user looks), one ``probing: msg``
    line; else logged at ``level`` (this process's stderr: the engine's log).
    Never into a file: a job run with ``> train.log 2>&1`` writes at its own
    offset, and a line of ours, opened a second time, was overwritten by its
    lines and garbled them. Nothing below ``PROBING_LOG``'s level. Never raises."""
    import os

    from probing import proc

    if not _log.isEnabledFor(level):
        return
    line = f"probing: {msg}\n"
    if pid is not None and pid != os.getpid() and _told_to(proc.path(pid, "fd/2"), line):
        return
    _log.log(level, msg)  # its handler swallows a stderr closed or gone


def _told_to(stderr: str, line: str) -> bool:
    """``line`` written to a process's ``stderr`` (its ``/proc/PID/fd/2``)
    where that is a terminal or a pipe: one write, appended, so the line is
    whole however the job writes around it; never blocking (a pipe nobody
    reads, a full one: the line is not told there). False where it was not
    (a file, a socket, gone, not ours): the caller's log has it."""
    import os
    import stat

    try:  # what it is, before it is opened: a job's file is never opened at all
        mode = os.stat(stderr).st_mode
        if not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
            return False
        flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
        fd = os.open(stderr, flags)
    except OSError:
        return False
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISFIFO(mode) or os.isatty(fd)):  # /dev/null, another device
            return False
        return os.write(fd, line.encode(errors="replace")) > 0
    except OSError:  # a pipe full or closed meanwhile
        return False
    finally:
        os.close(fd)


def log_unexpected(what: str, err: BaseException, seen: set[str] | None = None) -> None:
    """Log ``what``, ``err`` and its traceback as an error (the engine's log,
    a command's stderr): for the boundaries that must catch everything (a
    probe thread's loop, a handler running in someone else's process), so a
    bug there is seen, not swallowed. With ``seen`` (the caller's set), an
    error already logged (same type and message) is not logged again: a loop
    that fails every turn says it once. Never raises."""
    key = f"{type(err).__name__}: {err}"
    if seen is not None:
        if key in seen or len(seen) >= _LOGGED_AT_MOST:
            return
        seen.add(key)
    _log.error("%s: %s", what, key, exc_info=(type(err), err, err.__traceback__))
