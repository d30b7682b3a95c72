"""The exception tree: one base class, a few precise subclasses.

Errors are converted at module edges (``raise QueryError(...) from err``) and
carry the pid or node they are about, so the CLI can print one clear line.
"""

from __future__ import annotations


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


class NoProbe(ProbingError):
    """The process exists but carries no probe, or its probe does not answer."""


class AccessDenied(ProbingError):
    """The OS refused: another user's probe, missing capability, ptrace scope."""


class QueryError(ProbingError):
    """The SQL was rejected: syntax, planning, a refused statement, a table error."""


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
