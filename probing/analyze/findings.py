"""The findings of a job's always-on detector (``probing.analyze.watch``):
what is kept of each (``analyze.findings``), and where they go: the job's
stderr, the user's ``findings.jsonl`` and the OpenMetrics text of ``GET
/metrics``."""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

from probing.errors import tell

if TYPE_CHECKING:
    import pyarrow as pa

KEEP = 1000  # findings kept (the oldest cleared ones go first)


def findings_schema() -> pa.Schema:
    """``analyze.findings`` (pyarrow loads with the first query, not before)."""
    import pyarrow as pa

    return pa.schema(
        [
            ("ts", pa.int64()),  # wall ns of the detection that found it
            ("kind", pa.string()),  # straggler | slow_link | hang | rank_gone
            ("rank", pa.int64()),  # the rank to blame (a hang: the first that never entered)
            ("node", pa.string()),
            ("comm", pa.string()),
            ("text", pa.string()),
            ("since", pa.string()),  # ISO time it began, as the analysis tells
            ("since_ns", pa.int64()),
            ("cleared_ns", pa.int64()),  # wall ns of the first detection without it; NULL: active
        ]
    )


class Book:
    """One detector's findings, keyed ``(kind, ...)``: each written once, when
    new, and cleared (``cleared_ns``) at the first full detection without it;
    the step and each rank's lateness of the last analysis. ``lock``
    guards them (the detector's two threads write here)."""

    def __init__(self) -> None:
        self.findings: list[dict[str, Any]] = []
        self.active: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.step_s: float | None = None
        self.lateness_s: dict[tuple[int, str], float] = {}
        self.detections = 0
        self.lock = threading.Lock()

    def record(
        self, now: int, found: dict[tuple[Any, ...], dict[str, Any]], d: Any, clear: bool,
        pid: int | None,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Write what is new in ``found`` (keyed ``(kind, ...)``); with
        ``clear``, clear what is not in it. ``d``: the analysis that found
        them, whose step and lateness ``/metrics`` says; ``pid``: the
        process whose stderr is told."""
        new = []
        cleared: list[tuple[Any, ...]] = []
        with self.lock:
            self.step_s = d.summary.step_ms / 1e3 if d.summary.step_ms else None
            self.lateness_s = {
                (int(r["rank"]), str(r.get("node") or "")): float(r["lag_ms_mean"]) / 1e3
                for r in d.ranks
                if r.get("lag_ms_mean") is not None
            }
            for key, row in found.items():
                if key not in self.active:
                    row["ts"] = now
                    self.active[key] = row
                    self.findings.append(row)
                    new.append(row)
            if clear:  # not what the other thread wrote from newer rows meanwhile
                cleared = [k for k, f in self.active.items() if k not in found and f["ts"] <= now]
            for key in cleared:
                self.active.pop(key)["cleared_ns"] = now
            if len(self.findings) > KEEP:
                done = [f for f in self.findings if f["cleared_ns"] is not None]
                drop = {id(f) for f in done[: len(self.findings) - KEEP]}
                self.findings = [f for f in self.findings if id(f) not in drop]
        for row in new:
            tell(f"finding: {row['text']}", pid)
        for key in cleared:
            tell(f"finding cleared: {key[0]} {', '.join(str(k) for k in key[1:])}", pid)
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
        return openmetrics(step, late, active, dropped, detections)


def row(
    kind: str, rank: int | None, node: str | None, comm: str | None, since: str | None,
    since_ns: int | None, text: str,
) -> dict[str, Any]:  # fmt: skip
    return {"ts": 0, "kind": kind, "rank": rank, "node": node, "comm": comm, "text": text,
            "since": since, "since_ns": since_ns, "cleared_ns": None}  # fmt: skip


KINDS = ("straggler", "slow_link", "hang", "rank_gone")


def log_findings(rows: list[dict[str, Any]], pid: int | None) -> None:
    """Each new or cleared finding as one line of ``findings.jsonl``
    (``probing.paths.findings_log``), one ``write`` each, appended. Never raises."""
    import os
    import socket

    from probing import paths

    if not rows:
        return
    host = socket.gethostname()
    try:
        fd = os.open(paths.findings_log(), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                     0o600)  # fmt: skip
    except OSError:  # no runtime directory (a probe stopped meanwhile): the table has them
        return
    try:
        for row in rows:
            line = json.dumps({**row, "pid": pid, "host": host}, default=str) + "\n"
            os.write(fd, line.encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def openmetrics(
    step_s: float | None,
    lateness_s: dict[tuple[int, str], float],
    active: dict[str, int],
    dropped: dict[str, int],
    detections: int,
) -> str:
    """The text format of OpenMetrics 1.0 (``# EOF`` last)."""
    out = [
        "# TYPE probing_step_seconds gauge",
        "# HELP probing_step_seconds median interval between the busiest group's collectives",
    ]
    if step_s is not None:
        out.append(f"probing_step_seconds {step_s:.6f}")
    out += [
        "# TYPE probing_rank_lateness_seconds gauge",
        "# HELP probing_rank_lateness_seconds mean arrival after the first rank at a collective",
    ]
    for (rank, node), value in sorted(lateness_s.items()):
        out.append(
            f'probing_rank_lateness_seconds{{rank="{rank}",node="{_label(node)}"}} {value:.6f}'
        )
    out += [
        "# TYPE probing_findings gauge",
        "# HELP probing_findings findings active now, by kind (analyze.findings)",
    ]
    out += [f'probing_findings{{kind="{k}"}} {active.get(k, 0)}' for k in KINDS]
    out += [
        "# TYPE probing_events_dropped counter",
        "# HELP probing_events_dropped events a full ring buffer dropped, by family",
    ]
    out += [
        f'probing_events_dropped_total{{family="{_label(f)}"}} {n}'
        for f, n in sorted(dropped.items())
    ]
    out += [
        "# TYPE probing_detections counter",
        "# HELP probing_detections detections run by this probe",
        f"probing_detections_total {detections}",
        "# EOF",
    ]
    return "\n".join(out) + "\n"


def empty() -> pa.Table:
    """``analyze.findings`` of a process with no detector."""
    return findings_schema().empty_table()
