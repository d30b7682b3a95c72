"""What each tool of ``probing mcp`` does: plain functions over the CLI's own
pieces (``probing.procs``, ``probing.cli.client``, ``probing.analyze``,
``probing.cli.export``), each returning its answer as data (a pydantic
model: the tool's output schema) and a short text for the model.

They block (the server runs each on a worker thread) and raise
``ProbingError`` with what to do next; the server turns that into the
tool's error.
"""

from __future__ import annotations

import json
import math
import numbers
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from probing.cli.client import JobClient, ProbeClient
from probing.cli.mcp import reference
from probing.errors import ProbingError

MAX_RECORD_S = 300.0  # a recording longer than this outlasts the agent's wait for the call
HEALTH_TIMEOUT_S = 1.0  # a probe that takes longer to say who it is is listed without it


def note(msg: str) -> None:
    """A line for whoever runs the server: on stderr (stdout is the protocol's)."""
    print(f"probing mcp: {msg}", file=sys.stderr, flush=True)


def jsonable(v: Any) -> Any:
    """``v`` as JSON has it: NaN as null, bytes as hex, anything else as text."""
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, numbers.Integral):  # numpy's too
        return int(v)
    if isinstance(v, numbers.Real):
        f = float(v)
        return None if math.isnan(f) or math.isinf(f) else f
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, list | tuple):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    return str(v)


# -- rows, capped ---------------------------------------------------------------------


class Rows(BaseModel):
    """A query's rows, at most ``max_rows`` and ``max_bytes`` of JSON of them."""

    columns: list[str]
    rows: list[dict[str, Any]]
    total_rows: int = Field(description="rows the query answered")
    returned_rows: int = Field(description="rows given here (the first ones)")
    truncated: bool = Field(description="true when rows were cut (see truncated_by)")
    truncated_by: Literal["max_rows", "max_bytes"] | None = None
    missing: list[str] = Field(default_factory=list, description="ranks that did not answer")


def capped(columns: list[str], rows: list[list[Any]], max_rows: int, max_bytes: int) -> Rows:
    """``rows`` as objects, the first ``max_rows`` of them that fit in ``max_bytes``."""
    kept: list[dict[str, Any]] = []
    size = 2
    cut: Literal["max_rows", "max_bytes"] | None = None
    for i, row in enumerate(rows):
        if i >= max_rows:
            cut = "max_rows"
            break
        obj = {c: jsonable(v) for c, v in zip(columns, row, strict=False)}
        size += len(json.dumps(obj, default=str)) + 1
        if size > max_bytes:
            cut = "max_bytes"
            break
        kept.append(obj)
    return Rows(
        columns=columns,
        rows=kept,
        total_rows=len(rows),
        returned_rows=len(kept),
        truncated=cut is not None,
        truncated_by=cut,
    )


def rows_text(answer: Rows, what: str = "row") -> str:
    """The rows as an aligned table, said first how many and whether cut."""
    from probing.cli.render import format_rows

    n = answer.total_rows
    head = f"{n} {what}{'s' if n != 1 else ''}"
    if answer.truncated:
        limit = "max_rows" if answer.truncated_by == "max_rows" else "max_bytes"
        head += (
            f"; only the first {answer.returned_rows} are given (cut by {limit}): narrow the "
            f"query (WHERE, LIMIT, fewer columns, an aggregate) or raise {limit}"
        )
    if answer.missing:
        head += "\nnot heard from: " + "; ".join(answer.missing)
    if not answer.columns:
        return head
    table = [[r.get(c) for c in answer.columns] for r in answer.rows]
    return f"{head}\n{format_rows(answer.columns, table, width=160)}"


def arrow_rows(table: Any) -> tuple[list[str], list[list[Any]]]:
    """(column names, rows) of a ``pyarrow.Table``."""
    cols = [table.column(i).to_pylist() for i in range(table.num_columns)]
    return list(table.column_names), [list(r) for r in zip(*cols, strict=True)]


# -- the job a pid belongs to ---------------------------------------------------------


def client(pid: int) -> ProbeClient:
    """The client of ``pid``'s probe, or an error saying how to start one."""
    return ProbeClient.for_pid(pid)


