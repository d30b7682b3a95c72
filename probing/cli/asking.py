"""Asking every rank of a job what a diagnosis needs, and watching a stall:
the questions (``probing.analyze.queries``) asked at once, the counts polled
while they stand still, the answers handed to the pure analysis
(``probing.analyze.diagnose.analyze``)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import pyarrow as pa

from probing.analyze import collectives as coll
from probing.analyze import coverage as cv
from probing.analyze import flight as fl
from probing.analyze import hangs as hg
from probing.analyze.diagnose import Diagnosis, analyze, callsites, healthy, judge, whole_verdict
from probing.analyze.explain import explain_stage, explain_stragglers, explained
from probing.analyze.gather import missing_ranks, with_groups
from probing.analyze.queries import optional, queries
from probing.errors import ProbingError


class AskedRanks(Protocol):
    """The ranks a diagnosis asks (``probing.cli.client.JobClient``: local pids over
    their sockets, or the cluster through one probe)."""

    @property
    def remote(self) -> bool:
        """Through a cluster query: no python.`expr` tables."""
        ...

    def ask(self, sql: str) -> pa.Table:
        """``sql`` in every rank: one table, rows tagged ``node`` and ``rank``."""
        ...

    def trace_starts_ns(self) -> list[int]:
        """When each local probe that traces started tracing (none remotely)."""
        ...


def diagnose(
    job: AskedRanks,
    *,
    window_s: float = 60.0,
    hang_after_s: float = hg.HANG_AFTER_S,
    on_wait: Callable[[float], None] | None = None,
    now_ns: int | None = None,
    eager: bool = False,
) -> tuple[Diagnosis, pa.Table]:
    """Ask every rank of ``job``, analyze, and return the diagnosis and the
    gathered collectives.

    ``eager`` asks what explaining a straggler takes (and the Flight Recorder's
    rows) with the first questions, before the analysis says it is needed:
    the probes are waited on once, not three times, for a page that waits.

    When the ranks stand apart (their counts, the Flight Recorder, or their
    stacks: some in a collective, others not) but nothing traced dates the
    stall as a hang, they are watched (``Stillness``) until they have stood
    still for ``hang_after_s`` (what the recorder saw of it counted; ``on_wait``
    is told how long that will take) or move: a hang asked about early is
    named once it is one, not left for the user to ask again.
    """
    t0 = time.perf_counter()
    now = now_ns or time.time_ns()  # (given: a test's clock)
    sql = queries(remote=job.remote)
    since = now - int(window_s * 1e9)
    # what every diagnosis asks, asked at once (each waits on the probes, not the CPU)
    heard = Unheard(job.ask)  # the ranks any answer lacked, whichever question it was
    ask = asked_at_once(heard.ask, _first_questions(sql, since, job.remote, eager))
    got = _gather(ask, sql, job.remote, since, now, window_s, hang_after_s)
    # the trace tells how long nothing moved only while every rank traces; else
    # the counts are watched (below)
    traced_now = got.coverage is None or got.coverage.now
    # how long nothing moved, by the trace; nothing said where a rank's trace went unheard
    heard_all = traced_now and not missing_ranks(got.table)
    stalled = round(_stalled_s(got.table, now, job.trace_starts_ns), 1) if heard_all else 0.0
    runq = functools.partial(optional, ask, sql["runq"].format(since_ns=since))
    matched = coll.match(got.table)  # once: each analyze below, and why a straggler is slow

    def analyzed(stalled_s: float, at_ns: int) -> Diagnosis:
        return analyze(
            got.table, frames=got.frames, states=got.states, stalled_s=stalled_s, now_ns=at_ns,
            window_s=window_s, hang_after_s=hang_after_s, recorded=got.recorded,
            ranks_of=got.ranks_of, dead=got.dead, runq=runq, matched=matched,
            coverage=got.coverage, missing=heard.missing(),
        )  # fmt: skip

    d = analyzed(stalled, now)
    progressing = (
        traced_now and got.table.num_rows > 0 and stalled < 1.0
    )  # traced in the last second
    if not d.hangs and not progressing and stalled < hang_after_s and _apart(got, now):
        stalled = max(stalled, _recorded_age(got.recorded, now))  # the recorder saw it begin
        watch = Stillness(ask, sql, job.remote)
        watched = watch.stood_still(got, stalled, hang_after_s, on_wait)
        if watched is not None:  # still all along: where each rank waits now
            got.frames = _frames_by_rank(ask(sql["stacks"]))
            got.states = [
                dataclasses.replace(s, frames=got.frames.get(s.rank, [])) for s in got.states
            ]
            got.recorded = watch.recorded or got.recorded
            d = analyzed(round(stalled + time.monotonic() - watched, 1), time.time_ns())
    if d.stragglers or (d.pipeline is not None and d.pipeline.slow is not None):
        ask = _explain(d, ask, sql, since, matched, got.coverage)
    if d.stragglers or d.hangs:
        d.callsites = _callsites(ask, sql["callsites"].format(since_ns=since))
    d.elapsed_s = round(time.perf_counter() - t0, 3)
    return d, got.table


class Unheard:
    """``ask`` that keeps the ranks each answer lacked (``missing_ranks``): a
    rank whose engine answers its collectives but whose stopped process
    cannot give its stacks is not heard from either."""

    def __init__(self, ask: Callable[[str], pa.Table]) -> None:
        self._ask = ask
        self._gone: dict[str, str] = {}  # who -> the first answer that lacked it

    def ask(self, sql: str) -> pa.Table:
        answer = self._ask(sql)
        for said in missing_ranks(answer):  # "rank 3 (vm): why": each rank once
            self._gone.setdefault(said.split(": ", 1)[0], said)
        return answer

    def missing(self) -> list[str]:
        return list(self._gone.values())


POLL_S = 0.25  # how often the counts are asked while a stall is watched


@dataclasses.dataclass
class _Asked:
    """What every diagnosis asks of every rank, gathered (``_gather``)."""

    table: pa.Table  # the collectives, cut to the span every rank traced in (``judge``)
    frames: dict[int, list[dict[str, Any]]]  # rank -> its threads' frames (STACKS_SQL)
    states: list[hg.RankState]  # each rank's counts and frames
    ranks_of: dict[str, list[int]]  # process group -> its global ranks (comm.groups)
    dead: list[dict[str, Any]]  # DEAD_SQL's rows
    recorded: fl.Gathered | None  # torch's Flight Recorder, traced or not
    coverage: cv.Coverage | None  # the span every rank traced in (trace.intervals)


def _first_questions(
    sql: dict[str, str], since_ns: int, remote: bool, eager: bool
) -> tuple[str, ...]:
    """What every diagnosis asks, the collectives first; with ``eager``, what
    explaining a straggler takes and the Flight Recorder's rows too."""
    tags = ", node, rank" if remote else ""
    first: tuple[str, ...] = (
        sql["collectives"].format(since_ns=since_ns), sql["groups"], sql["stacks"],
        sql["counts"], sql["dead"], fl.STATUS_SQL.format(tags=tags), sql["intervals"])  # fmt: skip
    if eager:
        explain = ("samples", "cuda", "nvml", "cpu", "callsites")
        first += (
            fl.FLIGHT_SQL.format(tags=tags),
            *(sql[n].format(since_ns=since_ns) for n in explain),
        )
    return first


