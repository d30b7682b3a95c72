"""The diagnosis, pure: every rank's gathered collectives, stacks and counts
in, the straggler, slow link or hang named and the verdict said out
(``analyze``: rows in, a ``Diagnosis`` out).

The other parts, one owner each: the SQL every rank is asked
(``probing.analyze.queries``); the rows named by torch's groups
(``probing.analyze.gather.with_groups``); the ranks that died
(``probing.analyze.deaths``); what makes a straggler slow, and the small ones
told from noise (``probing.analyze.explain``); the verdict's text
(``probing.analyze.verdict``, put together once in ``whole_verdict``); the
``analyze.*`` tables of a diagnosis (``probing.analyze.tables``); the asking
and polling (``probing.cli.asking``); an engine's own ``analyze.*`` tables
(``probing.node.tables.analysis``)."""

from __future__ import annotations

import dataclasses
import re
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from probing.analyze import cause as ca
from probing.analyze import collectives as coll
from probing.analyze import columns, mesh
from probing.analyze import coverage as cv
from probing.analyze import evidence as ev
from probing.analyze import flight as fl
from probing.analyze import hangs as hg
from probing.analyze import links as ln
from probing.analyze import pipeline as pp
from probing.analyze import steps as st
from probing.analyze import stragglers as sg
from probing.analyze.deaths import Death, death_text, deaths
from probing.analyze.explain import explain_stage, explain_stragglers, explained
from probing.analyze.gather import missing_ranks, unheard_ranks
from probing.analyze.verdict import covered_text, ranks_text, verdict, who_wait


def runq_rates(table: pa.Table | None) -> dict[int, float] | None:
    """Each rank's ms waited for a CPU per s of sampled wall time (RUNQ_SQL rows);
    None where nothing was sampled."""
    if table is None or not table.num_rows:
        return None
    wait: dict[int, float] = defaultdict(float)
    wall: dict[int, float] = defaultdict(float)
    for row in table.to_pylist():
        r = int(row.get("rank") or 0)
        (wall if row["kind"] == "tick" else wait)[r] += float(row["dur_ns"] or 0)
    return {r: 1e3 * wait[r] / w for r, w in wall.items() if w > 0} or None


def callsites(table: pa.Table) -> dict[int, str]:
    """Each rank's most frequent collective callsite (``callsite, n, rank`` rows)."""
    best: dict[int, tuple[int, str]] = {}
    for row in table.to_pylist():
        r, n = row["rank"], row["n"] or 0
        if row["callsite"] and (r not in best or n > best[r][0]):
            best[r] = (n, row["callsite"])
    return {r: site for r, (_, site) in sorted(best.items())}


