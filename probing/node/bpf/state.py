"""The tracer's state, as the probe reports it in ``/trace/status``."""

from __future__ import annotations

from enum import Enum


class TracerState(str, Enum):
    """A ``str`` enum: it compares equal to, and serialises as, its value."""

    STOPPED = "stopped"
    TRACING = "tracing"
    STOPPING = "stopping"

    def __str__(self) -> str:
        return self.value
