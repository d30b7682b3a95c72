"""Always-on detection: while a probe traces, its job is watched with no client.

The job's *detector* is its lowest rank whose process is alive and whose
probe answers (rank 0, while it lives); a tracing rank above it asks the
ranks below it whether they live every ``ELECT_S`` (30 s), from the
lowest, and stops at the first that does. Every ``PROBING_DETECT_S`` (5 s) it asks
every rank for its collectives of the last ``WINDOW_S`` (one cluster query,
as ``diagnose --cluster`` does, without the stacks, samples and NVML), runs
the same analysis and keeps what it finds as ``analyze.findings``: a
straggler, a slow link, a hang, a rank gone (one that did not answer twice
running). A finding is written once, when it is new; its ``cleared_ns`` is
set when it is gone; each new or cleared finding is one ``probing:`` line
on the job's stderr. ``metrics()`` is the OpenMetrics text of ``GET
/metrics``: the step, each rank's lateness, the findings, the events dropped.

The node (``probing.node.cluster.node.ClusterNode``) is handed in: this layer
does not import the cluster's.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from probing.errors import ProbingError, log_unexpected, tell

if TYPE_CHECKING:
    import pyarrow as pa

WINDOW_S = 30.0  # the collectives each detection looks at
HANG_AFTER_S = 10.0  # a collective some rank never entered for this long is a hang
GONE_AFTER = 2  # detections in a row: a peer missing to be gone, a link slow to be slow
ELECT_S = 30.0  # how often a rank above the detector checks that the ranks below live
ALIVE = json.dumps({"sql": "SELECT alive FROM process.info", "format": "json"}).encode()
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


def detect_s() -> float:
    """``PROBING_DETECT_S``: seconds between detections (5; 0 turns it off)."""
    from probing import config

    try:
        return float(config.load().detect_s)
    except ValueError:  # a bad value: the default (its probe said so at start-up)
        return 5.0


class Watch:
    """The detector of one probe (``start`` once; it detects only while
    ``tracing()`` and this probe is the job's detector)."""

    def __init__(
        self,
        node: Any,
        tracing: Callable[[], bool],
        dropped: Callable[[], dict[str, int]],
        every_s: float | None = None,
    ) -> None:
        self.node = node
        self.tracing = tracing
        self.dropped = dropped
        self.every_s = detect_s() if every_s is None else every_s
        self.findings: list[dict[str, Any]] = []
        self.active: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.step_s: float | None = None
        self.lateness_s: dict[tuple[int, str], float] = {}
        self.detections = 0
        self.last_error: str | None = None
        self._misses: dict[int, int] = {}
        self._slow: dict[str, int] = {}  # comm -> detections in a row that found it slow
        self._elected: tuple[float, bool] | None = None  # (when, whether I detect)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.every_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="probing-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def detector(self) -> bool:
        """Whether this probe watches the job: no rank below it lives and
        answers (learned again every ``ELECT_S``)."""
        now = time.monotonic()
        if self._elected is not None and now - self._elected[0] < ELECT_S:
            return self._elected[1]
        mine = True
        for rank in range(self.node.rank):  # from the lowest: rank 0 answers, as a rule
            [row] = self.node.fan_out("/query", ALIVE, 3.0, {rank}) or [{"status": 0, "addr": ""}]
            if row["status"] == 200 and not any(r.get("alive") for r in row.get("reply") or []):
                continue  # died: its probe answers for it
            if row["status"] == 0 and row.get("addr"):
                continue  # gone: refused, unreachable, no answer in time
            mine = False  # it lives, or is not known yet (not discovered): not me
            break
        self._elected = (now, mine)
        return mine

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                if not self.tracing() or self.node.learning or not self.detector():
                    continue
                self.once()
            except ProbingError as err:  # peers, queries: said in nvml-like status, tried again
                self.last_error = str(err)
            except Exception as err:  # noqa: BLE001 - the top of a probe thread: logged, goes on
                self.last_error = f"{type(err).__name__}: {err}"
                log_unexpected("detection", err)

    def once(self, now_ns: int | None = None) -> list[dict[str, Any]]:
        """One detection: ask, analyze, record; the findings new in it."""
        from probing.analyze.diagnose import (
            analyze,
            death_text,
            judge,
            optional,
            queries,
            with_groups,
        )  # fmt: skip

        now = now_ns or time.time_ns()
        sql = queries(remote=True)
        timeout = min(5.0, max(1.0, self.every_s))
        since = now - int(WINDOW_S * 1e9)

        def ask(q: str) -> pa.Table:
            return self.node.coordinate(q, timeout=timeout)[0]

        table, got, _ = self.node.coordinate(
            sql["collectives"].format(since_ns=since), timeout=timeout
        )
        groups = optional(ask, sql["groups"])  # torch's names, as diagnose says them
        if groups is not None:
            table = with_groups(table, groups)
        runq_sql = sql["runq"].format(since_ns=since)
        dead = ask(sql["dead"]).to_pylist()
        # judged only over the span in which every rank that answered traced
        answered = sorted({t.rank for t in got.peers})
        table, cov = judge(table, optional(ask, sql["intervals"]), answered, dead, since, now)
        d = analyze(
            table, now_ns=now, window_s=WINDOW_S, hang_after_s=HANG_AFTER_S,
            dead=dead, runq=lambda: optional(ask, runq_sql), coverage=cov,
        )  # fmt: skip
        found: dict[tuple[Any, ...], dict[str, Any]] = {}
        for s in d.stragglers:
            found[("straggler", s.rank, s.comm)] = _row(
                "straggler", s.rank, s.node, s.comm, s.since, s.since_ns,
                f"rank {s.rank} on node {s.node} arrives {s.lag_ms_mean:.0f} ms late (mean) at "
                f"{100 * s.last_share:.0f} % of {s.op}s on {s.comm}; the job loses "
                f"~{100 * s.share_of_step:.0f} % of its step time",
            )  # fmt: skip
        seen = {link.comm for link in d.slow_links}
        self._slow = {c: self._slow.get(c, 0) + 1 for c in seen}  # detections in a row
        for link in d.slow_links:
            if self._slow[link.comm] < GONE_AFTER:  # once: a busy CPU slows every rank alike
                continue
            found[("slow_link", link.comm)] = _row(
                "slow_link", None, ",".join(link.nodes), link.comm, link.since, link.since_ns,
                f"slow link: {link.op} on {link.comm} takes {link.transfer_ms_median:.0f} ms "
                f"on every rank (model {link.baseline_ms:.1f} ms)",
            )  # fmt: skip
        for h in d.hangs:
            missing = ", ".join(str(r) for r in h.missing_ranks) or "?"
            found[("hang", h.comm, h.seq)] = _row(
                "hang", h.missing_ranks[0] if h.missing_ranks else None, None, h.comm, None,
                None, f"hang: {h.op} #{h.seq} on {h.comm} for {h.age_s:.0f} s; rank(s) "
                f"{missing} never entered it",
            )  # fmt: skip
        for r, x in d.dead.items():  # killed: its probe answers with what it left
            found[("rank_gone", r)] = _row(
                "rank_gone", r, None, None, None, x.died_ns or None, death_text({r: x})
            )
        for m in got.missing:
            self._misses[m.rank] = self._misses.get(m.rank, 0) + 1
            if self._misses[m.rank] >= GONE_AFTER:
                found[("rank_gone", m.rank)] = _row(
                    "rank_gone", m.rank, m.node, None, None, None,
                    f"rank {m.rank} ({m.node or m.addr}) does not answer: {m.reason}",
                )  # fmt: skip
        for r in answered:
            self._misses.pop(r, None)
        return self._record(now, found, d)

    def _record(
        self, now: int, found: dict[tuple[Any, ...], dict[str, Any]], d: Any
    ) -> list[dict[str, Any]]:
        new = []
        with self._lock:
            self.detections += 1
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
            cleared = [k for k in self.active if k not in found]
            for key in cleared:
                self.active.pop(key)["cleared_ns"] = now
            if len(self.findings) > KEEP:
                done = [f for f in self.findings if f["cleared_ns"] is not None]
                drop = {id(f) for f in done[: len(self.findings) - KEEP]}
                self.findings = [f for f in self.findings if id(f) not in drop]
        for row in new:
            tell(f"finding: {row['text']}", self.node.pid)
        for key in cleared:
            tell(f"finding cleared: {key[0]} {', '.join(str(k) for k in key[1:])}", self.node.pid)
        log_findings([*new, *(f for f in self.findings if f["cleared_ns"] == now)], self.node.pid)
        return new

    def table(self) -> pa.Table:
        import pyarrow as pa

        with self._lock:
            rows = [dict(f) for f in self.findings]
        return pa.Table.from_pylist(rows, schema=findings_schema())

    def metrics(self) -> str:
        """OpenMetrics text: what this probe's detections and tracer say."""
        with self._lock:
            step, late = self.step_s, dict(self.lateness_s)
            active: dict[str, int] = {}
            for key in self.active:
                active[key[0]] = active.get(key[0], 0) + 1
            detections = self.detections
        return openmetrics(step, late, active, self.dropped(), detections)


def _row(
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
    return findings_schema().empty_table()
