"""The MCP server of ``probing mcp``: its tools, resources and prompt, on the
official SDK's ``MCPServer`` (``mcp.server.mcpserver``).

Each tool has a JSON schema for its arguments (from the annotations below)
and one for its answer (the pydantic models of ``probing.cli.mcp.tools``):
the rows or the verdict as data (``structuredContent``) and a short text for
the model (``content``). A tool's failure comes back as the tool's error
(``isError``), with what to do next.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp.server.mcpserver.prompts.base import Message, UserMessage
from mcp.server.mcpserver.resources import FunctionResource
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, Field

from probing.cli.mcp import reference, tools
from probing.cli.mcp.control import Control
from probing.config import parse_interval
from probing.errors import EvalError, ProbingError

MAX_ROWS, MAX_BYTES = 200, 64 * 1024  # a query's answer by default
ROWS_LIMIT, BYTES_LIMIT = 10_000, 4 << 20  # and at most, whatever is asked

INSTRUCTIONS = """\
probing looks inside running Python / PyTorch processes and distributed jobs
on this machine: their threads and stacks, and (once traced with eBPF) every
NCCL, CUDA and Gloo call, queried with SQL. Start with list_processes (the
jobs and their ranks, and which carry a probe), then diagnose a job (which
rank is slow or hung, and why), stack a pid, and query its tables (tables
and describe_table say what they hold; resources probing://sql/<table> are
the SQL reference). A process without a probe: start it with PROBING=1, or
`probing inject --pid P` outside this server.
"""

READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)
WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
CONTROL = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)

Pid = Annotated[int, Field(description="process id of the target (see list_processes)", gt=0)]
JobPid = Annotated[
    int, Field(description="process id of any rank of the job on this machine", gt=0)
]
Timeout = Annotated[
    float, Field(description="seconds to wait for the job's other ranks", gt=0, le=120)
]
MaxRows = Annotated[
    int, Field(description="rows to give at most (the answer says when rows were cut)", ge=1,
               le=ROWS_LIMIT),
]  # fmt: skip
MaxBytes = Annotated[
    int, Field(description="bytes of JSON rows to give at most", ge=256, le=BYTES_LIMIT)
]
Families = Literal["nccl", "cuda", "gloo"]


def answer(data: BaseModel, text: str) -> CallToolResult:
    """A tool's answer: ``data`` (checked against its output schema) and ``text``."""
    return CallToolResult(
        content=[TextContent(type="text", text=text)],
        structured_content=data.model_dump(mode="json"),
    )


def run(fn: Callable[[], tuple[BaseModel, str]]) -> CallToolResult:
    """``fn``'s answer; a ProbingError (and a bad argument) becomes the tool's
    error, with the hint of what to do next and, for eval, the target's traceback."""
    try:
        data, text = fn()
    except EvalError as err:
        raise ToolError(f"{err}\n{err.detail}".rstrip()) from err
    except (ProbingError, ValueError, OSError) as err:
        raise ToolError(str(err)) from err
    return answer(data, text)


def seconds(text: str, what: str) -> float:
    """A duration the agent gives ("30s", "500ms"), or a clear error."""
    try:
        return parse_interval(text)
    except ValueError as err:
        raise ProbingError(f"{what}: {err}", hint="give e.g. 30s, 500ms or 2") from None


@dataclass
class State:
    """What the server keeps between calls: where it writes, the control
    gate, and the latest diagnosis of each job it diagnosed (by the pid asked)."""

    out_dir: Path
    control: Control
    latest: dict[int, tools.Verdict] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def remember(self, verdict: tools.Verdict) -> None:
        with self.lock:
            self.latest[verdict.pid] = verdict


def build(out_dir: Path, *, allow_control: bool) -> MCPServer:
    """The server: its tools, resources and prompt, writing under ``out_dir``."""
    from probing.guest.place import VERSION

    state = State(out_dir=out_dir, control=Control(allow_control, out_dir))
    server: MCPServer = MCPServer(
        "probing", instructions=INSTRUCTIONS, version=VERSION, log_level="WARNING"
    )
    add_tools(server, state)
    add_resources(server, state)
    add_prompts(server)
    return server


def add_tools(server: MCPServer, state: State) -> None:
    """The tools: what the CLI's commands answer, as data."""
    add_process_tools(server)
    add_job_tools(server, state)
    add_control_tools(server, state)