def in_cluster(pid: int) -> bool:
    """Whether ``pid``'s probe has joined its job's cluster (it knows its rank)."""
    cl = client(pid).health().get("cluster")
    return isinstance(cl, dict) and isinstance(cl.get("rank"), int) and cl["rank"] >= 0


def job_scope(pid: int) -> tuple[Literal["cluster", "local"], list[int]]:
    """How the job of ``pid`` is asked: through its probe's peers (``cluster``:
    every rank, every node), else its ranks on this machine that carry a probe
    (``local``: ``probing.procs.job_pids``)."""
    from probing import paths
    from probing.procs import job_pids

    if in_cluster(pid):
        return "cluster", [pid]

    def probed(p: int) -> bool:
        try:
            return paths.find_socket(p) is not None
        except paths.UnsafePath:  # someone else's socket: not asked
            return False

    return "local", [p for p in job_pids(pid) if p == pid or probed(p)]


def job_of(pid: int, timeout: float) -> tuple[JobClient, Literal["cluster", "local"], list[int]]:
    """The ``JobClient`` that asks every rank of ``pid``'s job (``job_scope``)."""
    scope, pids = job_scope(pid)
    return JobClient(pids=pids, cluster=scope == "cluster", timeout=timeout), scope, pids


# -- list_processes -------------------------------------------------------------------


class Process(BaseModel):
    pid: int
    user: str
    probe: str = Field(description="'yes', 'stale' (a socket left, nothing answers) or '-'")
    cmdline: str
    job: str | None = Field(default=None, description="the job it belongs to (see jobs)")
    rank: int | None = None
    world_size: int | None = None
    node: str | None = None
    parent: int | None = Field(
        default=None, description="the rank this process works for (a worker)"
    )


class JobGroup(BaseModel):
    job: str = Field(description="the launcher's variables the ranks share")
    ranks: list[int] = Field(description="the pid of each rank on this machine, by rank")
    rank_of: dict[str, int | None] = Field(description="pid -> rank (null: not known)")
    workers: list[int] = Field(description="their child processes (data loader workers)")
    launcher: int | None = Field(
        default=None, description="the process that started them (torchrun)"
    )


class ProcessList(BaseModel):
    processes: list[Process]
    jobs: list[JobGroup]


def _job_key(env: dict[str, str]) -> str | None:
    from probing.procs import JOB_KEYS, STEP_KEYS

    key = {k: env[k] for k in JOB_KEYS if k in env}
    if not any(k in key for k in STEP_KEYS):
        return None
    return ",".join(f"{k}={v}" for k, v in sorted(key.items()))


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _probe_identity(pid: int) -> dict[str, Any]:
    """What ``pid``'s probe says of its place in the job (``/health``'s cluster)."""
    try:
        with ProbeClient.for_pid(pid, timeout=HEALTH_TIMEOUT_S) as probe:
            cl = probe.health().get("cluster")
    except ProbingError:
        return {}
    return cl if isinstance(cl, dict) else {}