def _gather(
    ask: Callable[[str], pa.Table],
    sql: dict[str, str],
    remote: bool,
    since_ns: int,
    now_ns: int,
    window_s: float,
    hang_after_s: float,
) -> _Asked:
    """Every rank's collectives (with the calls before a hang: ``_with_history``),
    groups, stacks, counts, deaths and Flight Recorder; the collectives judged
    over the span every rank that answered traced in. A part a probe lacks is
    left out."""
    table = ask(sql["collectives"].format(since_ns=since_ns))
    table = _with_history(table, ask, sql["collectives"], now_ns, window_s, hang_after_s)
    ranks_of: dict[str, list[int]] = {}
    try:
        groups = ask(sql["groups"])
        table = with_groups(table, groups)
        ranks_of = {g["pg"]: g["ranks"] for g in groups.to_pylist() if g.get("ranks")}
    except ProbingError:  # a probe without comm.groups: communicators matched by size
        pass
    frames = _frames_by_rank(ask(sql["stacks"]))
    states = _states(ask, frames, sql)
    try:
        dead = ask(sql["dead"]).to_pylist()
    except ProbingError:  # a probe of an older probing: no died_ns
        dead = []
    recorded = fl.gather(ask, remote)  # torch's Flight Recorder, traced or not
    answered = _ranks_of(table) | set(frames) | {s.rank for s in states}
    intervals = optional(ask, sql["intervals"])
    table, cov = judge(table, intervals, sorted(answered), dead, since_ns, now_ns)
    return _Asked(table, frames, states, ranks_of, dead, recorded, cov)


