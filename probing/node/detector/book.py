"""What a job's detector keeps of its findings (``Book``, under one lock: the
look's and the full detection's threads write there) and where each new or
cleared one goes: the job's stderr and the user's ``findings.jsonl``
(``log_findings``, which the agent follows: ``probing.node.findings``).
What a finding is and the OpenMetrics text: ``probing.analyze.findings``."""

from __future__ import annotations

import json
import threading
from logging import INFO
from typing import TYPE_CHECKING, Any

from probing.analyze.findings import CLEAR_AFTER, KEEP, Key, Over, findings_schema, openmetrics
from probing.errors import tell

if TYPE_CHECKING:
    import pyarrow as pa


class Book:
    """One detector's findings, keyed ``(kind, ...)`` (a straggler by its rank
    alone: one problem, one finding, whatever its group is called): each
    written once, when new, and cleared (``cleared_ns``) once ``CLEAR_AFTER``
    full detections in a row saw it over; the step, each rank's lateness and
    each straggler's cost of the last analysis. ``lock`` guards them (the
    detector's two threads write here)."""

    def __init__(self) -> None:
        self.findings: list[dict[str, Any]] = []
        self.active: dict[Key, dict[str, Any]] = {}
        self.misses: dict[Key, int] = {}  # active key -> full detections in a row that saw it over
        self.step_s: float | None = None
        self.lateness_s: dict[tuple[int, str], float] = {}
        # an active straggler's rank -> (node, s late a step, share of the step lost)
        self.costs: dict[int, tuple[str, float, float]] = {}
        self.detections = 0
        self.lock = threading.Lock()

    def record(
        self, now: int, found: dict[Key, dict[str, Any]], d: Any, pid: int | None,
        over: Over | None = None,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Write what is new in ``found`` (keyed ``(kind, ...)``); with ``over``
        (a full detection), count each active finding not in it that ``over``
        says is over, and clear it at ``CLEAR_AFTER`` in a row (one it says
        is still there starts the count again; one it cannot tell leaves it).
        ``d``: the analysis that found them, whose step, lateness and
        stragglers ``/metrics`` says; ``pid``: the process whose stderr is told."""
        new = []
        cleared: list[Key] = []
        with self.lock:
            self.step_s = d.summary.step_ms / 1e3 if d.summary.step_ms else None
            self.lateness_s = {
                (int(r["rank"]), str(r.get("node") or "")): float(r["lag_ms_mean"]) / 1e3
                for r in d.ranks
                if r.get("lag_ms_mean") is not None
            }
            for key, row in found.items():
                self.misses.pop(key, None)
                if key not in self.active:
                    row["ts"] = now
                    self.active[key] = row
                    self.findings.append(row)
                    new.append(row)
                self.active[key]["seen_ns"] = max(now, self.active[key].get("seen_ns") or 0)
            for s in d.stragglers:  # the verdict's figures of each straggler written
                if ("straggler", s.rank) in self.active:
                    self.costs[s.rank] = (s.node, s.late_ms / 1e3, s.share_of_step)
            if over is not None:  # not what the other thread wrote from newer rows meanwhile
                for key, f in self.active.items():
                    if key in found or f["ts"] > now:
                        continue
                    said = over(key)
                    if said is None:
                        continue
                    self.misses[key] = self.misses.get(key, 0) + 1 if said else 0
                    if self.misses[key] >= CLEAR_AFTER:
                        cleared.append(key)
            for key in cleared:
                self.misses.pop(key, None)
                if key[0] == "straggler":
                    self.costs.pop(key[1], None)
                self.active.pop(key)["cleared_ns"] = now
            if len(self.findings) > KEEP:
                done = [f for f in self.findings if f["cleared_ns"] is not None]
                drop = {id(f) for f in done[: len(self.findings) - KEEP]}
                self.findings = [f for f in self.findings if id(f) not in drop]
        for row in new:
            tell(f"finding: {row['text']}", pid)
        for key in cleared:
            tell(f"finding cleared: {key[0]} {', '.join(str(k) for k in key[1:])}", pid, INFO)
        gone = [f for f in self.findings if f["cleared_ns"] == now] if cleared else []
        log_findings([*new, *gone], pid)
        return new

    def table(self) -> pa.Table:
        """``analyze.findings``: every finding kept, active and cleared."""
        import pyarrow as pa

        with self.lock:
            rows = [dict(f) for f in self.findings]
        return pa.Table.from_pylist(rows, schema=findings_schema())

    def metrics(self, dropped: dict[str, int]) -> str:
        """OpenMetrics text: what the detections say, and the events ``dropped``."""
        with self.lock:
            step, late = self.step_s, dict(self.lateness_s)
            active: dict[str, int] = {}
            for key in self.active:
                active[key[0]] = active.get(key[0], 0) + 1
            detections = self.detections
            costs = dict(self.costs)
        return openmetrics(step, late, active, dropped, detections, costs)


def log_findings(rows: list[dict[str, Any]], pid: int | None) -> None:
    """Each new or cleared finding as one line of ``findings.jsonl``
    (``probing.paths.findings_log``), one ``write`` each, appended, with
    ``pid`` (the detector's process, whose stderr is told), ``pid_started``
    (its start, ``proc.started``: a later process given the same pid is not
    it) and ``host``. Never raises."""
    import os
    import socket

    from probing import paths, proc

    if not rows:
        return
    host = socket.gethostname()
    started = proc.started(pid) if pid is not None else None
    try:
        fd = os.open(paths.findings_log(), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                     0o600)  # fmt: skip
    except OSError:  # no runtime directory (a probe stopped meanwhile): the table has them
        return
    try:
        for row in rows:
            entry = {**row, "pid": pid, "pid_started": started, "host": host}
            os.write(fd, (json.dumps(entry, default=str) + "\n").encode())
    except OSError:
        pass
    finally:
        os.close(fd)