def add_process_tools(server: MCPServer) -> None:
    """The read-only tools on this machine's processes: list them, read their
    stacks, their tables and what each holds, and query them with SQL."""

    @server.tool(annotations=READ_ONLY)
    def list_processes() -> Annotated[CallToolResult, tools.ProcessList]:
        """The Python processes on this machine (what `probing ps` shows): each with its
        probe status (yes, stale, -), its job and rank; and the jobs, their ranks grouped."""
        return run(tools.list_processes)

    @server.tool(annotations=READ_ONLY)
    def stack(
        pid: Pid,
        inject: Annotated[
            bool,
            Field(description="inject a probe first when the process has none (ptrace); "
                  "without one the stacks are read from outside"),
        ] = False,
    ) -> Annotated[CallToolResult, tools.Stacks]:  # fmt: skip
        """Every thread's Python stack of a process (`probing stack`): name, tid, state,
        where it is blocked, and its frames innermost first."""
        return run(lambda: tools.stack(pid, inject))

    @server.tool(annotations=READ_ONLY)
    def tables(
        pid: Annotated[
            int | None,
            Field(description="a process with a probe: its tables, with rows and bytes; "
                  "leave out for every documented table", gt=0),
        ] = None,
    ) -> Annotated[CallToolResult, tools.TableList]:  # fmt: skip
        """The tables a probe holds (schema.table, rows, bytes, what each is), from its
        catalog and the SQL reference (docs/sql.md)."""
        return run(lambda: tools.tables(pid))

    @server.tool(annotations=READ_ONLY)
    def describe_table(
        table: Annotated[str, Field(description="schema.table, e.g. comm.collectives")],
        pid: Annotated[
            int | None,
            Field(description="a process with a probe: its columns and types, live", gt=0),
        ] = None,
    ) -> Annotated[CallToolResult, tools.TableDescription]:
        """A table's columns and what each means (from docs/sql.md, the source of truth),
        with their types in a live probe when pid is given."""
        return run(lambda: tools.describe_table(table, pid))

    @server.tool(annotations=READ_ONLY)
    def query(
        sql: Annotated[
            str,
            Field(description="read-only SQL (SELECT, WITH, SHOW, EXPLAIN) over tables as "
                  "schema.table; see tables and describe_table", min_length=1),
        ],
        pid: Pid,
        cluster: Annotated[
            bool,
            Field(description="run it over every rank of pid's job; rows gain node and rank"),
        ] = False,
        max_rows: MaxRows = MAX_ROWS,
        max_bytes: MaxBytes = MAX_BYTES,
        timeout: Timeout = 5.0,
    ) -> Annotated[CallToolResult, tools.QueryAnswer]:  # fmt: skip
        """Run read-only SQL in a process's probe, or across its job with cluster. The
        answer says how many rows there were and whether they were cut (max_rows, max_bytes)."""
        return run(lambda: tools.query(sql, pid, cluster, max_rows, max_bytes, timeout))