def _apart(got: _Asked, now_ns: int) -> bool:
    """Whether the ranks stand apart, however briefly, by any evidence: their
    counts differ, the Flight Recorder has a group stalled (however young),
    or their stacks put some in a collective and others not."""
    if _counts_differ(got.states):
        return True
    recorded = got.recorded
    if recorded is not None and fl.stalls(recorded.rows, recorded.status, now_ns, 0.0):
        return True
    inside = {hg.in_collective(s.frames) for s in got.states if s.frames}
    return inside == {True, False}


def _recorded_age(recorded: fl.Gathered | None, now_ns: int) -> float:
    """How long the Flight Recorder's youngest stall has lasted (0: none)."""
    if recorded is None:
        return 0.0
    ages = [s.age_s for s in fl.stalls(recorded.rows, recorded.status, now_ns, 0.0)]
    return round(min(ages), 1) if ages else 0.0


class Stillness:
    """A stall watched until it has lasted ``--hang-after`` or moves: each
    rank's counts, where each stands in the Flight Recorder, and which ranks
    sit in a collective by their stacks, asked every ``POLL_S``. A rank whose
    stacks stop answering ends the watch: still is never said of what was
    not heard."""

    def __init__(self, ask: Callable[[str], pa.Table], sql: dict[str, str], remote: bool) -> None:
        self.ask = ask
        self.sql = sql
        self.remote = remote
        self.recorded: fl.Gathered | None = None  # the Flight Recorder as last asked

    def _now(self, got: _Asked) -> tuple[Any, ...]:
        """Where every rank stands now, by each evidence the probes give."""
        counts = [s.counts for s in _states(self.ask, got.frames, self.sql)]
        self.recorded = fl.gather(self.ask, self.remote) if got.recorded is not None else None
        places = fl.places(self.recorded.rows) if self.recorded is not None else {}
        frames = _frames_by_rank(self.ask(self.sql["stacks"]))
        if set(frames) != set(got.frames):  # a rank unheard: its stillness is unknown
            return (None, time.monotonic())  # never the same twice: no hang by the watch
        inside = sorted(r for r, f in frames.items() if hg.in_collective(f))
        return counts, {g: {r: (p.entered, p.completed) for r, p in m.items()}
                        for g, m in places.items()}, inside  # fmt: skip

    def stood_still(
        self,
        got: _Asked,
        stalled_s: float,
        hang_after_s: float,
        on_wait: Callable[[float], None] | None,
    ) -> float | None:
        """Asked every ``POLL_S`` until the ranks have stood still
        ``hang_after_s`` in all (``stalled_s`` of it gone already): when the
        watch began (``time.monotonic()``), or None where one moved. ``on_wait``
        is told how long that will take."""
        watched = time.monotonic()
        if on_wait is not None:
            on_wait(hang_after_s - stalled_s)
        first = self._now(got)
        while stalled_s + time.monotonic() - watched < hang_after_s:
            time.sleep(POLL_S)
            if self._now(got) != first:
                return None
        return watched


def _explain(
    d: Diagnosis,
    ask: Callable[[str], pa.Table],
    sql: dict[str, str],
    since_ns: int,
    matched: list[coll.Collective],
    coverage: cv.Coverage | None,
) -> Callable[[str], pa.Table]:
    """What makes ``d``'s stragglers (or its pipeline's slow stage) slow, asked
    at once, into ``d.why`` and said in its verdict; returns ``ask`` with the
    stragglers' callsites already on their way."""
    extra_sql = {n: sql[n].format(since_ns=since_ns) for n in ("samples", "cuda", "nvml", "cpu")}
    sites = [sql["callsites"].format(since_ns=since_ns)] if d.stragglers else []
    ask = asked_at_once(ask, (*extra_sql.values(), *sites))
    extra = {n: optional(ask, q) for n, q in extra_sql.items()}
    d.why = explain_stragglers(
        d.stragglers, matched, extra["samples"], extra["cuda"], extra["nvml"], extra["cpu"],
    )  # fmt: skip
    d.stragglers, d.why = explained(d.stragglers, d.why)
    d.why += explain_stage(d.pipeline, extra["samples"], d.stragglers)
    # found in the trace, with no hang: nothing the Flight Recorder would add
    d.verdict = whole_verdict(d, coverage, traced=True)
    d.healthy = healthy(d)  # a straggler taken for noise leaves the job healthy
    return ask