def list_processes() -> tuple[ProcessList, str]:
    """``probing ps``, each process with its job and rank, the jobs grouped."""
    import psutil

    from probing.cli.render import format_rows
    from probing.proc import environ
    from probing.procs import python_processes

    procs = python_processes()
    probed = [p.pid for p in procs if p.probe == "yes"]
    with ThreadPoolExecutor(max_workers=8) as pool:
        identity = dict(zip(probed, pool.map(_probe_identity, probed), strict=True))
    out: list[Process] = []
    for proc in procs:
        env = environ(proc.pid)
        ident = identity.get(proc.pid, {})
        known = ident.get("rank")
        rank = known if isinstance(known, int) and known >= 0 else None
        if rank is None:
            rank = _int(env.get("PROBING_RANK") or env.get("RANK"))
        world = ident.get("world_size") if rank is not None and ident.get("rank") == rank else None
        out.append(
            Process(
                pid=proc.pid,
                user=proc.user,
                probe=proc.probe,
                cmdline=proc.cmdline,
                job=_job_key(env),
                rank=rank,
                world_size=world or _int(env.get("WORLD_SIZE")),
                node=ident.get("node") or None,
            )
        )
    by_pid = {m.pid: m for m in out}
    groups: dict[str, list[Process]] = {}
    for m in out:
        if m.job is not None:
            groups.setdefault(m.job, []).append(m)
    jobs = []
    for key, members in groups.items():
        pids = {m.pid for m in members}
        parent_of: dict[int, int | None] = {}
        for m in members:
            try:
                parent_of[m.pid] = psutil.Process(m.pid).ppid()
            except psutil.Error:
                parent_of[m.pid] = None
        ranks = [m for m in members if parent_of[m.pid] not in pids]
        workers = [m for m in members if parent_of[m.pid] in pids]
        for w in workers:
            w.parent = parent_of[w.pid]
        launchers = {parent_of[m.pid] for m in ranks} - {None}
        launcher = launchers.pop() if len(launchers) == 1 else None
        if launcher is not None and launcher in by_pid:
            by_pid[launcher].job = by_pid[launcher].job or key
        ranks.sort(key=lambda m: (m.rank is None, m.rank or 0, m.pid))
        jobs.append(
            JobGroup(
                job=key,
                ranks=[m.pid for m in ranks],
                rank_of={str(m.pid): m.rank for m in ranks},
                workers=sorted(w.pid for w in workers),
                launcher=launcher,
            )
        )
    rows = [[p.pid, p.user, p.probe, p.rank if p.rank is not None else "", p.cmdline] for p in out]
    text = format_rows(["PID", "USER", "PROBE", "RANK", "COMMAND"], rows, width=160)
    for j in jobs:
        who = ", ".join(f"rank {j.rank_of[str(p)]}: pid {p}" for p in j.ranks)
        text += f"\njob {j.job}: {who}"
        if j.workers:
            text += f"; workers {', '.join(map(str, j.workers))}"
    return ProcessList(processes=out, jobs=jobs), text


# -- stack ----------------------------------------------------------------------------


class StackFrame(BaseModel):
    func: str | None = None
    file: str | None = None
    line: int | None = None


class Thread(BaseModel):
    tid: int | None = None
    name: str | None = None
    state: str | None = Field(default=None, description="active, waiting or idle")
    syscall: str | None = Field(default=None, description="where it is blocked")
    cpu_pct: float | None = None
    frames: list[StackFrame] = Field(description="innermost first")


class Stacks(BaseModel):
    pid: int
    process: dict[str, Any]
    threads: list[Thread]
    notes: list[str] = Field(description="how they were read, where not from the probe")


def stack(pid: int, inject: bool) -> tuple[Stacks, str]:
    """Every thread's Python stack of ``pid`` (``probing stack``)."""
    from probing.cli.client import stacks
    from probing.cli.render import format_stacks

    notes: list[str] = []

    def told(msg: str) -> None:
        notes.append(msg)
        note(msg)

    info, frames = stacks(pid, inject=inject, note=told)
    threads: dict[Any, Thread] = {}
    for f in sorted(frames, key=lambda f: (f.get("tid") or 0, f.get("depth") or 0)):
        key = (f.get("tid"), f.get("thread"))
        if key not in threads:
            threads[key] = Thread(
                tid=f.get("tid"),
                name=f.get("thread"),
                state=f.get("state"),
                syscall=f.get("syscall"),
                cpu_pct=jsonable(f.get("cpu_pct")),
                frames=[],
            )
        threads[key].frames.append(
            StackFrame(func=f.get("func"), file=f.get("file"), line=f.get("line"))
        )
    answer = Stacks(pid=pid, process=jsonable(info), threads=list(threads.values()), notes=notes)
    return answer, format_stacks(info, frames)


# -- tables / describe_table ----------------------------------------------------------


class TableEntry(BaseModel):
    table: str
    kind: str | None = Field(default=None, description="how the probe answers it")
    about: str = Field(description="its heading in the SQL reference ('' where not documented)")
    rows: int | None = Field(default=None, description="rows it keeps (stored tables)")
    stored_bytes: int | None = None
    dropped: int | None = Field(default=None, description="events lost before they were stored")


class TableList(BaseModel):
    pid: int | None
    tables: list[TableEntry]
    reference: str = Field(description="the SQL reference read (docs/sql.md)")


