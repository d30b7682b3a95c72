"""The detector's analysis of a window of the job's collectives, as
``diagnose`` does it, asked of every rank through the node (``Analyst``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from probing.analyze.detection import (
    ASK_S,
    AUX_S,
    EXPLAIN,
    HANG_AFTER_S,
    RUNQ_S,
    WINDOW_S,
    all_tracing,
    still,
)
from probing.node.detector.groups import Groups
from probing.node.detector.window import ask_cluster

if TYPE_CHECKING:
    import pyarrow as pa

    from probing.node.detector import Answers, Job


class Analyst:
    """The analysis of a window of the job's collectives, as ``diagnose``
    does it, asked of every rank through ``node``: torch's names for the
    groups (``groups``), the ranks that died and who traced when (``aux``,
    asked at full detections), the span judged, the stragglers' causes."""

    def __init__(self, node: Job) -> None:
        self.node = node
        self.groups = Groups()  # torch's names for the job's groups
        self.aux: dict[str, Any] = {}  # dead, intervals: asked at full detections
        self._aux_ns = 0  # when they were asked, and who answered then
        self._aux_who: set[int] = set()
        self._runq: tuple[int, pa.Table | None] | None = None  # (when asked, the answer)

    def ask_aux(self, now: int, table: pa.Table, got: Answers) -> None:
        """The ranks that died and who traced when, and torch's groups where
        due for the window ``table`` (``Groups.due``) that ``got`` answered:
        asked at full detections, used by the analyses the screen starts
        between them. Deaths and spans change seldom: asked again every
        ``AUX_S``, and at once where the ranks that answered changed, one
        stood still (``still``: it died, hangs, or stopped tracing) or the
        spans said one was not tracing (it may trace again)."""
        from probing.analyze.queries import optional, queries

        sql = queries(remote=True)

        def ask(q: str) -> pa.Table:
            return ask_cluster(self.node, q)

        if self.groups.due(table, now):  # torch's names, as diagnose says them
            self.learn_groups(now, table)
        who = {t.rank for t in got.peers}
        if (
            self.aux
            and now - self._aux_ns < AUX_S * 1e9
            and who == self._aux_who
            and not still(table, who, now)
            and all_tracing(self.aux.get("intervals"))
        ):
            return
        self._aux_ns, self._aux_who = now, who
        aux = dict(self.aux)  # the other thread reads them meanwhile: replaced at once
        aux["dead"] = ask(sql["dead"]).to_pylist()
        aux["intervals"] = optional(ask, sql["intervals"])
        self.aux = aux

    def judged(self, table: pa.Table, got: Answers, now: int, runq: bool) -> tuple[pa.Table, Any]:
        """``table`` named by torch's groups and cut to the span every rank
        that answered (``got``) traced in, and its analysis."""
        from probing.analyze.diagnose import analyze, judge
        from probing.analyze.queries import queries

        dead = self.aux["dead"]
        table = self.groups.names(table)
        since = now - int(WINDOW_S * 1e9)
        runq_sql = queries(remote=True)["runq"].format(since_ns=since)

        def ask_runq() -> pa.Table | None:
            return self.runq(now, runq_sql, since)

        answered = sorted({t.rank for t in got.peers})
        table, cov = judge(table, self.aux["intervals"], answered, dead, since, now)
        d = analyze(
            table, now_ns=now, window_s=WINDOW_S, hang_after_s=HANG_AFTER_S,
            dead=dead, runq=ask_runq if runq else None, coverage=cov,
        )  # fmt: skip
        return table, d

    def runq(self, now: int, sql: str, since_ns: int) -> pa.Table | None:
        """How long each rank waited for a CPU from ``since_ns`` (``sql``,
        RUNQ_SQL), asked of every rank where a slow link is suspected: again
        every ``RUNQ_S`` only (a rank's wait changes slowly, and a slow link
        is written after ``GONE_AFTER`` detections in a row that found it).
        The ranks the engine serves answer from what their samplers keep
        (the node's ``runq_since``: no SQL), the others by ``sql``."""
        from probing.analyze.queries import optional

        def ask(q: str) -> pa.Table:
            here = getattr(self.node, "runq_since", None)
            got = here(q, since_ns, timeout=ASK_S) if here is not None else None
            return got[0] if got is not None else ask_cluster(self.node, q)

        kept = self._runq
        if kept is None or not 0 <= now - kept[0] < RUNQ_S * 1e9:
            kept = self._runq = (now, optional(ask, sql))
        return kept[1]

    def learn_groups(self, now: int, table: pa.Table) -> None:
        """torch's groups asked of every rank, for the window ``table``."""
        from probing.analyze.queries import optional, queries

        sql = queries(remote=True)["groups"]
        self.groups.learn(optional(lambda q: ask_cluster(self.node, q), sql), table, now)

    def explain(self, d: Any, table: pa.Table, since: int) -> None:
        """What makes ``d``'s stragglers slow (``d.why``), asked of every rank
        as ``diagnose`` asks it (``EXPLAIN``: their samples, CUDA calls, GPUs
        and CPUs since ``since``) over the window ``table`` analyzed: a
        finding says its cause as the verdict does. Asked only when a
        straggler is written (a few queries, not at every detection)."""
        from probing.analyze import collectives as coll
        from probing.analyze.explain import explain_stragglers, explained
        from probing.analyze.queries import optional, queries

        sql = queries(remote=True)
        got = {
            n: optional(lambda q: ask_cluster(self.node, q), sql[n].format(since_ns=since))
            for n in EXPLAIN
        }
        d.why = explain_stragglers(
            d.stragglers, coll.match(table), got["samples"], got["cuda"], got["nvml"], got["cpu"]
        )
        # a small straggler its samples show nothing of its own for is noise
        # here as in diagnose (``explained``): never written
        d.stragglers, d.why = explained(d.stragglers, d.why)
