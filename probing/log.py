"""Probing's lines: the ``probing`` logger, its one handler and format.

Each part logs through ``logging.getLogger("probing.<part>")``; a process's
entry point calls ``setup`` once (the engine's ``main``, the agent's, the
command line's). A long-running process's lines say who wrote them and when,
``probing engine 12950: 06:55:48 attach pid 12860 (...)``; a command's are
the ones it always wrote, ``probing: <message>`` (the user just typed it:
its pid and the time are noise). Before any ``setup`` (a test, a script
that uses the engine's parts in its own process) the lines are a command's,
at ``info``.

The handler writes to ``sys.stderr`` as it is at each line (a daemon's is
its log file, a test's its capture) and never raises: a closed stderr
loses the line, never the caller. The ``probing`` logger does not pass its
lines on to the root logger: a job's own logging never prints them twice.
The guest (``probing.guest``) keeps its own few lines: it loads nothing of
ours."""

from __future__ import annotations

import logging
import sys
import time

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
DEFAULT = "info"

ROOT = "probing"


class LogFormatter(logging.Formatter):
    """``probing <process> <pid>: HH:MM:SS <message>`` (a traceback on the
    lines after), or ``probing: <message>`` with no ``process``."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)  # the message, and a traceback after it
        if not self.process:
            return f"probing: {text}"
        when = time.strftime("%H:%M:%S", time.localtime(record.created))
        return f"probing {self.process} {record.process}: {when} {text}"


class _Stderr(logging.StreamHandler):
    """To ``sys.stderr`` as it is now, not as it was when built."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _: object) -> None:  # StreamHandler sets it; sys.stderr wins
        pass

    def handleError(self, record: logging.LogRecord) -> None:
        pass  # stderr closed or gone: nothing to tell, and never a traceback of ours


_handler = _Stderr()
_handler.setFormatter(LogFormatter())
_root = logging.getLogger(ROOT)
_root.addHandler(_handler)
_root.setLevel(logging.INFO)
_root.propagate = False
_said_bad: set[str] = set()  # bad PROBING_LOG values said already: once a process


def setup(process: str | None, level: str = DEFAULT) -> None:
    """Probing's lines for this process from now on: ``process`` names it
    in each line (``"engine"``, ``"agent"``; None: a command's lines) and
    ``level`` (``PROBING_LOG``: ``debug``, ``info``, ``warning``, ``error``)
    is the least one written; another value is ``info``, said once."""
    _handler.setFormatter(LogFormatter(process))
    name = level.strip().lower()
    _root.setLevel(LEVELS.get(name, LEVELS[DEFAULT]))
    if name not in LEVELS and level not in _said_bad:
        _said_bad.add(level)
        _root.warning(f"PROBING_LOG={level!r} is no level ({', '.join(LEVELS)}): {DEFAULT} it is")
