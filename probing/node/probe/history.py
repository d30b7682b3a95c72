"""When a probe's process was traced (``trace.intervals``): each trace's
start and stop, remembered after its tracer is replaced by the next, so
that a diagnosis can judge only the span in which every rank traced
(``probing.analyze.coverage``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from probing.node.bpf.tracer import Tracer

# the traces a probe remembers (trace.intervals): a day of one a minute
KEEP_INTERVALS = 1440


def interval(tracer: Tracer) -> tuple[int, int, str]:
    """(start_ns, stop_ns or 0 while it traces, its families) of ``tracer``."""
    stopped = tracer.stopped_ns if tracer.stopped_ns >= tracer.started_ns else 0
    return tracer.started_ns, stopped, ",".join(f.name for f in tracer.families)


class TraceHistory:
    """The traces of one process before its current tracer, oldest first
    (``KEEP_INTERVALS`` at most), and the rows of ``trace.intervals``."""

    def __init__(self) -> None:
        self.past: list[tuple[int, int, str]] = []  # (start_ns, stop_ns, families)

    def replaced(self, tracer: Tracer | None) -> None:
        """``tracer``, the current one until now: remembered, if it ever started."""
        if tracer is not None and tracer.started_ns:
            self.past.append(interval(tracer))
            del self.past[:-KEEP_INTERVALS]

    def rows(self, current: Tracer | None, died_ns: int | None) -> list[dict[str, Any]]:
        """Each trace's start and stop, the ``current`` one open (``stop_ns``
        None) while it traces, closed at the process's death (``died_ns``) if
        it died tracing."""
        rows: list[dict[str, Any]] = [
            {"start_ns": a, "stop_ns": b, "state": "stopped", "families": f}
            for a, b, f in self.past
        ]
        if current is not None and current.started_ns:
            start, stop, fams = interval(current)
            rows.append({"start_ns": start, "stop_ns": stop or None, "state": "stopped",
                         "families": fams})  # fmt: skip
            if not stop:
                rows[-1]["state"] = "tracing"
        for row in rows:
            if died_ns and (row["stop_ns"] is None or row["stop_ns"] > died_ns):
                row["stop_ns"], row["state"] = died_ns, "died"
        return rows