STORED_SQL = (
    'SELECT "schema" || \'.\' || "table" AS "table", rows, stored_bytes, '
    "dropped_events AS dropped FROM probing.tables"
)


def tables(pid: int | None) -> tuple[TableList, str]:
    """The tables ``pid``'s probe answers (how, rows, bytes), or without a
    pid every table the reference documents."""
    from probing.cli.render import format_rows

    ref = reference.load()
    if pid is None:
        entries = [TableEntry(table=n, about=d.title) for n, d in ref.tables.items()]
    else:
        probe = client(pid)
        names, rows = probe.query_rows(STORED_SQL)
        stored = {r[0]: dict(zip(names, r, strict=True)) for r in rows}
        entries = []
        for t in probe.tables():
            name = f"{t['schema']}.{t['table']}"
            doc = ref.find(name)
            got = stored.get(name, {})
            entries.append(
                TableEntry(
                    table=name,
                    kind=t.get("kind"),
                    about=doc.title if doc else "",
                    rows=got.get("rows"),
                    stored_bytes=got.get("stored_bytes"),
                    dropped=got.get("dropped"),
                )
            )
    text = format_rows(
        ["TABLE", "ROWS", "ABOUT"],
        [[e.table, "" if e.rows is None else e.rows, e.about] for e in entries],
        width=160,
    )
    where = f"in pid {pid}'s probe" if pid is not None else "documented (give pid for live ones)"
    head = f"{len(entries)} tables {where}; describe_table gives a table's columns"
    return TableList(pid=pid, tables=entries, reference=str(ref.source)), f"{head}\n{text}"


class Column(BaseModel):
    name: str
    type: str | None = Field(default=None, description="its type in the probe (with pid)")
    nullable: bool | None = None
    meaning: str = Field(description="what the SQL reference says of it ('' where nothing)")


class TableDescription(BaseModel):
    table: str
    documented: bool
    title: str
    reference: str = Field(description="the table's section of docs/sql.md (Markdown)")
    columns: list[Column]
    live: bool = Field(description="columns read from the probe's information_schema")


COLUMNS_SQL = (
    "SELECT column_name, data_type, is_nullable FROM information_schema.columns "
    "WHERE table_schema = '{schema}' AND table_name = '{table}' ORDER BY ordinal_position"
)


def describe_table(table: str, pid: int | None) -> tuple[TableDescription, str]:
    """``table``'s columns and their meaning: the probe's own columns (with
    ``pid``) and what docs/sql.md says of each."""
    ref = reference.load()
    doc = ref.find(table)
    live: list[Column] = []
    if pid is not None:
        schema, _, name = table.partition(".")
        quoted = (schema.replace("'", "''"), name.strip("`").replace("'", "''"))
        cols, rows = client(pid).query_rows(COLUMNS_SQL.format(schema=quoted[0], table=quoted[1]))
        meanings = doc.columns if doc else {}
        for r in rows:
            got = dict(zip(cols, r, strict=True))
            live.append(
                Column(
                    name=got["column_name"],
                    type=str(got["data_type"]),
                    nullable=str(got["is_nullable"]).upper() == "YES",
                    meaning=meanings.get(got["column_name"], ""),
                )
            )
    if doc is None and not live:
        known = ", ".join(ref.tables)
        where = f"pid {pid}'s probe" if pid is not None else "the SQL reference"
        raise ProbingError(
            f"no table {table!r} in {where}",
            hint=f"call tables (with pid) for what a probe holds; documented: {known}",
        )
    columns = live or [Column(name=n, meaning=m) for n, m in (doc.columns if doc else {}).items()]
    answer = TableDescription(
        table=table,
        documented=doc is not None,
        title=doc.title if doc else "",
        reference=doc.text if doc else "",
        columns=columns,
        live=bool(live),
    )
    lines = [f"{c.name}{f' {c.type}' if c.type else ''}: {c.meaning}".rstrip(": ") for c in columns]
    text = f"{table}: {answer.title or 'not in the SQL reference'}\n" + "\n".join(lines)
    if doc is not None:
        text += f"\n\n{doc.text}"
    return answer, text


# -- query / findings -----------------------------------------------------------------