def add_job_tools(server: MCPServer, state: State) -> None:
    """The tools on a whole job: its verdict (remembered in ``state`` for the
    jobs resource), its detector's findings, its timeline written under
    ``state.out_dir``."""

    @server.tool(annotations=WRITES)
    def diagnose(
        pid: JobPid,
        window: Annotated[str, Field(description="how far back to look: 60s, 500ms")] = "60s",
        hang_after: Annotated[
            str, Field(description="a collective not entered by every rank this long is a hang")
        ] = "10s",
        record: Annotated[
            str | None,
            Field(description="first trace every rank this long (15s), then stop the ranks "
                  f"this call started: for a job nobody traces (at most {tools.MAX_RECORD_S:g} s)"),
        ] = None,
        timeout: Timeout = 5.0,
    ) -> Annotated[CallToolResult, tools.Verdict]:  # fmt: skip
        """The verdict on a distributed job (`probing diagnose --cluster`): the straggler,
        slow link or hang, why it is slow (analyze.why), with every rank's evidence. Over the
        job's peers when its probes joined the job, else over its ranks on this machine. With
        it, the always-on detector's active findings, and what they say that the verdict does
        not (unconfirmed: another window, or a trace stopped since)."""

        def go() -> tuple[BaseModel, str]:
            window_s = seconds(window, "window")
            hang_s = seconds(hang_after, "hang_after")
            record_s = seconds(record, "record") if record else None
            verdict, text = tools.diagnose(pid, window_s, hang_s, record_s, timeout)
            state.remember(verdict)
            return verdict, text

        return run(go)

    @server.tool(annotations=READ_ONLY)
    def findings(
        pid: JobPid,
        max_rows: MaxRows = MAX_ROWS,
        max_bytes: MaxBytes = MAX_BYTES,
        timeout: Timeout = 5.0,
    ) -> Annotated[CallToolResult, tools.Findings]:
        """What the job's always-on detector found while it traces (analyze.findings of
        every rank): stragglers, slow links, hangs, ranks gone, each with when it began and
        cleared (cleared_ns null: still active); rank and node: the rank each blames (the
        probe that answered: probe_rank, probe_node)."""
        return run(lambda: tools.findings(pid, max_rows, max_bytes, timeout))

    @server.tool(annotations=WRITES)
    def export_timeline(
        pid: JobPid,
        file: Annotated[
            str | None,
            Field(description="file name under the server's output directory "
                  "(default job-<pid>-<time>.pftrace); nothing outside it is written"),
        ] = None,
        window: Annotated[str, Field(description="how far back to export: 60s")] = "60s",
        max_events: Annotated[
            int | None, Field(description="keep at most this many events (the newest)", ge=1)
        ] = None,
        timeout: Timeout = 10.0,
    ) -> Annotated[CallToolResult, tools.Exported]:  # fmt: skip
        """Write every rank's recent events as a Perfetto trace (a track per rank, flows
        per collective) under the server's output directory; returns its path."""

        def go() -> tuple[BaseModel, str]:
            window_s = seconds(window, "window")
            return tools.export_timeline(pid, state.out_dir, file, window_s, max_events, timeout)

        return run(go)


def add_control_tools(server: MCPServer, state: State) -> None:
    """The tools that act on a target (start and stop its tracing, run Python in
    it): each call goes through ``state.control``, which refuses it without
    ``--allow-control`` and logs it."""

    @server.tool(annotations=CONTROL)
    def trace_start(
        pid: Pid,
        cluster: Annotated[
            bool, Field(description="every rank of the job, through pid's peers")
        ] = False,
        families: Annotated[
            list[Families], Field(description="what to trace", min_length=1)
        ] = ["nccl", "cuda", "gloo"],  # noqa: B006 - pydantic copies it per call
        stacks: Annotated[
            bool, Field(description="record the Python stack of each call")
        ] = True,
    ) -> Annotated[CallToolResult, tools.TraceAnswer]:  # fmt: skip
        """Start eBPF tracing of NCCL, CUDA and Gloo calls in a process (or every rank of its
        job) in the background; stop it with trace_stop. Needs probing mcp --allow-control."""
        args = {"pid": pid, "cluster": cluster, "families": list(families), "stacks": stacks}
        return run(
            lambda: state.control.run(
                "trace_start",
                args,
                lambda: tools.trace(pid, "start", cluster, list(families), stacks),
            )
        )

    @server.tool(annotations=CONTROL)
    def trace_stop(
        pid: Pid,
        cluster: Annotated[
            bool, Field(description="every rank of the job, through pid's peers")
        ] = False,
    ) -> Annotated[CallToolResult, tools.TraceAnswer]:
        """Stop the tracing of a process (or of every rank of its job); its events stay
        queryable. Needs probing mcp --allow-control."""
        args = {"pid": pid, "cluster": cluster}
        return run(
            lambda: state.control.run(
                "trace_stop", args, lambda: tools.trace(pid, "stop", cluster, [], True)
            )
        )

    @server.tool(name="eval", annotations=CONTROL)
    def eval_(
        pid: Pid,
        code: Annotated[
            str, Field(description="a Python expression or statements, run in the target",
                       min_length=1),
        ],
    ) -> Annotated[CallToolResult, tools.EvalAnswer]:  # fmt: skip
        """Run Python inside the target process (its __main__); its value and what it
        printed. Needs probing mcp --allow-control; every call is logged."""
        args = {"pid": pid, "code": code}
        return run(lambda: state.control.run("eval", args, lambda: tools.evaluate(pid, code)))


def add_resources(server: MCPServer, state: State) -> None:
    """The SQL reference of every table, and the latest diagnosis of each job."""
    add_sql_resources(server)
    add_job_resources(server, state)


