"""The findings of a job's always-on detector (``probing.analyze.watch``):
what is kept of each (``analyze.findings``), and where they go: the job's
stderr, the user's ``findings.jsonl`` and the OpenMetrics text of ``GET
/metrics``."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from logging import INFO
from typing import TYPE_CHECKING, Any

from probing.errors import tell

if TYPE_CHECKING:
    import pyarrow as pa

KEEP = 1000  # findings kept (the oldest cleared ones go first)
# full detections in a row that see a finding over before it is cleared: one
# that misses it (a rank's answer late, a noisy window, a group named anew) is
# no end (15 s at a detection every 5 s, its 30 s windows mostly healthy by then)
CLEAR_AFTER = 3


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
            ("cleared_ns", pa.int64()),  # wall ns of the detection that cleared it; NULL: active
            ("seen_ns", pa.int64()),  # wall ns of the last detection that found it
        ]
    )


Key = tuple[Any, ...]
# whether a full detection saw a finding over (True), still there by a lower
# bar than the one that named it (False), or could not tell (None)
Over = Callable[[Key], bool | None]


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


def row(
    kind: str, rank: int | None, node: str | None, comm: str | None, since: str | None,
    since_ns: int | None, text: str,
) -> dict[str, Any]:  # fmt: skip
    return {"ts": 0, "kind": kind, "rank": rank, "node": node, "comm": comm, "text": text,
            "since": since, "since_ns": since_ns, "cleared_ns": None, "seen_ns": None}  # fmt: skip


KINDS = ("straggler", "slow_link", "hang", "rank_gone")


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


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def openmetrics(
    step_s: float | None,
    lateness_s: dict[tuple[int, str], float],
    active: dict[str, int],
    dropped: dict[str, int],
    detections: int,
    costs: dict[int, tuple[str, float, float]] | None = None,
) -> str:
    """The text format of OpenMetrics 1.0 (``# EOF`` last). ``costs``: each
    active straggler's node, seconds late a step and share of the step lost,
    as the verdict says them (``probing.analyze.verdict.straggler_text``)."""
    out = [
        "# TYPE probing_step_seconds gauge",
        "# HELP probing_step_seconds the job's training step: the median time of one period "
        "of the pattern its collectives repeat (as diagnose says it)",
    ]
    if step_s is not None:
        out.append(f"probing_step_seconds {step_s:.6f}")
    out += [
        "# TYPE probing_straggler_late_seconds gauge",
        "# HELP probing_straggler_late_seconds how late an active straggler makes each step "
        "of the job (the verdict's ms late each step)",
    ]
    for rank, (node, late, _) in sorted((costs or {}).items()):
        out.append(
            f'probing_straggler_late_seconds{{rank="{rank}",node="{_label(node)}"}} {late:.6f}'
        )
    out += [
        "# TYPE probing_straggler_step_share gauge",
        "# HELP probing_straggler_step_share the share of the job's step time an active "
        "straggler costs (the verdict's share the job loses)",
    ]
    for rank, (node, _, share) in sorted((costs or {}).items()):
        out.append(
            f'probing_straggler_step_share{{rank="{rank}",node="{_label(node)}"}} {share:.4f}'
        )
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