class QueryAnswer(Rows):
    scope: Literal["pid", "cluster", "local"] = Field(
        description="one probe, the job through its peers, or its ranks on this machine"
    )


def query(
    sql: str, pid: int, cluster: bool, max_rows: int, max_bytes: int, timeout: float
) -> tuple[QueryAnswer, str]:
    """Read-only ``sql`` in ``pid``'s probe, or across its job (``cluster``)."""
    missing: list[str] = []
    if cluster:
        from probing.cli.client import cluster_query

        res = cluster_query(sql, pid=pid, timeout=timeout)
        names, rows = arrow_rows(res.table)
        missing = [f"rank {m.rank} ({m.node or m.addr}): {m.reason}" for m in res.missing]
    else:
        names, rows = client(pid).query_rows(sql)
    got = capped(names, rows, max_rows, max_bytes)
    answer = QueryAnswer(**got.model_dump(), scope="cluster" if cluster else "pid")
    answer.missing = missing
    return answer, rows_text(answer)


FINDINGS_SQL = "SELECT * FROM analyze.findings ORDER BY ts"
ACTIVE_SQL = "SELECT * FROM analyze.findings WHERE cleared_ns IS NULL ORDER BY ts"


class Findings(QueryAnswer):
    active: int = Field(description="findings not cleared yet (cleared_ns null)")


def job_findings(job: JobClient, scope: str, pids: list[int], sql: str = FINDINGS_SQL) -> Any:
    """``sql`` over ``analyze.findings`` of every rank of a job, as a cluster
    query answers it in either scope: each row's own ``rank`` and ``node``
    (the rank a finding blames), the probe that answered as ``probe_node``,
    ``probe_rank`` (a local ask would tag each row with its probe's rank in
    place of the one it blames)."""
    import socket

    import pyarrow as pa

    from probing.analyze.gather import process_rank, with_missing

    if scope == "cluster":
        return job.ask(sql)
    node = socket.gethostname()
    parts, gone = [], []
    for p in pids:
        try:
            probe = client(p)
            table = probe.query(sql)
            rank = process_rank(probe, p)
        except ProbingError as err:
            gone.append(f"pid {p}: {err}")
            continue
        n = table.num_rows
        table = table.append_column("probe_node", pa.array([node] * n, pa.string()))
        parts.append(table.append_column("probe_rank", pa.array([rank] * n, pa.int64())))
    if not parts:
        raise ProbingError(f"no rank of the job answered: {'; '.join(gone)}")
    table = pa.concat_tables(parts, promote_options="default")
    if "ts" in table.column_names:
        table = table.sort_by("ts")
    return with_missing(table, gone)


def findings(pid: int, max_rows: int, max_bytes: int, timeout: float) -> tuple[Findings, str]:
    """The always-on findings of ``pid``'s job (``analyze.findings`` of every rank)."""
    from probing.analyze.gather import missing_ranks

    job, scope, pids = job_of(pid, timeout)
    table = job_findings(job, scope, pids)
    names, rows = arrow_rows(table)
    got = capped(names, rows, max_rows, max_bytes)
    cleared = names.index("cleared_ns") if "cleared_ns" in names else None
    active = sum(1 for r in rows if cleared is not None and r[cleared] is None)
    answer = Findings(**got.model_dump(), scope=scope, active=active)
    answer.missing = missing_ranks(table)
    text = rows_text(answer, "finding")
    if not rows:
        text = (
            "no findings: the job's detector has found nothing, or no rank traces "
            "(it runs while a probe traces: trace_start with cluster, or diagnose with record)"
        )
    return answer, text


# -- diagnose -------------------------------------------------------------------------


class Verdict(BaseModel):
    pid: int
    scope: Literal["cluster", "local"]
    healthy: bool
    verdict: str
    recorded_s: float | None = Field(
        default=None, description="how long every rank was traced first"
    )
    at: float = Field(description="when it was made (Unix seconds)")
    diagnosis: dict[str, Any] = Field(description="probing diagnose --format json")
    findings: list[dict[str, Any]] = Field(
        default_factory=list,
        description="the job's always-on detector's active findings (analyze.findings, "
        "cleared_ns null; rank: the rank each blames)",
    )
    unconfirmed: str | None = Field(
        default=None,
        description="what active findings say that this verdict does not (a different "
        "window, a trace stopped since: seen_ns says when each was last found)",
    )


