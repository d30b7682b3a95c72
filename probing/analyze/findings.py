"""The findings of a job's always-on detector (``probing.node.detector``),
as tables and text: the columns of ``analyze.findings``, a finding's row
and key, when one is cleared (``CLEAR_AFTER``), and the OpenMetrics text of
``GET /metrics``. The detector's book of them, its lock and its
``findings.jsonl`` are ``probing.node.detector.book``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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


def row(
    kind: str, rank: int | None, node: str | None, comm: str | None, since: str | None,
    since_ns: int | None, text: str,
) -> dict[str, Any]:  # fmt: skip
    return {"ts": 0, "kind": kind, "rank": rank, "node": node, "comm": comm, "text": text,
            "since": since, "since_ns": since_ns, "cleared_ns": None, "seen_ns": None}  # fmt: skip


KINDS = ("straggler", "slow_link", "hang", "rank_gone")


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
