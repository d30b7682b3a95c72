"""``probing diagnose``: gather every rank's collectives, stacks and counts,
name the straggler, the slow link or the hang, and render the verdict.

In parts, one owner each: the queries every rank is asked (``queries``);
the analysis, pure (``analyze``: rows in, a ``Diagnosis`` out); the verdict's
text (``probing.analyze.verdict``, put together once in ``whole_verdict``);
the asking and polling (``diagnose``, below "asking the probes"); and the
``analyze.*`` tables (``sql_tables``, ``local_tables``)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from probing.analyze import collectives as coll
from probing.analyze import columns, mesh
from probing.analyze import coverage as cv
from probing.analyze import flight as fl
from probing.analyze import hangs as hg
from probing.analyze import pipeline as pp
from probing.analyze import why as wy
from probing.analyze.gather import missing_ranks
from probing.analyze.verdict import covered_text, hms, verdict
from probing.errors import ProbingError

# what every rank is asked; ``{tags}`` is ", node, rank" in a cluster query,
# where those are the peer's tags and the view's own ``rank`` is ``table_rank``
COLLECTIVES_SQL = (
    "SELECT backend, op, comm, seq, {comm_rank} AS comm_rank, nranks, bytes, ts, dur_ns, "
    "pid, peer, tag, wait_ns{tags} FROM comm.collectives WHERE ts >= {since_ns} OR dur_ns IS NULL"
)  # calls still in flight however long ago they began: a hang older than the window
# each traced Gloo context's torch process group, named the same in every rank
GROUPS_SQL = "SELECT backend, comm, pg, ranks{tags} FROM comm.groups"
# the ranks that died (a killed rank's probe answers with what it left)
DEAD_SQL = "SELECT pid, alive, died_ns{tags} FROM process.info"
STACKS_SQL = "SELECT tid, thread, state, depth, func, file, line{tags} FROM process.stacks"
# torch's own count of collectives issued per process group (no tracing needed)
COUNTS_EXPR = (
    "(lambda d: [{{'group': str(n), 'size': g.size(), "
    "'count': g._get_sequence_number_for_group()}} "
    "for g, n in d.distributed_c10d._world.pg_names.items()] "
    "if d is not None and d.is_initialized() else [])(sys.modules.get('torch.distributed'))"
)
COUNTS_SQL = "SELECT *{tags} FROM python.`" + COUNTS_EXPR + "`"


# where each rank issues its collectives from, when the trace records Python
# stacks (``stack_id`` and ``python.callsites``); absent: no callsites, no error
# stack ids are per process: over a cluster, a stack joins its own rank's calls only
CALLSITES_SQL = (
    "SELECT s.callsite AS callsite, count(*) AS n{tags} FROM comm.collectives c "
    "JOIN python.callsites s ON c.stack_id = s.stack_id{same_rank} WHERE c.ts >= {since_ns} "
    "GROUP BY s.callsite{group}"
)


# where each rank spent its time (python.samples, by the innermost user frame,
# whether it waited for its DataLoader's worker processes, and whether its
# thread issued collectives: the thread that trains, whatever its name) and in
# CUDA calls (by the thread that made them): asked only when there is a straggler to explain
SAMPLES_SQL = (
    "SELECT s.kind AS kind, c.file AS file, c.func AS func, c.line AS line, "
    "c.via_file AS via_file, c.via_func AS via_func, l.stack_id IS NOT NULL AS loader, "
    "s.thread AS thread, s.tid AS tid, t.tid IS NOT NULL AS trains, sum(s.dur_ns) AS dur_ns, "
    "sum(s.count) AS n{tags} FROM python.samples s "
    "LEFT JOIN python.callsites c ON s.stack_id = c.stack_id{same_rank} "
    "LEFT JOIN (SELECT DISTINCT stack_id{ltags} FROM python.stacks "
    "WHERE file LIKE '%torch/utils/data/dataloader.py' AND func LIKE '%._get_data') l "
    "ON s.stack_id = l.stack_id{loader_rank} "
    "LEFT JOIN (SELECT DISTINCT tid{ltags} FROM comm.collectives WHERE ts >= {since_ns}) t "
    "ON s.tid = t.tid{issuer_rank} WHERE s.ts >= {since_ns} "
    "GROUP BY s.kind, c.file, c.func, c.line, c.via_file, c.via_func, l.stack_id IS NOT NULL, "
    "s.thread, s.tid, t.tid IS NOT NULL{group}"
)  # by thread too: the threads without Python (Gloo's, OpenMP's) wait for a CPU as well
CUDA_SQL = (
    "SELECT api, tid, sum(dur_ns) AS dur_ns, count(*) AS n{tags} FROM cuda.calls "
    "WHERE ts >= {since_ns} GROUP BY api, tid{group}"
)


# each rank's GPUs over the window (NVML, when sampled), those it works on
# (``own``): asked only when there is a straggler to explain
NVML_SQL = (
    "SELECT gpu, avg(sm_clock_mhz) AS sm_mhz, bit_or(throttle_reasons) AS reasons, "
    "avg(power_w) AS power_w, max(temp_c) AS temp_c, sum(xid_count) AS xids, max(xid) AS xid, "
    "max(ecc_uncorrected) AS ecc, avg(pcie_tx_kbs + pcie_rx_kbs) AS pcie_kbs, "
    "max(nvlink_tx_kib + nvlink_rx_kib) - min(nvlink_tx_kib + nvlink_rx_kib) AS nvlink_kib, "
    "max(ts) - min(ts) AS span_ns{tags} FROM nvml.gpu WHERE ts >= {since_ns} AND own "
    "GROUP BY gpu{group}"
)


# how long each rank's threads waited for a CPU (``runq``) over the wall time the
# sampler covered (``tick``): asked only when a slow link is to be told from a starved CPU
RUNQ_SQL = (
    "SELECT kind, sum(dur_ns) AS dur_ns{tags} FROM python.samples "
    "WHERE ts >= {since_ns} AND kind IN ('runq', 'tick') GROUP BY kind{group}"
)


# the CPU each rank runs on: its clock, its node's steal (asked with NVML_SQL)
CPU_SQL = "SELECT cpu, mhz, max_mhz, steal_pct, busy_pct{tags} FROM process.cpu"


def queries(remote: bool) -> dict[str, str]:
    """The SQL for local ranks (tagged by ``gather``) or for a cluster query."""
    rank = ", node, rank" if remote else ""
    # every query's tags, its GROUP BY's, and ``{since_ns}`` left for the caller
    tags = {"tags": rank, "group": rank, "since_ns": "{since_ns}"}
    out = {
        name: sql.format(**tags)
        for name, sql in (
            ("stacks", STACKS_SQL), ("groups", GROUPS_SQL), ("dead", DEAD_SQL),
            ("counts", COUNTS_SQL), ("cuda", CUDA_SQL), ("cpu", CPU_SQL),
            ("runq", RUNQ_SQL), ("nvml", NVML_SQL), ("intervals", cv.INTERVALS_SQL),
        )
    }  # fmt: skip
    out["collectives"] = COLLECTIVES_SQL.format(
        comm_rank="table_rank" if remote else "rank", **tags
    )
    out["callsites"] = CALLSITES_SQL.format(
        tags=", c.rank AS rank" if remote else "",
        same_rank=" AND c.node = s.node AND c.rank = s.rank" if remote else "",
        group=", c.rank" if remote else "",
        since_ns="{since_ns}",
    )  # fmt: skip
    out["samples"] = SAMPLES_SQL.format(
        tags=", s.node AS node, s.rank AS rank" if remote else "",
        same_rank=" AND c.node = s.node AND c.rank = s.rank" if remote else "",
        ltags=rank,
        loader_rank=" AND l.node = s.node AND l.rank = s.rank" if remote else "",
        issuer_rank=" AND t.node = s.node AND t.rank = s.rank" if remote else "",
        group=", s.node, s.rank" if remote else "",
        since_ns="{since_ns}",
    )  # fmt: skip
    return out


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
class Death:
    """A rank whose process died while its probe watched (``kill -9``, OOM)."""

    pid: int
    died_ns: int
    where: str  # "in allreduce #41 of gloo/pg0", "after ... (it never entered #41)", ""


def deaths(rows: list[dict[str, Any]], matched: list[coll.Collective]) -> dict[int, Death]:
    """The dead ranks of ``DEAD_SQL``'s rows, and the collective each died in
    (entered, never left) or after (the last it left: it never entered the next)."""
    out = {}
    for row in rows:
        if row.get("alive") is not False:
            continue
        r, died = int(row["rank"]), int(row.get("died_ns") or 0)
        mine = [c for c in matched if r in c.ts]
        where = ""
        inside = [c for c in mine if c.end.get(r) is None]
        if inside:
            c = min(inside, key=lambda c: c.ts[r])
            where = f"in {c.op} #{c.seq} of {c.comm}"
        elif mine:
            c = max(mine, key=lambda c: c.ts[r])
            where = f"after {c.op} #{c.seq} of {c.comm} (it never entered #{c.seq + 1})"
        out[r] = Death(int(row.get("pid") or 0), died, where)
    return out


def death_text(dead: dict[int, Death]) -> str:
    """``rank 3 (pid 1234) died at 14:05:01 UTC in allreduce #41 of gloo/pg0``,
    the first to die first (a killed Gloo rank takes the others with it)."""
    first = sorted(dead.items(), key=lambda rx: (rx[1].died_ns or 0, rx[0]))
    return "; ".join(
        f"rank {r} (pid {x.pid}) died{f' at {hms(x.died_ns)}' if x.died_ns else ''}"
        f"{f' {x.where}' if x.where else ''}"
        for r, x in first
    )


@dataclasses.dataclass
class Diagnosis:
    healthy: bool
    verdict: str
    stragglers: list[coll.Straggler]
    slow_links: list[coll.SlowLink]
    hangs: list[hg.Hang]
    summary: coll.Summary
    ranks: list[dict[str, Any]]  # the evidence table, one row per rank
    stacks: dict[int, list[str]]  # rank -> main thread stack, for the verdict's ranks
    window_s: float
    elapsed_s: float = 0.0
    missing: list[str] = dataclasses.field(default_factory=list)  # ranks that did not answer
    callsites: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> file:line
    why: list[wy.Why] = dataclasses.field(default_factory=list)  # what makes each straggler slow
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
    said = verdict(d.stragglers, d.slow_links, d.hangs, d.summary, d.window_s, d.why, d.pipeline)
    if coverage is not None:
        said = covered_text(said, coverage, bool(d.hangs), d.window_s)
    if d.dead:
        said = f"{death_text(d.dead)}; {said}"
    by_trace = traced and all(h.evidence == "traced" for h in d.hangs)
    if d.flight and not by_trace:
        said = f"{said}; {d.flight}"
    return said


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
) -> Diagnosis:
    """The whole diagnosis from gathered rows (pure: no probe is asked);
    ``samples`` (SAMPLES_SQL rows) and ``cuda`` (CUDA_SQL) say why a straggler is slow;
    ``recorded`` (every rank's Flight Recorder) tells a hang nothing traced;
    ``ranks_of`` (each group's global ranks) names a transfer's peer; ``dead``
    (``DEAD_SQL`` rows) the ranks that died, said first in the verdict; ``runq``
    asks RUNQ_SQL, only where a slow link is suspected: its ranks may be
    waiting for a CPU instead; ``matched``: ``table``'s collectives, when the
    caller matched them already; ``coverage``: the span every rank traced in,
    which ``table`` was cut to (``judge``), said in the verdict."""
    now_ns = now_ns or time.time_ns()
    frames = frames or {}
    matched = coll.match(table) if matched is None else matched
    nodes = _nodes(table, states or [])
    ranks = sorted(set(nodes) | set(frames))
    rows = pp.p2p_rows(_p2p_only(table).to_pylist()) if "peer" in table.column_names else []
    hangs = _hangs(
        matched, rows, ranks, now_ns=now_ns, hang_after_s=hang_after_s, frames=frames,
        ranks_of=ranks_of or {}, recorded=recorded, states=states or [], stalled_s=stalled_s,
    )  # fmt: skip
    strag = [] if hangs else coll.stragglers(matched, nodes)
    for late in strag:  # where it sits, where its groups say (Megatron's, a device mesh's)
        late.place = mesh.place_text(late.rank, ranks_of or {})
    # a straggler slows the collectives too (its share of the reduction runs late)
    slow = [] if hangs or strag else _slow_links(matched, nodes, runq)
    summary = coll.summarize(matched)
    stacks = {r: hg.main_stack(frames[r]) for s in strag for r in [s.rank] if frames.get(r)}
    for h in hangs:
        stacks.update(h.stacks)
    pipe = None if hangs else pp.analyze(rows, nodes, ranks_of)
    why = explain_stragglers(strag, matched, samples, cuda, nvml, cpu)
    why += explain_stage(pipe, samples, strag)
    died = deaths(dead or [], matched)
    found = hangs or strag or slow or (pipe is not None and pipe.slow is not None)
    d = Diagnosis(
        healthy=not (found or died),
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
        dead=died,
        untraced=coverage.untraced if coverage is not None else [],
    )
    d.verdict = whole_verdict(d, coverage, traced=bool(matched) or bool(rows))
    return d


def _nodes(table: pa.Table, states: list[hg.RankState]) -> dict[int, str]:
    """Each rank's node, as its rows are tagged, else as its state says."""
    nodes: dict[int, str] = {}
    if table.num_rows and "node" in table.column_names:
        tags = zip(table.column("node").to_pylist(), table.column("rank").to_pylist(), strict=True)
        nodes = {r: n for n, r in tags}
    for s in states:
        nodes.setdefault(s.rank, s.node)
    return nodes


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
) -> list[hg.Hang]:
    """The hangs, by the best evidence there is: the traced collectives, then
    the traced sends and receives (``rows``: a pipeline's), then torch's Flight
    Recorder (``recorded``), and last each rank's counts and stacks (``states``,
    still for ``stalled_s``)."""
    hangs = hg.traced_hangs(matched, ranks, now_ns, hang_after_s, frames)
    if not hangs:
        hangs = pipeline_hangs(rows, now_ns, hang_after_s, ranks_of, frames)
    if not hangs and recorded is not None:
        hangs = hg.recorded_hangs(recorded, now_ns, hang_after_s, frames)
    if not hangs and states:
        hangs = hg.snapshot_hangs(states, stalled_s, hang_after_s)
    return hangs


def _slow_links(
    matched: list[coll.Collective],
    nodes: dict[int, str],
    runq: Callable[[], pa.Table | None] | None,
) -> list[coll.SlowLink]:
    """The slow links of ``matched``: where one is suspected and ``runq`` asks
    how long each rank waited for a CPU, its ranks may be starved instead (the
    sampler tells them apart)."""
    slow = coll.slow_links(matched, nodes)
    if slow and runq is not None:
        slow = coll.slow_links(matched, nodes, runq_rates(runq()))
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
) -> list[hg.Hang]:
    """A pipeline's hang: stages blocked receiving, followed upstream to the
    stage that never sent (``pipeline.culprit``)."""
    waits = pp.blocked(rows, now_ns, after_s, ranks_of)
    found = pp.culprit(waits)
    if found is None:
        return []
    root, waiting = found
    first = max((b for b in waits if b.rank in waiting), key=lambda b: b.age_s)
    stacks = {r: hg.main_stack(frames[r]) for r in (root, *waiting) if frames.get(r)}
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