def _callsites(ask: Callable[[str], pa.Table], sql: str) -> dict[int, str]:
    """Each rank's most frequent collective callsite (``callsites``); none from
    a trace without Python stacks."""
    try:
        return callsites(ask(sql))
    except ProbingError:
        return {}


def _frames_by_rank(table: pa.Table) -> dict[int, list[dict[str, Any]]]:
    """STACKS_SQL's rows, by rank."""
    out: dict[int, list[dict[str, Any]]] = {}
    for row in table.to_pylist():
        out.setdefault(row["rank"], []).append(row)
    return out


def _states(
    ask: Callable[[str], pa.Table], frames: dict[int, list[dict[str, Any]]], sql: dict[str, str]
) -> list[hg.RankState]:
    """Each rank's count of collectives per process group (torch's, where the
    probe can ask it: COUNTS_SQL) with its ``frames``."""
    try:
        counts = ask(sql["counts"])
    except ProbingError:  # python.`expr` is local-only: remote ranks give stacks only
        counts = pa.table({"rank": pa.array([], pa.int64())})
    per: dict[int, dict[str, int]] = {}
    nodes: dict[int, str] = {}
    if "count" in counts.column_names:
        for row in counts.to_pylist():
            per.setdefault(row["rank"], {})[row["group"]] = int(row["count"])
            nodes[row["rank"]] = row["node"]
    for r, rows in frames.items():
        nodes.setdefault(r, str(rows[0].get("node") or "") if rows else "")
    return [
        hg.RankState(r, nodes.get(r, ""), per.get(r, {}), frames.get(r, []))
        for r in sorted(set(per) | set(frames))
    ]


# questions in flight at once: a probe answers PROBING_WORKERS (8) requests at a
# time, and a cluster query holds one while its peers answer theirs
AT_ONCE = 4


def asked_at_once(ask: Callable[[str], pa.Table], sqls: Sequence[str]) -> Callable[[str], pa.Table]:
    """``ask`` with ``sqls`` already on their way, all at once: each is answered
    (or raises) where it is asked, once; any other SQL, or a second time, is
    asked then."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=AT_ONCE, thread_name_prefix="diagnose-ask")
    pending = {q: pool.submit(ask, q) for q in dict.fromkeys(sqls)}
    pool.shutdown(wait=False)

    def answer(sql: str) -> pa.Table:
        future = pending.pop(sql, None)
        return ask(sql) if future is None else future.result()

    return answer


def _with_history(
    table: pa.Table,
    ask: Callable[[str], pa.Table],
    sql: str,
    now_ns: int,
    window_s: float,
    hang_after_s: float,
) -> pa.Table:
    """``table`` again from ``window_s`` before its oldest call still in flight, where
    that call may be a hang (in flight ``hang_after_s``): the calls that came before
    a hang line each rank's sequence numbers up, so it is numbered alike however
    late it is asked (a hang that began just inside the window has next to no
    calls before it there, and a rank with none is left unaligned)."""
    if not table.num_rows:
        return table
    ts, dur = table.column("ts").to_pylist(), table.column("dur_ns").to_pylist()
    oldest = min((t for t, d in zip(ts, dur, strict=True) if d is None), default=now_ns)
    if now_ns - oldest < hang_after_s * 1e9:
        return table
    return ask(sql.format(since_ns=oldest - int(window_s * 1e9)))


def _ranks_of(table: pa.Table) -> set[int]:
    if not table.num_rows or "rank" not in table.column_names:
        return set()
    return {int(r) for r in table.column("rank").unique().to_pylist() if r is not None}


def _counts_differ(states: list[hg.RankState]) -> bool:
    groups: dict[str, set[int]] = {}
    for s in states:
        for g, n in s.counts.items():
            groups.setdefault(g, set()).add(n)
    return any(len(v) > 1 for v in groups.values())


def _stalled_s(table: pa.Table, now_ns: int, trace_starts: Callable[[], list[int]]) -> float:
    """How long no collective has started or ended (a lower bound, from the trace)."""
    last = 0
    if table.num_rows:
        for ts, dur in zip(
            table.column("ts").to_pylist(), table.column("dur_ns").to_pylist(), strict=True
        ):
            last = max(last, ts + (dur or 0))
    if not last:  # nothing traced: since when have the probes traced?
        starts = trace_starts()
        last = max(starts) if starts else now_ns
    return max(0.0, (now_ns - (last or now_ns)) / 1e9)