def _record(pid: int, scope: str, seconds: float) -> None:
    """Trace every rank of ``pid``'s job ``seconds``, then stop the ones this started."""
    from probing.cli.commands.diagnose import start_recording
    from probing.cli.commands.trace import TraceOptions, job_trace

    if scope == "cluster":
        ranks = start_recording(pid, inject=False)
        stop_ranks: list[int] = ranks
        pids: list[int] = []
    else:
        rows = job_trace(pid, "start", False, TraceOptions(["nccl", "cuda", "gloo"]))
        pids = [r["pid"] for r in rows if r["done"]]
        stop_ranks = []
        if not any(r["ok"] for r in rows):
            why = "; ".join(f"pid {r['pid']}: {r['reason']}" for r in rows)
            raise ProbingError(f"no rank could be traced: {why}")
    note(f"recording pid {pid}'s job {seconds:g} s")
    try:
        time.sleep(seconds)
    finally:  # only what this started: a trace someone else runs goes on
        if stop_ranks:
            try:
                client(pid).cluster_trace("stop", ranks=stop_ranks)
            except ProbingError as err:
                note(f"stopping the recording: {err}")
        for p in pids:
            try:
                client(p).trace_stop()
            except ProbingError as err:
                note(f"stopping the recording of pid {p}: {err}")


def diagnose(
    pid: int, window_s: float, hang_s: float, record_s: float | None, timeout: float
) -> tuple[Verdict, str]:
    """The verdict on ``pid``'s job (``probing diagnose --cluster``), after
    tracing it ``record_s`` where asked."""
    from probing.cli.asking import diagnose as run_diagnosis
    from probing.cli.render import diagnosis

    if record_s is not None and record_s > MAX_RECORD_S:
        raise ProbingError(
            f"a recording of {record_s:g} s is longer than a call may wait ({MAX_RECORD_S:g} s)",
            hint="record less, or trace_start the job in the background and diagnose later",
        )
    job, scope, pids = job_of(pid, timeout)
    if record_s is not None:
        _record(pid, scope, record_s)
        window_s = min(window_s, record_s)

    def waiting(seconds: float) -> None:
        note(f"counts differ; watching {seconds:.0f} s for a hang")

    d, _ = run_diagnosis(job, window_s=window_s, hang_after_s=hang_s, on_wait=waiting)
    active = _active(job, scope, pids)
    said = unconfirmed(d, active)
    answer = Verdict(
        pid=pid,
        scope=scope,
        healthy=d.healthy,
        verdict=d.verdict,
        recorded_s=record_s,
        at=time.time(),
        diagnosis=jsonable(d.to_json()),
        findings=[jsonable(f) for f in active],
        unconfirmed=said,
    )
    text = diagnosis(d)
    return answer, f"{text}\n{said}" if said else text


MISSING_RANK = re.compile(r"rank (\d+)\b")  # a diagnosis's missing rank: "rank 3 (host1): ..."


def _active(job: JobClient, scope: str, pids: list[int]) -> list[dict[str, Any]]:
    """The job's active findings ([] where its probes keep none, or do not answer)."""
    try:
        rows: list[dict[str, Any]] = job_findings(job, scope, pids, ACTIVE_SQL).to_pylist()
    except ProbingError as err:
        note(f"the job's findings: {err}")
        return []
    return rows