def explain_stage(
    pipe: pp.Pipeline | None,
    samples: pa.Table | None,
    stragglers: Sequence[coll.Straggler] = (),
) -> list[wy.Why]:
    """What keeps a pipeline's slow stage busy: its functions against the
    other stages', per second of the window (a pipeline has no step the
    collectives would give); nothing where the stage is a straggler of
    ``stragglers``, explained per step already (a function is said once)."""
    if pipe is None or pipe.slow is None or samples is None:
        return []
    if pipe.slow in {s.rank for s in stragglers}:
        return []
    st = pipe.stage(pipe.slow)
    extra = (st.busy_share - pp.others_busy(pipe.stages, st.rank)) * 1000.0  # ms/s of work
    stage = coll.Straggler(
        rank=st.rank, node=st.node, lag_ms_mean=0.0, lag_ms_p99=0.0, excess_ms_median=extra,
        last_share=0.0, share_of_step=0.0, since="", since_ns=0, since_start=True,
        comm="", op="send/recv", collectives=0, p_value=0.0,
    )  # fmt: skip
    return wy.explain(stage, samples.to_pylist(), [], step=1000.0, unit="s")


def explain_stragglers(
    stragglers: list[coll.Straggler],
    matched: list[coll.Collective],
    samples: pa.Table | None,
    cuda: pa.Table | None,
    nvml: pa.Table | None = None,
    cpu: pa.Table | None = None,
) -> list[wy.Why]:
    """What makes each straggler slow (``why.explain``), from SAMPLES_SQL,
    CUDA_SQL, NVML_SQL and CPU_SQL rows (None: that part is left out)."""
    rows = samples.to_pylist() if samples is not None else []
    calls = cuda.to_pylist() if cuda is not None else []
    gpus = nvml.to_pylist() if nvml is not None else []
    cpus = cpu.to_pylist() if cpu is not None else []
    return [
        w for s in stragglers for w in wy.explain(s, rows, matched, calls, gpus=gpus, cpus=cpus)
    ]


