"""The tools that change a target (``trace_start``, ``trace_stop``, ``eval``):
served only with ``probing mcp --allow-control``, and every call written
down, allowed or not: one line on stderr and one JSON line in
``<out-dir>/audit.jsonl``."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from probing.errors import ProbingError

FLAG = "--allow-control"
AUDIT_FILE = "audit.jsonl"

T = TypeVar("T")


class ControlRefused(ProbingError):
    """A control tool called on a server started without ``--allow-control``."""


class Control:
    """Whether control tools run, and the audit log of their calls."""

    def __init__(self, allowed: bool, out_dir: Path) -> None:
        self.allowed = allowed
        self.log = out_dir / AUDIT_FILE
        self._lock = threading.Lock()

    def write(self, tool: str, args: dict[str, Any], outcome: str, error: str | None) -> None:
        """One audit record: stderr and the JSON-lines file (0600)."""
        record = {
            "ts": time.time(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "tool": tool,
            "args": args,
            "outcome": outcome,
            "error": error,
            "server_pid": os.getpid(),
            "uid": os.getuid(),
        }
        said = " ".join(f"{k}={v!r}" for k, v in args.items())
        line = f"probing mcp: audit: {tool} {said}: {outcome}" + (f" ({error})" if error else "")
        with self._lock:
            print(line, file=sys.stderr, flush=True)
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, default=str) + "\n")

    def run(self, tool: str, args: dict[str, Any], fn: Callable[[], T]) -> T:
        """``fn()`` if control is allowed, recorded with its outcome; else
        ControlRefused naming the flag (recorded too)."""
        if not self.allowed:
            self.write(tool, args, "refused", None)
            raise ControlRefused(
                f"{tool} changes the target process and this server was started without {FLAG}",
                hint=f"restart it as: probing mcp {FLAG} (each call is then logged to "
                f"{self.log}); the read-only tools (query, stack, diagnose, ...) work as they are",
            )
        try:
            out = fn()
        except Exception as err:
            self.write(tool, args, "error", str(err))
            raise
        self.write(tool, args, "ok", None)
        return out