def add_sql_resources(server: MCPServer) -> None:
    """The SQL reference: a resource per table (its section of docs/sql.md as
    the file is when read; none where the page is not installed), and the
    whole page at probing://sql."""
    try:
        ref = reference.load()
    except ProbingError as err:
        tools.note(f"no SQL reference resources: {err}")
        ref = None
    if ref is not None:

        def section(doc: reference.TableDoc) -> Callable[[], str]:
            return lambda: (reference.load().find(doc.name) or doc).text

        for doc in ref.tables.values():
            server.add_resource(
                FunctionResource(
                    uri=doc.uri,
                    name=f"sql:{doc.name}",
                    title=f"SQL reference: {doc.name}",
                    description=doc.title,
                    mime_type="text/markdown",
                    fn=section(doc),
                )
            )

    @server.resource(
        "probing://sql",
        name="sql",
        title="SQL reference",
        description="every table a probe answers, with its columns (docs/sql.md)",
        mime_type="text/markdown",
    )
    def sql_reference() -> str:
        try:
            return reference.load().source.read_text(encoding="utf-8")
        except (ProbingError, OSError) as err:
            raise ResourceError(str(err)) from err


def add_job_resources(server: MCPServer, state: State) -> None:
    """The jobs this server diagnosed (probing://jobs) and the latest verdict
    on each (probing://jobs/<pid>/diagnosis, diagnosed then if it never was)."""

    @server.resource(
        "probing://jobs",
        name="jobs",
        title="Watched jobs",
        description="the jobs this server diagnosed, each with its latest verdict",
        mime_type="application/json",
    )
    def jobs() -> str:
        with state.lock:
            latest = list(state.latest.values())
        return json.dumps(
            [
                {"pid": v.pid, "scope": v.scope, "healthy": v.healthy, "verdict": v.verdict,
                 "at": v.at, "uri": f"probing://jobs/{v.pid}/diagnosis"}
                for v in latest
            ]
        )  # fmt: skip

    @server.resource(
        "probing://jobs/{pid}/diagnosis",
        name="diagnosis",
        title="Latest diagnosis of a job",
        description="the latest verdict on the job of pid (diagnosed now if it never was)",
        mime_type="application/json",
    )
    def diagnosis(pid: str) -> str:
        if not pid.isdigit():
            raise ResourceError(f"{pid!r} is not a pid: read probing://jobs/<pid>/diagnosis")
        with state.lock:
            verdict = state.latest.get(int(pid))
        if verdict is None:
            try:
                verdict, _ = tools.diagnose(int(pid), 60.0, 10.0, None, 5.0)
            except ProbingError as err:
                raise ResourceError(str(err)) from err
            state.remember(verdict)
        return verdict.model_dump_json()


INVESTIGATE = """\
The distributed job that process {pid} belongs to is slow. Find out which rank \
holds it back and why, with the probing tools, one step at a time:

1. Call `diagnose` with pid={pid}. If the verdict says the ranks were not traced \
(or nothing was recorded), call it again with record="15s": it traces every rank \
15 s and stops only what it started.
2. Read the verdict: the straggler (or slow link, or hang), and `why` in the \
diagnosis: what makes that rank slow (a function, CPU starvation, its collectives, \
CUDA), with its share of the lateness.
3. Find the straggler's pid: `query` pid={pid}, cluster=true, \
sql="SELECT node, rank, pid FROM process.info ORDER BY rank". If it runs on this \
machine, call `stack` on it and say where its threads are (the line of the job \
that is slow, or where it waits).
4. Check with one follow-up `query` (cluster=true) that the numbers agree, e.g. \
"SELECT rank, op, count(*) AS calls, avg(dur_ns)/1e6 AS avg_ms FROM \
comm.collectives GROUP BY rank, op ORDER BY avg_ms DESC" (describe_table \
comm.collectives lists its columns), or \
"SELECT * FROM analyze.findings" for what the job's detector saw.

Then answer in a few sentences: which rank (and node) is slow, the evidence, \
the line of code or the resource to blame, and what to try next.
"""


def add_prompts(server: MCPServer) -> None:
    @server.prompt(
        name="investigate_slow_job",
        title="Investigate a slow distributed job",
        description="diagnose the job, read why, look at the straggler's stack, check with a query",
    )
    def investigate_slow_job(
        pid: Annotated[int, Field(description="process id of any rank of the job")],
    ) -> list[Message]:
        return [UserMessage(INVESTIGATE.format(pid=pid))]