def _rank_rows(
    matched: list[coll.Collective],
    ranks: list[int],
    nodes: dict[int, str],
    frames: dict[int, list[dict[str, Any]]],
    states: list[hg.RankState],
) -> list[dict[str, Any]]:
    done = coll.complete(matched)
    counts = {s.rank: sum(s.counts.values()) if s.counts else None for s in states}
    # after the others' median arrival: a straggler's lateness, whoever else is late
    matrix = coll.excess_matrix(done, ranks)
    rows = []
    for j, r in enumerate(ranks):
        mine = [c for c in done if r in c.ts]
        lags = np.array([c.lags_ns()[r] / 1e6 for c in mine])
        last = sum(1 for c in mine if max(c.ts, key=c.ts.__getitem__) == r)
        excess = matrix[:, j][~np.isnan(matrix[:, j])] if len(done) else []
        rows.append(
            {
                "rank": r,
                "node": nodes.get(r, ""),
                "collectives": len(mine),
                "last_pct": round(100 * last / len(mine), 1) if mine else None,
                "lag_ms_mean": round(float(lags.mean()), 2) if len(lags) else None,
                "lag_ms_p99": round(float(np.percentile(lags, 99)), 2) if len(lags) else None,
                "excess_ms_median": round(float(np.median(excess)), 2) if len(excess) else None,
                "count": counts.get(r),
                "in_collective": hg.in_collective(frames[r]) if r in frames else None,
            }
        )
    return rows