def unconfirmed(d: Any, active: list[dict[str, Any]]) -> str | None:
    """What the job's ``active`` findings say that the diagnosis ``d`` does
    not (a straggler it does not name, a hang, a slow link or a rank gone it
    does not find), said with when each was last found; None where it says
    all of it. The detector judges its own last 30 s every 5 s: a diagnosis
    of another window, or one after the trace stopped, may see none of it."""
    from probing.analyze.verdict import hms

    named = {s.rank for s in d.stragglers}
    gone = set(d.dead) | {int(m.group(1)) for m in map(MISSING_RANK.match, d.missing) if m}
    kinds = {"hang": bool(d.hangs), "slow_link": bool(d.slow_links)}
    said = []
    for f in active:
        kind = f.get("kind")
        if kind == "straggler" and f.get("rank") in named:
            continue
        if kind == "rank_gone" and f.get("rank") in gone:
            continue
        if kinds.get(str(kind)):
            continue
        seen = f.get("seen_ns") or f.get("ts")
        when = f"last found at {hms(int(seen))}" if seen else "found"
        said.append(f"{f.get('text')} ({when})")
    if not said:
        return None
    return (
        "the job's always-on detector holds active findings this verdict does not "
        f"confirm: {'; '.join(said)}"
    )


# -- export_timeline ------------------------------------------------------------------


class Exported(BaseModel):
    path: str = Field(description="the Perfetto trace written (open it in ui.perfetto.dev)")
    bytes: int
    scope: Literal["cluster", "local"]
    summary: str


def inside(out_dir: Path, name: str) -> Path:
    """``name`` (relative to ``out_dir``, or absolute) if it is a file under
    ``out_dir``, links resolved; else an error."""
    path = (out_dir / name).resolve()
    if path == out_dir or not path.is_relative_to(out_dir):
        raise ProbingError(
            f"refusing to write {name!r}: the server writes only under {out_dir}",
            hint="give a file name such as job.pftrace (the directory is fixed by "
            "probing mcp --out-dir)",
        )
    return path


def export_timeline(
    pid: int, out_dir: Path, name: str | None, window_s: float, max_events: int | None,
    timeout: float,
) -> tuple[Exported, str]:  # fmt: skip
    """A Perfetto trace of ``pid``'s job written under ``out_dir``."""
    from probing.cli.export import Source, export

    name = name or f"job-{pid}-{time.strftime('%Y%m%d-%H%M%S')}.pftrace"
    path = inside(out_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    scope, pids = job_scope(pid)
    src = Source(pids=pids, cluster=scope == "cluster", timeout=timeout)
    report = export(src, str(path), fmt="perfetto", window_s=window_s, max_events=max_events)
    summary = report.summary()
    answer = Exported(path=str(path), bytes=path.stat().st_size, scope=scope, summary=summary)
    return answer, f"{summary}\nopen {path} in https://ui.perfetto.dev (or: probing ui)"


# -- control: trace_start, trace_stop, eval -------------------------------------------


class TraceAnswer(BaseModel):
    pid: int
    cluster: bool
    status: dict[str, Any] | None = Field(
        default=None, description="the probe's tracer (one process)"
    )
    ranks: list[dict[str, Any]] | None = Field(
        default=None, description="each rank's outcome (cluster)"
    )


def trace(
    pid: int, action: Literal["start", "stop"], cluster: bool, families: list[str], stacks: bool
) -> tuple[TraceAnswer, str]:
    """Start or stop tracing ``pid`` (or, with ``cluster``, every rank of its job)."""
    from probing.cli.render import TraceMonitor, control_rows

    probe = client(pid)
    if cluster:
        options: dict[str, Any] = {"families": families, "stacks": stacks}
        rows = probe.cluster_trace(action, **(options if action == "start" else {}))
        done = "tracing" if action == "start" else "stopped"
        return TraceAnswer(pid=pid, cluster=True, ranks=jsonable(rows)), control_rows(rows, done)
    if action == "start":
        status = probe.trace_start(families, stacks=stacks)
        text = TraceMonitor(pid, status).started()
    else:
        status = probe.trace_stop()
        text = TraceMonitor.summary(status)
    return TraceAnswer(pid=pid, cluster=False, status=jsonable(status)), text


class EvalAnswer(BaseModel):
    pid: int
    result: str | None = Field(default=None, description="repr of the value (an expression)")
    output: str = Field(description="what it printed")


def evaluate(pid: int, code: str) -> tuple[EvalAnswer, str]:
    """Run ``code`` in ``pid`` (its probe's local socket)."""
    out = client(pid).eval(code)
    answer = EvalAnswer(pid=pid, result=out.get("result"), output=out.get("output") or "")
    text = answer.output + (answer.result if answer.result is not None else "")
    return answer, text or "(no value, no output)"