@dataclasses.dataclass
class Diagnosis:
    healthy: bool  # nothing found, and a verdict given ("no verdict" is not healthy)
    verdict: str
    stragglers: list[sg.Straggler]
    slow_links: list[ln.SlowLink]
    hangs: list[hg.Hang]
    summary: coll.Summary
    ranks: list[dict[str, Any]]  # the evidence table, one row per rank
    stacks: dict[int, list[str]]  # rank -> main thread stack, for the verdict's ranks
    window_s: float
    elapsed_s: float = 0.0
    missing: list[str] = dataclasses.field(default_factory=list)  # ranks that did not answer
    callsites: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> file:line
    why: list[ca.Why] = dataclasses.field(default_factory=list)  # what makes each straggler slow
    flight: str = ""  # the ranks whose Flight Recorder is off, and why ("" where all have one)
    pipeline: pp.Pipeline | None = None  # the stages, where the ranks send and receive
    transfers: list[pp.Transfer] = dataclasses.field(default_factory=list)  # sends met
    dead: dict[int, Death] = dataclasses.field(default_factory=dict)  # the ranks that died
    # the ranks not tracing at the end of the window (trace.intervals): the
    # verdict is judged only over the span in which every rank traced
    untraced: list[cv.Untraced] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The documented JSON object (plus ``summary`` and ``ranks``)."""
        return {
            "healthy": self.healthy,
            "verdict": self.verdict,
            "stragglers": [dataclasses.asdict(s) for s in self.stragglers],
            "slow_links": [dataclasses.asdict(s) for s in self.slow_links],
            "hangs": [
                {**dataclasses.asdict(h), "stacks": {str(r): v for r, v in h.stacks.items()}}
                for h in self.hangs
            ],
            "summary": dataclasses.asdict(self.summary),
            "ranks": self.ranks,
            "missing": self.missing,
            "stacks": {str(r): v for r, v in self.stacks.items()},
            "callsites": {str(r): c for r, c in self.callsites.items()},
            "why": [dataclasses.asdict(w) for w in self.why],
            "flight": self.flight,
            "pipeline": dataclasses.asdict(self.pipeline) if self.pipeline else None,
            "dead": {str(r): dataclasses.asdict(x) for r, x in self.dead.items()},
            "untraced": [dataclasses.asdict(u) for u in self.untraced],
        }


def whole_verdict(d: Diagnosis, coverage: cv.Coverage | None, traced: bool) -> str:
    """``d``'s verdict, put together here only: its worst finding
    (``verdict.verdict``), judged over the span every rank traced in
    (``coverage``, where the probes tell it), the ranks that died said first,
    and the ranks whose Flight Recorder is off (``d.flight``) said last where
    the recorder would have told what nothing ``traced`` did."""
    answered = sorted({r["rank"] for r in d.ranks})
    said = verdict(
        d.stragglers, d.slow_links, d.hangs, d.summary, d.window_s, d.why, d.pipeline,
        d.missing, answered,
    )  # fmt: skip
    untraced = (
        coverage is not None
        and len(coverage.untraced) >= len(answered) > 0
        and all(u.state == "never" for u in coverage.untraced)
    )  # nothing traced at all: not a gap in a trace
    if coverage is not None and not (untraced and d.hangs):  # a hang by stacks needs no trace
        said = covered_text(said, coverage, bool(d.hangs), d.window_s)
    if untraced and not d.hangs:
        said += stacks_text(d.ranks)
    if d.dead:
        said = f"{death_text(d.dead)}; {said}"
    by_trace = traced and all(h.evidence == "traced" for h in d.hangs)
    if d.flight and not by_trace:
        said = f"{said}; {d.flight}"
    return said


def stacks_text(ranks: list[dict[str, Any]]) -> str:
    """What the ranks' stacks say where nothing was traced: some wait in a
    collective and others do not (a hang younger than ``--hang-after``, or a
    step caught mid-way: asked again, it tells)."""
    inside = [r["rank"] for r in ranks if r.get("in_collective")]
    outside = [r["rank"] for r in ranks if r.get("in_collective") is False]
    if not inside or not outside:
        return ""
    return (
        f"; by their stacks {who_wait(inside)} in a collective and "
        f"{ranks_text(outside)} not: a hang once that lasts --hang-after (diagnose again then)"
    )


def analyze(
    table: pa.Table,
    *,
    frames: dict[int, list[dict[str, Any]]] | None = None,
    states: list[hg.RankState] | None = None,
    stalled_s: float = 0.0,
    now_ns: int | None = None,
    window_s: float = 60.0,
    hang_after_s: float = hg.HANG_AFTER_S,
    samples: pa.Table | None = None,
    cuda: pa.Table | None = None,
    nvml: pa.Table | None = None,
    cpu: pa.Table | None = None,
    recorded: fl.Gathered | None = None,
    ranks_of: dict[str, list[int]] | None = None,
    dead: list[dict[str, Any]] | None = None,
    runq: Callable[[], pa.Table | None] | None = None,
    matched: list[coll.Collective] | None = None,
    coverage: cv.Coverage | None = None,
    missing: list[str] | None = None,
) -> Diagnosis:
    """The whole diagnosis from gathered rows (pure: no probe is asked);
    ``samples`` (SAMPLES_SQL rows) and ``cuda`` (CUDA_SQL) say why a straggler is slow;
    ``recorded`` (every rank's Flight Recorder) tells a hang nothing traced;
    ``ranks_of`` (each group's global ranks) names a transfer's peer; ``dead``
    (``DEAD_SQL`` rows) the ranks that died, said first in the verdict; ``runq``
    asks RUNQ_SQL, only where a slow link is suspected: its ranks may be
    waiting for a CPU instead; ``matched``: ``table``'s collectives, when the
    caller matched them already; ``coverage``: the span every rank traced in,
    which ``table`` was cut to (``judge``), said in the verdict; ``missing``:
    the ranks not heard from (any question's; else those ``table`` lacked);
    a rank ``table``'s answer lacked is never one that never entered a hang (``_heard``)."""
    now_ns, frames = now_ns or time.time_ns(), frames or {}
    missing, dead, gone = _exited(missing_ranks(table) if missing is None else missing, dead or [])
    matched = coll.match(table) if matched is None else matched
    nodes = _nodes(table, states or [])
    ranks = sorted(set(nodes) | set(frames))
    rows = pp.p2p_rows(_p2p_only(table).to_pylist()) if "peer" in table.column_names else []
    trainers = issuers(table)
    hangs = _never_entered(gone, ranks_of or {}, *_hangs(
        matched, rows, sorted({*_heard(ranks, table), *gone}), now_ns=now_ns,
        hang_after_s=hang_after_s, frames=frames,
        ranks_of=ranks_of or {}, recorded=recorded, states=states or [], stalled_s=stalled_s,
        trainers=trainers,
    ))  # fmt: skip
    steps = job_steps(matched, rows)  # the job's step: every figure per step is of it
    strag = [] if hangs else sg.stragglers(matched, nodes, steps)
    for late in strag:  # where it sits, where its groups say (Megatron's, a device mesh's)
        late.place = mesh.place_text(late.rank, ranks_of or {})
    # a straggler slows the collectives too (its share of the reduction runs late)
    slow = [] if hangs or strag else _slow_links(matched, nodes, runq)
    summary = coll.summarize(matched, steps)
    stacks = {s.rank: hg.main_stack(frames[s.rank], trainers.get(s.rank, ()))
              for s in strag if frames.get(s.rank)}  # fmt: skip
    stacks.update({r: v for h in hangs for r, v in h.stacks.items()})
    pipe = None if hangs else pp.analyze(rows, nodes, ranks_of)
    why = explain_stragglers(strag, matched, samples, cuda, nvml, cpu)
    strag, why = explained(strag, why)
    why += explain_stage(pipe, samples, strag)
    d = Diagnosis(
        healthy=False,  # below, once the verdict is said
        verdict="",  # below, once the rest is known
        stragglers=strag,
        slow_links=slow,
        hangs=hangs,
        summary=summary,
        ranks=_rank_rows(matched, ranks, nodes, frames, states or []),
        stacks=stacks,
        window_s=window_s,
        why=why,
        flight=fl.off_note(recorded.status) if recorded is not None else "",
        pipeline=pipe,
        transfers=pp.match_transfers(rows, ranks_of),
        dead=deaths(dead, matched),
        untraced=coverage.untraced if coverage is not None else [],
        missing=missing,
    )
    d.verdict = whole_verdict(d, coverage, traced=bool(matched) or bool(rows))
    d.healthy = healthy(d)
    return d


SAID_RANK = re.compile(r"rank (\d+) \([^)]*\): (.*)")


def _exited(
    missing: list[str], dead: list[dict[str, Any]]
) -> tuple[list[str], list[dict[str, Any]], list[int]]:
    """The ranks not heard from because no process of theirs is left on their
    node (``procs.NO_PROCESS``: exited or killed, before any probe saw them
    die) said as deaths: ``missing`` less them, ``dead`` with them, and them."""
    from probing.procs import NO_PROCESS

    gone = []
    for said in missing:
        m = SAID_RANK.match(said)
        if m is not None and m.group(2) == NO_PROCESS:
            gone.append(int(m.group(1)))
    if not gone:
        return missing, dead, []
    known = {int(r["rank"]) for r in dead if r.get("rank") is not None and r.get("alive") is False}
    rows = [{"rank": r, "alive": False, "pid": 0, "died_ns": None} for r in gone if r not in known]
    left = [s for s in missing if not ((m := SAID_RANK.match(s)) and int(m.group(1)) in gone)]
    return left, [*dead, *rows], sorted(gone)


def _never_entered(
    gone: list[int], ranks_of: dict[str, list[int]], *hangs: hg.Hang
) -> list[hg.Hang]:
    """``hangs``, where the ranks of ``gone`` (no process left) never entered
    one of their group that names no one (one known by stacks or the Flight
    Recorder)."""
    for h in hangs:
        members = ranks_of.get(h.comm)
        lost = [r for r in gone if members is None or r in members]
        if lost and not h.missing_ranks:
            h.missing_ranks = lost
    return list(hangs)


def healthy(d: Diagnosis) -> bool:
    """Nothing found (no hang, straggler, slow link, slow pipeline stage or
    death) and a verdict said: "no verdict" is unknown, not healthy."""
    slow_stage = d.pipeline is not None and d.pipeline.slow is not None
    found = d.hangs or d.stragglers or d.slow_links or slow_stage or d.dead
    return not found and not d.verdict.startswith("no verdict")


def job_steps(matched: list[coll.Collective], rows: list[dict[str, Any]]) -> st.Steps:
    """The job's step (``steps.find``) of its collectives, else of its
    point-to-point transfers ``rows`` (a pipeline's stages' repeat too)."""
    steps = st.find(matched)
    if steps.job is None and rows:
        steps = st.Steps(st.find(st.of_transfers(rows)).job, steps.comms)
    return steps


def issuers(table: pa.Table) -> dict[int, set[int]]:
    """rank -> the threads (tids) that issued its collectives: the threads that
    train, whatever they are called (a launcher's loop in a ``threading.Thread``)."""
    if not table.num_rows or "tid" not in table.column_names or "rank" not in table.column_names:
        return {}
    rank, has_rank = columns.ints(columns.column(table, "rank"))
    tid, has_tid = columns.ints(columns.column(table, "tid"))
    there = has_rank & has_tid
    out: dict[int, set[int]] = defaultdict(set)
    for pair in np.unique((rank[there] << 32) | (tid[there] & 0xFFFFFFFF)).tolist():
        out[pair >> 32].add(pair & 0xFFFFFFFF)
    return dict(out)


def _nodes(table: pa.Table, states: list[hg.RankState]) -> dict[int, str]:
    """Each rank's node, as its rows are tagged, else as its state says."""
    nodes: dict[int, str] = {}
    if table.num_rows and "node" in table.column_names:
        tags = zip(table.column("node").to_pylist(), table.column("rank").to_pylist(), strict=True)
        nodes = {r: n for n, r in tags}
    for s in states:
        nodes.setdefault(s.rank, s.node)
    return nodes


def _heard(ranks: list[int], table: pa.Table) -> list[int]:
    """``ranks`` less those whose collectives went unheard (``table``'s note of
    them, kept through every cut): what they did is unknown, so a hang never
    says they never entered its collective."""
    unknown = unheard_ranks(table)
    return [r for r in ranks if r not in unknown]


def _hangs(
    matched: list[coll.Collective],
    rows: list[dict[str, Any]],
    ranks: list[int],
    *,
    now_ns: int,
    hang_after_s: float,
    frames: dict[int, list[dict[str, Any]]],
    ranks_of: dict[str, list[int]],
    recorded: fl.Gathered | None,
    states: list[hg.RankState],
    stalled_s: float,
    trainers: dict[int, set[int]],
) -> list[hg.Hang]:
    """The hangs, by the best evidence there is: the traced collectives, then
    the traced sends and receives (``rows``: a pipeline's), then torch's Flight
    Recorder (``recorded``), and last each rank's counts and stacks (``states``,
    still for ``stalled_s``); each rank's stack is its thread that trains
    (``trainers``)."""
    hangs = hg.traced_hangs(matched, ranks, now_ns, hang_after_s, frames, trainers)
    if not hangs:
        hangs = pipeline_hangs(rows, now_ns, hang_after_s, ranks_of, frames, trainers)
    if not hangs and recorded is not None:
        hangs = hg.recorded_hangs(recorded, now_ns, hang_after_s, frames, trainers)
    if not hangs and states:
        hangs = hg.snapshot_hangs(states, stalled_s, hang_after_s, trainers)
    return hangs


def _slow_links(
    matched: list[coll.Collective],
    nodes: dict[int, str],
    runq: Callable[[], pa.Table | None] | None,
) -> list[ln.SlowLink]:
    """The slow links of ``matched``: where one is suspected and ``runq`` asks
    how long each rank waited for a CPU, its ranks may be starved instead (the
    sampler tells them apart)."""
    slow = ln.slow_links(matched, nodes)
    if slow and runq is not None:
        slow = ln.slow_links(matched, nodes, runq_rates(runq()))
    return slow


def judge(
    table: pa.Table,
    intervals: pa.Table | None,
    ranks: Sequence[int],
    dead: Sequence[dict[str, Any]],
    since_ns: int,
    now_ns: int,
) -> tuple[pa.Table, cv.Coverage | None]:
    """``table`` cut to the span in which every live rank of ``ranks`` traced
    (``intervals``: ``trace.intervals`` rows tagged ``rank``), and that span;
    ``table`` as it is where the probes have no ``trace.intervals``. A rank
    that died is said as a death, not compared."""
    if intervals is None:
        return table, None
    died = {int(r["rank"]) for r in dead if r.get("died_ns") and r.get("rank") is not None}
    rows = [r for r in intervals.to_pylist() if int(r["rank"]) not in died]
    cov = cv.coverage(rows, [r for r in ranks if r not in died], since_ns, now_ns)
    return cv.judged(table, cov), cov


def _p2p_only(table: pa.Table) -> pa.Table:
    """The send/recv rows, filtered in Arrow: the collectives (most rows) are
    not turned into Python objects a second time (``coll.match`` does)."""
    import pyarrow.compute as pc

    return table.filter(pc.is_in(table.column("op"), pa.array(coll.P2P_OPS)))


def pipeline_hangs(
    rows: list[dict[str, Any]],
    now_ns: int,
    after_s: float,
    ranks_of: dict[str, list[int]],
    frames: dict[int, list[dict[str, Any]]],
    trainers: dict[int, set[int]] | None = None,
) -> list[hg.Hang]:
    """A pipeline's hang: stages blocked receiving, followed upstream to the
    stage that never sent (``pipeline.culprit``)."""
    waits = pp.blocked(rows, now_ns, after_s, ranks_of)
    found = pp.culprit(waits)
    if found is None:
        return []
    root, waiting = found
    first = max((b for b in waits if b.rank in waiting), key=lambda b: b.age_s)
    trainers = trainers or {}
    stacks = {
        r: hg.main_stack(frames[r], trainers.get(r, ())) for r in (root, *waiting) if frames.get(r)
    }
    chain = ", ".join(
        f"rank {b.rank} {'from' if b.op == 'recv' else 'to'} rank {b.peer}"
        for b in waits
        if b.rank in waiting
    )
    return [
        hg.Hang(
            comm=first.pg, seq=-1 if first.seq is None else int(first.seq), op="recv",
            missing_ranks=[root], waiting_ranks=waiting, age_s=first.age_s,
            evidence="traced", stacks=stacks, detail=f"point-to-point: {chain}",
        )
    ]  # fmt: skip


def _rank_rows(
    matched: list[coll.Collective],
    ranks: list[int],
    nodes: dict[int, str],
    frames: dict[int, list[dict[str, Any]]],
    states: list[hg.RankState],
) -> list[dict[str, Any]]:
    done = coll.complete(matched)
    counts = {s.rank: sum(s.counts.values()) if s.counts else None for s in states}
    arrive = ev.arrivals(done, ranks)
    # after the others' median arrival: a straggler's lateness, whoever else is late
    matrix = ev.excess_of(arrive)
    lag = arrive - np.nanmin(arrive, axis=1, initial=np.inf)[:, None] if len(done) else arrive
    last_rank = np.array([c.last_rank for c in done], dtype=np.int64)
    rows = []
    for j, r in enumerate(ranks):
        there = ~np.isnan(arrive[:, j])
        n_mine = int(there.sum())
        lags = lag[there, j] / 1e6
        last = int((last_rank[there] == r).sum())
        excess = matrix[:, j][~np.isnan(matrix[:, j])] if len(done) else []
        rows.append(
            {
                "rank": r,
                "node": nodes.get(r, ""),
                "collectives": n_mine,
                "last_pct": round(100 * last / n_mine, 1) if n_mine else None,
                "lag_ms_mean": round(float(lags.mean()), 2) if len(lags) else None,
                "lag_ms_p99": round(float(np.percentile(lags, 99)), 2) if len(lags) else None,
                "excess_ms_median": round(float(np.median(excess)), 2) if len(excess) else None,
                "count": counts.get(r),
                "in_collective": hg.in_collective(frames[r]) if r in frames else None,
            }
        )
    return rows