# -- asking the probes, and watching a stall ------------------------------------------


class Job(Protocol):
    """The ranks a diagnosis asks (``probing.cli.client.Job``: local pids over
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
    job: Job,
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

    When the counts say some ranks are ahead but nothing has been traced to
    date the stall, the counts are watched until they have stood still for
    ``hang_after_s`` (``on_wait`` is told how long that will take) or move.
    """
    t0 = time.perf_counter()
    now = now_ns or time.time_ns()  # (given: a test's clock)
    sql = queries(remote=job.remote)
    since = now - int(window_s * 1e9)
    # what every diagnosis asks, asked at once (each waits on the probes, not the CPU)
    ask = asked_at_once(job.ask, _first_questions(sql, since, job.remote, eager))
    got = _gather(ask, sql, job.remote, since, now, window_s, hang_after_s)
    # the trace tells how long nothing moved only while every rank traces; else
    # the counts are watched (below)
    traced_now = got.coverage is None or got.coverage.now
    stalled = round(_stalled_s(got.table, now, job.trace_starts_ns), 1) if traced_now else 0.0
    runq = functools.partial(optional, ask, sql["runq"].format(since_ns=since))
    matched = coll.match(got.table)  # once: each analyze below, and why a straggler is slow

    def analyzed(stalled_s: float, at_ns: int) -> Diagnosis:
        return analyze(
            got.table, frames=got.frames, states=got.states, stalled_s=stalled_s, now_ns=at_ns,
            window_s=window_s, hang_after_s=hang_after_s, recorded=got.recorded,
            ranks_of=got.ranks_of, dead=got.dead, runq=runq, matched=matched,
            coverage=got.coverage,
        )  # fmt: skip

    d = analyzed(stalled, now)
    progressing = (
        traced_now and got.table.num_rows > 0 and stalled < 1.0
    )  # traced in the last second
    if not d.hangs and not progressing and _counts_differ(got.states) and stalled < hang_after_s:
        watched = _stood_still(ask, sql, got, stalled, hang_after_s, on_wait)
        if watched is not None:  # still all along: where each rank waits now
            got.frames = _frames_by_rank(ask(sql["stacks"]))
            got.states = [
                dataclasses.replace(s, frames=got.frames.get(s.rank, [])) for s in got.states
            ]
            d = analyzed(round(stalled + time.monotonic() - watched, 1), time.time_ns())
    d.missing = missing_ranks(got.table)
    if d.stragglers or (d.pipeline is not None and d.pipeline.slow is not None):
        ask = _explain(d, ask, sql, since, matched, got.coverage)
    if d.stragglers or d.hangs:
        d.callsites = _callsites(ask, sql["callsites"].format(since_ns=since))
    d.elapsed_s = round(time.perf_counter() - t0, 3)
    return d, got.table


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


def _stood_still(
    ask: Callable[[str], pa.Table],
    sql: dict[str, str],
    got: _Asked,
    stalled_s: float,
    hang_after_s: float,
    on_wait: Callable[[float], None] | None,
) -> float | None:
    """Every rank's counts asked every ``POLL_S`` until they have stood still
    ``hang_after_s`` in all (``stalled_s`` of it gone already): when the watch
    began (``time.monotonic()``), or None where they moved. ``on_wait`` is
    told how long that will take."""
    watched = time.monotonic()
    if on_wait is not None:
        on_wait(hang_after_s - stalled_s)
    while stalled_s + time.monotonic() - watched < hang_after_s:
        time.sleep(POLL_S)
        again = _states(ask, got.frames, sql)
        if [s.counts for s in again] != [s.counts for s in got.states]:
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
    d.why += explain_stage(d.pipeline, extra["samples"], d.stragglers)
    # found in the trace, with no hang: nothing the Flight Recorder would add
    d.verdict = whole_verdict(d, coverage, traced=True)
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


def optional(ask: Callable[[str], pa.Table], sql: str) -> pa.Table | None:
    """``ask(sql)``, or None from a probe without the table (that part is left out)."""
    try:
        return ask(sql)
    except ProbingError:
        return None


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


def with_groups(table: pa.Table, groups: pa.Table) -> pa.Table:
    """``table`` plus ``pg``: each row's torch process group, where its rank's
    ``comm.groups`` names one (the cross-rank name of a Gloo context)."""
    if not table.num_rows or not groups.num_rows or "pg" in table.column_names:
        return table
    key_cols = [c for c in ("node", "rank") if c in groups.column_names]
    names = {
        (*(g[c] for c in key_cols), g["backend"], g["comm"]): g["pg"] for g in groups.to_pylist()
    }
    code, firsts = columns.distinct(table, [*key_cols, "backend", "comm"])
    cols = [
        table.column(c).take(pa.array(firsts)).to_pylist() for c in (*key_cols, "backend", "comm")
    ]
    pg = pa.array([names.get(k) for k in zip(*cols, strict=True)], pa.string())
    return table.append_column("pg", pg.take(pa.array(code)))


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


# -- SQL: analyze.* -----------------------------------------------------------------------


def sql_tables(d: Diagnosis, table: pa.Table) -> dict[str, pa.Table]:
    """``analyze.stragglers``, ``analyze.slow_links``, ``analyze.hangs``,
    ``analyze.ranks``, ``analyze.collectives`` (the gathered rows),
    ``analyze.why``, ``analyze.stages`` and ``analyze.transfers`` (pipelines):
    the findings' dataclasses as tables (``probing.schema``)."""
    from probing.schema import table_of

    return {
        "stragglers": table_of(coll.Straggler, d.stragglers),
        "slow_links": table_of(coll.SlowLink, d.slow_links),
        "hangs": table_of(hg.Hang, d.hangs),
        "ranks": pa.Table.from_pylist(d.ranks, schema=RANKS_SCHEMA),
        "collectives": table,
        "why": table_of(wy.Why, d.why),
        "stages": table_of(pp.Stage, d.pipeline.stages if d.pipeline else []),
        "transfers": table_of(pp.Transfer, d.transfers),
    }


RANKS_SCHEMA = pa.schema(
    [
        ("rank", pa.int64()), ("node", pa.string()), ("collectives", pa.int64()),
        ("last_pct", pa.float64()), ("lag_ms_mean", pa.float64()), ("lag_ms_p99", pa.float64()),
        ("excess_ms_median", pa.float64()), ("count", pa.int64()), ("in_collective", pa.bool_()),
    ]
)  # fmt: skip


def local_tables(engine: Any, window_s: float = 60.0) -> dict[str, pa.Table]:
    """The analyze.* tables over the data this one probe holds (its own rank)."""
    import os
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from probing.analyze.gather import RANK_EXPR, tag

    now = time.time_ns()
    sql = queries(remote=False)["collectives"].format(since_ns=now - int(window_s * 1e9))
    # a table is produced inside the engine's own query: the query it needs runs
    # on a thread of its own (DataFusion cannot block inside its runtime)
    with ThreadPoolExecutor(max_workers=1) as pool:
        rows = pool.submit(engine.sql, sql).result()
        try:  # the process's rank, as the process itself tells it
            asked = pool.submit(engine.sql, f"SELECT value FROM python.`{RANK_EXPR}`").result()
            rank = int(asked.column("value")[0].as_py())
        except (ProbingError, ValueError, TypeError, IndexError):  # no number; torch's refusal
            rank = -1
    rows = tag(rows, socket.gethostname(), rank if rank >= 0 else os.getpid())
    d = analyze(rows, now_ns=now, window_s=window_s)
    return sql_tables(d, rows)
