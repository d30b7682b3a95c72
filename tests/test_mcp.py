"""``probing mcp`` driven by the MCP SDK's own client, as an agent drives it:
over stdio (``python -m probing mcp`` spawned) and over streamable HTTP,
against real processes started with ``PROBING=1``."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import IO, Any

import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult

from tests.conftest import IDLE_LOOP, REPO, SLOWDOWN, Target

TOOLS = {
    "list_processes", "stack", "tables", "describe_table", "query", "diagnose", "findings",
    "export_timeline", "trace_start", "trace_stop", "eval",
}  # fmt: skip
CONTROL = {"trace_start", "trace_stop", "eval"}
TOKEN = "mcp-test-token"
# the ranks of a job as a launcher starts them; no cluster: nothing listens for them
JOB_ENV = {"TORCHELASTIC_RUN_ID": "mcp-test-job", "WORLD_SIZE": "2", "PROBING_CLUSTER": "off"}


def server_args(*flags: str) -> list[str]:
    return ["-m", "probing", "mcp", *flags]


def over_stdio(tmp_path: Path, go: Callable[[Client], Awaitable[None]], *flags: str) -> str:
    """Run ``go`` with a client of ``python -m probing mcp FLAGS`` over stdio;
    the server's stderr."""
    params = StdioServerParameters(
        command=sys.executable, args=server_args(*flags), env=dict(os.environ), cwd=str(REPO)
    )
    errlog = tmp_path / "server.stderr"

    async def main() -> None:
        with errlog.open("w") as err:
            async with Client(stdio_client(params, errlog=err), read_timeout_seconds=120) as c:
                await go(c)

    anyio.run(main)
    return errlog.read_text()


def ok(result: CallToolResult) -> dict[str, Any]:
    """A tool's structured answer, once it is sure it did not fail."""
    assert not result.is_error, result.content
    assert result.content and result.content[0].type == "text"
    assert isinstance(result.structured_content, dict)
    return result.structured_content


def failed(result: CallToolResult) -> str:
    """A tool's error text, once it is sure it failed."""
    assert result.is_error, result.structured_content
    return " ".join(getattr(c, "text", "") for c in result.content)


@pytest.fixture
def job(spawn) -> list[Target]:  # type: ignore[no-untyped-def]
    """Two ranks of one job (rank 1 started first) and a probed process of no job."""
    ranks = [spawn(IDLE_LOOP, env={**JOB_ENV, "RANK": str(r)}) for r in (1, 0)]
    loner = spawn(IDLE_LOOP, env={"PROBING_CLUSTER": "off"})
    return [ranks[1], ranks[0], loner]


def test_the_tools_resources_and_prompt_have_their_schemas(tmp_path: Path) -> None:
    got: dict[str, Any] = {}

    async def go(c: Client) -> None:
        got["tools"] = {t.name: t for t in (await c.list_tools()).tools}
        got["resources"] = {str(r.uri): r for r in (await c.list_resources()).resources}
        got["templates"] = [
            t.uri_template for t in (await c.list_resource_templates()).resource_templates
        ]
        got["read"] = await c.read_resource("probing://sql/process.threads")
        got["prompts"] = {p.name: p for p in (await c.list_prompts()).prompts}
        got["prompt"] = await c.get_prompt("investigate_slow_job", {"pid": "4242"})

    over_stdio(tmp_path, go)
    tools = got["tools"]
    assert set(tools) == TOOLS
    for name, tool in tools.items():
        assert tool.input_schema["type"] == "object", name
        assert tool.output_schema and tool.output_schema.get("properties"), name
        assert tool.description, name
    query = tools["query"].input_schema
    assert query["required"] == ["sql", "pid"]
    assert query["properties"]["max_rows"]["maximum"] == 10_000
    assert {"truncated", "truncated_by", "total_rows", "rows"} <= set(
        tools["query"].output_schema["properties"]
    )
    assert {"verdict", "healthy", "diagnosis"} <= set(tools["diagnose"].output_schema["properties"])
    assert tools["trace_start"].input_schema["properties"]["families"]["items"]["enum"] == [
        "nccl", "cuda", "gloo",
    ]  # fmt: skip
    for name in CONTROL:
        assert "--allow-control" in (tools[name].description or ""), name
        assert tools[name].annotations and tools[name].annotations.destructive_hint
    assert tools["query"].annotations and tools["query"].annotations.read_only_hint
    # the SQL reference, parsed from docs/sql.md: a resource per table, its section as written
    text = (REPO / "docs" / "sql.md").read_text()
    for table in ("process.threads", "comm.collectives", "nccl.inflight", "analyze.findings"):
        assert f"probing://sql/{table}" in got["resources"], table
    section = got["read"].contents[0].text
    assert section.startswith("## `process.threads`") and section.strip() in text
    assert "probing://jobs/{pid}/diagnosis" in got["templates"]
    prompt = got["prompts"]["investigate_slow_job"]
    assert [(a.name, a.required) for a in prompt.arguments or []] == [("pid", True)]
    walk = got["prompt"].messages[0].content.text
    for step in ("`diagnose` with pid=4242", "record=", "`stack`", "`query`", "why"):
        assert step in walk, step


def test_processes_stacks_tables_and_queries_of_real_processes(
    tmp_path: Path, job: list[Target]
) -> None:
    rank0, rank1, loner = job
    got: dict[str, Any] = {}

    async def go(c: Client) -> None:
        got["ps"] = await c.call_tool("list_processes", {})
        got["stack"] = await c.call_tool("stack", {"pid": loner.pid})
        got["threads"] = await c.call_tool(
            "query", {"pid": loner.pid, "sql": "SELECT name FROM process.threads ORDER BY name"}
        )
        got["cut"] = await c.call_tool(
            "query", {"pid": loner.pid, "sql": "SELECT * FROM process.threads", "max_rows": 1}
        )
        got["bytes"] = await c.call_tool(
            "query", {"pid": loner.pid, "sql": "SELECT * FROM process.stacks", "max_bytes": 256}
        )
        got["bad"] = await c.call_tool(
            "query", {"pid": loner.pid, "sql": "SELECT * FROM process.nonexistent"}
        )
        got["write"] = await c.call_tool(
            "query", {"pid": loner.pid, "sql": "CREATE TABLE x AS SELECT 1"}
        )
        got["tables"] = await c.call_tool("tables", {"pid": loner.pid})
        got["describe"] = await c.call_tool(
            "describe_table", {"table": "process.threads", "pid": loner.pid}
        )
        got["unknown"] = await c.call_tool("describe_table", {"table": "process.nope"})
        got["no probe"] = await c.call_tool("query", {"pid": os.getpid(), "sql": "SELECT 1"})

    over_stdio(tmp_path, go)
    ps = ok(got["ps"])
    listed = {p["pid"]: p for p in ps["processes"]}
    assert {listed[t.pid]["probe"] for t in job} == {"yes"}
    assert listed[rank0.pid]["rank"] == 0 and listed[rank1.pid]["rank"] == 1
    assert listed[loner.pid]["job"] is None
    [group] = [j for j in ps["jobs"] if "TORCHELASTIC_RUN_ID=mcp-test-job" in j["job"]]
    assert group["ranks"] == [rank0.pid, rank1.pid]  # by rank, not by start
    assert group["rank_of"] == {str(rank0.pid): 0, str(rank1.pid): 1}
    assert f"rank 0: pid {rank0.pid}" in got["ps"].content[0].text

    stacks = ok(got["stack"])
    by_name = {t["name"]: t for t in stacks["threads"]}
    assert {"MainThread", "loader-0", "loader-1"} <= set(by_name)
    assert [f["func"] for f in by_name["loader-0"]["frames"]][:1] == ["work"]
    assert stacks["process"]["pid"] == loner.pid
    assert "Thread" in got["stack"].content[0].text and "loader-1" in got["stack"].content[0].text

    threads = ok(got["threads"])
    names = [r["name"] for r in threads["rows"]]
    assert {"MainThread", "loader-0", "loader-1"} <= set(names) and names == sorted(names)
    assert not threads["truncated"] and threads["total_rows"] == threads["returned_rows"]
    assert threads["scope"] == "pid" and threads["columns"] == ["name"]

    cut = ok(got["cut"])
    assert cut["truncated"] and cut["truncated_by"] == "max_rows"
    assert cut["returned_rows"] == 1 and len(cut["rows"]) == 1 and cut["total_rows"] >= 3
    assert "only the first 1 are given (cut by max_rows)" in got["cut"].content[0].text
    by_bytes = ok(got["bytes"])
    assert by_bytes["truncated_by"] == "max_bytes"
    assert len(json.dumps(by_bytes["rows"])) <= 256
    assert by_bytes["returned_rows"] == len(by_bytes["rows"]) < by_bytes["total_rows"]

    assert "nonexistent" in failed(got["bad"])
    assert failed(got["write"])  # read-only: the probe refuses it

    tables = {t["table"]: t for t in ok(got["tables"])["tables"]}
    assert tables["process.threads"]["about"] == "process.threads (one row per OS thread)"
    assert {"comm.collectives", "analyze.findings"} <= set(tables)
    described = ok(got["describe"])
    columns = {c["name"]: c for c in described["columns"]}
    assert described["live"] and described["documented"]
    assert columns["tid"]["meaning"] == "native id" and columns["tid"]["type"]
    assert columns["state"]["meaning"].startswith("`R`, `S`, `D`")
    assert "call tables" in failed(got["unknown"])
    assert "no probe" in failed(got["no probe"]) and "probing inject" in failed(got["no probe"])


def test_diagnose_findings_and_export_of_a_job(tmp_path: Path, job: list[Target]) -> None:
    rank0, rank1, _ = job
    out = tmp_path / "out"
    got: dict[str, Any] = {}

    async def go(c: Client) -> None:
        got["diagnose"] = await c.call_tool("diagnose", {"pid": rank1.pid, "window": "30s"})
        got["jobs"] = await c.read_resource("probing://jobs")
        got["latest"] = await c.read_resource(f"probing://jobs/{rank1.pid}/diagnosis")
        got["bad window"] = await c.call_tool("diagnose", {"pid": rank1.pid, "window": "soon"})
        got["long"] = await c.call_tool("diagnose", {"pid": rank1.pid, "record": "600s"})
        got["findings"] = await c.call_tool("findings", {"pid": rank0.pid})
        got["export"] = await c.call_tool(
            "export_timeline", {"pid": rank0.pid, "file": "a.pftrace"}
        )
        got["escape"] = await c.call_tool(
            "export_timeline", {"pid": rank0.pid, "file": "../escape.pftrace"}
        )
        got["absolute"] = await c.call_tool(
            "export_timeline", {"pid": rank0.pid, "file": str(tmp_path / "abs.pftrace")}
        )

    over_stdio(tmp_path, go, "--out-dir", str(out))
    verdict = ok(got["diagnose"])
    assert verdict["scope"] == "local" and verdict["pid"] == rank1.pid
    assert verdict["verdict"] and verdict["verdict"] == verdict["diagnosis"]["verdict"]
    # both ranks on this machine asked (the job is not in cluster mode), by rank
    assert [r["rank"] for r in verdict["diagnosis"]["ranks"]] == [0, 1]
    assert " ".join(verdict["verdict"].split()) in " ".join(got["diagnose"].content[0].text.split())
    # the watched job and its latest verdict, as resources
    [watched] = json.loads(got["jobs"].contents[0].text)
    assert watched["pid"] == rank1.pid and watched["verdict"] == verdict["verdict"]
    assert json.loads(got["latest"].contents[0].text)["at"] == verdict["at"]
    assert "give e.g. 30s" in failed(got["bad window"])
    assert "longer than a call may wait (300 s)" in failed(got["long"])

    findings = ok(got["findings"])
    assert findings["scope"] == "local" and findings["total_rows"] == 0
    assert {"kind", "rank", "text", "cleared_ns"} <= set(findings["columns"])
    assert "trace_start" in got["findings"].content[0].text  # how to get some

    exported = ok(got["export"])
    assert exported["path"] == str((out / "a.pftrace").resolve())
    assert Path(exported["path"]).stat().st_size == exported["bytes"] > 0
    assert "2 rank(s)" in exported["summary"]
    for key in ("escape", "absolute"):
        assert f"only under {out.resolve()}" in failed(got[key]), key
    assert not (tmp_path / "escape.pftrace").exists() and not (tmp_path / "abs.pftrace").exists()


def _audit(out: Path) -> list[dict[str, Any]]:
    path = out / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_control_tools_are_refused_without_the_flag(tmp_path: Path, spawn) -> None:  # type: ignore[no-untyped-def]
    t = spawn(IDLE_LOOP, env={"PROBING_CLUSTER": "off"})
    out = tmp_path / "out"
    got: dict[str, Any] = {}

    async def go(c: Client) -> None:
        got["eval"] = await c.call_tool("eval", {"pid": t.pid, "code": "open('/tmp/x', 'w')"})
        got["start"] = await c.call_tool("trace_start", {"pid": t.pid})
        got["stop"] = await c.call_tool("trace_stop", {"pid": t.pid, "cluster": True})

    err = over_stdio(tmp_path, go, "--out-dir", str(out))
    for key in ("eval", "start", "stop"):
        text = failed(got[key])
        assert "--allow-control" in text and "probing mcp --allow-control" in text, text
    assert [(a["tool"], a["outcome"]) for a in _audit(out)] == [
        ("eval", "refused"), ("trace_start", "refused"), ("trace_stop", "refused"),
    ]  # fmt: skip
    assert "audit: eval pid=" in err and ": refused" in err


def test_control_tools_work_and_are_logged_with_the_flag(tmp_path: Path, spawn) -> None:  # type: ignore[no-untyped-def]
    t = spawn(IDLE_LOOP, env={"PROBING_CLUSTER": "off"})
    out = tmp_path / "out"
    got: dict[str, Any] = {}

    async def go(c: Client) -> None:
        got["value"] = await c.call_tool("eval", {"pid": t.pid, "code": "6 * 7"})
        got["print"] = await c.call_tool(
            "eval", {"pid": t.pid, "code": "import os\nprint('pid', os.getpid())"}
        )
        got["raise"] = await c.call_tool("eval", {"pid": t.pid, "code": "1 / 0"})
        got["stop"] = await c.call_tool("trace_stop", {"pid": t.pid})  # nothing to stop

    err = over_stdio(tmp_path, go, "--allow-control", "--out-dir", str(out))
    assert ok(got["value"]) == {"pid": t.pid, "result": "42", "output": ""}
    assert ok(got["print"])["output"] == f"pid {t.pid}\n"  # it ran in the target
    assert "ZeroDivisionError" in failed(got["raise"])
    assert "not tracing" in failed(got["stop"]).lower()
    audit = _audit(out)
    assert [(a["tool"], a["outcome"]) for a in audit] == [
        ("eval", "ok"), ("eval", "ok"), ("eval", "error"), ("trace_stop", "error"),
    ]  # fmt: skip
    assert audit[0]["args"] == {"pid": t.pid, "code": "6 * 7"}
    assert "ZeroDivision" in audit[2]["error"] and audit[0]["server_pid"] != t.pid
    assert os.stat(out / "audit.jsonl").st_mode & 0o077 == 0
    assert err.count("probing mcp: audit: eval") == 3


# -- streamable HTTP ------------------------------------------------------------------


def _start_http(*flags: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """``probing mcp --http FLAGS`` in ``env`` and the URL it prints once it listens."""
    proc = subprocess.Popen(
        [sys.executable, *server_args("--http", "--port", "0", *flags)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines: queue.Queue[str] = queue.Queue()

    def read(stream: IO[str]) -> None:  # its lines, as they come, till it closes
        for line in stream:
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, args=(proc.stderr,), daemon=True).start()
    said = ""
    deadline = time.monotonic() + 60 * SLOWDOWN
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        said += line
        if "serving MCP on " in line:
            return proc, line.split("serving MCP on ", 1)[1].split()[0]
        if not line:
            break
    proc.kill()
    raise AssertionError(f"probing mcp --http never listened: {said}")


@pytest.fixture
def http_server() -> Iterator[Callable[..., tuple[subprocess.Popen[str], str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(*flags: str, token: str | None) -> tuple[subprocess.Popen[str], str]:
        env = {k: v for k, v in os.environ.items() if k != "PROBING_MCP_TOKEN"}
        proc, url = _start_http(
            *flags, env=env if token is None else {**env, "PROBING_MCP_TOKEN": token}
        )
        started.append(proc)
        return proc, url

    yield start
    for p in started:
        p.terminate()
        p.wait(timeout=30)


def _post(url: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}).encode()
    req = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json",
                 "Accept": "application/json, text/event-stream", **headers},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_http_off_the_loopback_needs_a_token_at_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PROBING_MCP_TOKEN"}
    r = subprocess.run(
        [sys.executable, *server_args("--http", "--host", "0.0.0.0", "--port", "0",
                                      "--out-dir", str(tmp_path / "out"))],
        env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60 * SLOWDOWN,
    )  # fmt: skip
    assert r.returncode == 1 and r.stdout == ""
    assert "refusing to serve MCP on 0.0.0.0 without a bearer token" in r.stderr
    assert "PROBING_MCP_TOKEN" in r.stderr and "--token" in r.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_http_with_a_token_serves_the_tools_and_rejects_requests_without_it(
    spawn,
    http_server,  # type: ignore[no-untyped-def]
) -> None:
    import httpx2

    t = spawn(IDLE_LOOP, env={"PROBING_CLUSTER": "off"})
    # every address, the token from the environment (as an agent host would set it)
    _, url = http_server("--host", "0.0.0.0", token=TOKEN)
    local = url.replace("0.0.0.0", "127.0.0.1")
    for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": TOKEN}):
        status, head, body = _post(local, headers)
        assert status == 401, (headers, status, body)
        assert head.get("www-authenticate", head.get("WWW-Authenticate", "")).startswith("Bearer")
        assert b"bearer token" in body
    status, _, body = _post(local, {"Authorization": f"Bearer {TOKEN}"})
    assert status != 401 and b"bearer token" not in body  # past the door: the MCP layer answers
    got: dict[str, Any] = {}

    async def main() -> None:
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            transport = streamable_http_client(local, http_client=http)
            async with Client(transport, read_timeout_seconds=120) as c:
                got["tools"] = {tool.name for tool in (await c.list_tools()).tools}
                got["query"] = await c.call_tool(
                    "query", {"pid": t.pid, "sql": "SELECT pid FROM process.info"}
                )

    anyio.run(main)
    assert got["tools"] == TOOLS
    assert ok(got["query"])["rows"] == [{"pid": t.pid}]


def test_http_on_the_loopback_without_a_token(spawn, http_server) -> None:  # type: ignore[no-untyped-def]
    t = spawn(IDLE_LOOP, env={"PROBING_CLUSTER": "off"})
    _, url = http_server(token=None)
    assert url.startswith("http://127.0.0.1:") and url.endswith("/mcp")
    # no token on the loopback; a web page rebound to 127.0.0.1 is still refused
    port = url.split(":")[2].split("/")[0]
    assert _post(url, {"Host": f"attacker.example:{port}"})[0] == 421
    assert _post(url, {"Origin": "http://attacker.example"})[0] == 403
    got: dict[str, Any] = {}

    async def main() -> None:
        async with Client(url, read_timeout_seconds=120) as c:
            got["stack"] = await c.call_tool("stack", {"pid": t.pid})

    anyio.run(main)
    assert {"loader-0", "loader-1"} <= {th["name"] for th in ok(got["stack"])["threads"]}


# -- the pieces, in-process -----------------------------------------------------------


def test_every_table_a_probe_answers_has_its_reference() -> None:
    """The reference the server gives is docs/sql.md parsed: every table of a
    probe's catalog finds its section, with the page's words for its columns."""
    from probing.cli.mcp import reference
    from probing.node import assemble
    from probing.node.sql import Database
    from probing.node.store import Store

    ref = reference.load()
    assert ref.source == REPO / "docs" / "sql.md"
    database = Database(Store())
    assemble.install_tables(database)
    names = [
        f"{schema}.{table}"
        for schema in database.catalog.schema_names()
        for table in database.schema(schema).table_names
    ]
    assert len(names) > 20
    missing = [n for n in names if ref.find(n) is None]
    assert not missing, missing
    # a section shared by several tables: each keeps its own row's columns
    nccl, cuda = ref.tables["nccl.calls"].columns, ref.tables["cuda.calls"].columns
    assert nccl["bytes"] == "count × element size" and "kernel" not in nccl
    assert "kernel" in cuda and "redop" not in cuda
    assert ref.tables["nccl.calls"].columns["event_id"] == "per table, in drain order"
    assert ref.find("python.steps") is ref.tables["python.<name>"]  # an ExternalTable
    assert ref.find("python.`time.time()`") is ref.tables["python.`expr`"]


def test_a_wheel_carries_the_reference_where_the_server_reads_it(tmp_path: Path) -> None:
    import tomllib

    from probing.cli.mcp import reference
    from probing.errors import ProbingError

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    extra = config["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    assert REPO / extra["docs/sql.md"] == reference.PLACES[0]  # the wheel's copy, looked at first
    with pytest.raises(ProbingError, match=r"\(docs/sql.md\) is not installed") as err:
        reference.load(tmp_path / "sql.md")
    assert "information_schema.columns" in str(err.value)


def test_a_trace_is_written_only_under_the_out_dir(tmp_path: Path) -> None:
    from probing.cli.mcp.tools import inside
    from probing.errors import ProbingError

    out = (tmp_path / "out").resolve()
    out.mkdir()
    (out / "link").symlink_to(tmp_path)  # a link out of it
    assert inside(out, "a.pftrace") == out / "a.pftrace"
    assert inside(out, "runs/b.pftrace") == out / "runs" / "b.pftrace"
    assert inside(out, str(out / "c.pftrace")) == out / "c.pftrace"
    for name in ("../a.pftrace", "/etc/passwd", "link/a.pftrace", ".", "runs/../../a"):
        with pytest.raises(ProbingError, match=f"only under {out}"):
            inside(out, name)


# -- the verdict and the findings, one story (canned answers, no probe) -------------------


def _finding(rank: int, text: str, seen_ns: int) -> dict[str, Any]:
    return {"ts": seen_ns - 10**9, "kind": "straggler", "rank": rank, "node": "host1",
            "comm": "gloo/pg0", "text": text, "since": None, "since_ns": None,
            "cleared_ns": None, "seen_ns": seen_ns}  # fmt: skip


class _Probe:
    """A local probe's client, as ``tools.job_findings`` uses it."""

    def __init__(self, rank: int, rows: list[dict[str, Any]]) -> None:
        self.rank, self.rows = rank, rows

    def query(self, sql: str) -> Any:
        import pyarrow as pa

        from probing.analyze.findings import findings_schema

        if "python.`" in sql:  # its rank, as the process tells it
            return pa.table({"value": [self.rank]})
        return pa.Table.from_pylist(self.rows, schema=findings_schema())


def test_findings_of_local_ranks_keep_the_rank_each_blames(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Asked rank by rank on this machine, as over the cluster: ``rank`` is
    the rank a finding blames (2), the probe that kept it ``probe_rank`` (0)."""
    from probing.cli.mcp import tools

    probes = {
        2**22 + 10: _Probe(0, [_finding(2, "rank 2 is late", 5 * 10**18)]),
        2**22 + 11: _Probe(1, []),
    }
    monkeypatch.setattr(tools, "client", lambda pid: probes[pid])
    table = tools.job_findings(None, "local", list(probes))  # type: ignore[arg-type]
    assert [(r["rank"], r["probe_rank"]) for r in table.to_pylist()] == [(2, 0)]


def test_diagnose_says_what_active_findings_say_and_it_does_not(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A diagnosis that names no straggler (its window healthy: the trace
    stopped, another window) while the job's detector holds an active one:
    the answer carries the findings, and says which it does not confirm and
    when each was last found; one that names the same rank says nothing more."""
    import pyarrow as pa

    from probing.analyze import analyze
    from probing.cli import asking
    from probing.cli.mcp import tools
    from tests.test_analyze import job

    active = [_finding(2, "rank 2 on node host1 is 60 ms late each 90 ms step", 1763880000 * 10**9)]

    class Job:
        def ask(self, sql: str) -> pa.Table:
            assert sql == tools.ACTIVE_SQL, sql
            return pa.Table.from_pylist(active)

    monkeypatch.setattr(tools, "job_of", lambda pid, timeout: (Job(), "cluster", [pid]))
    for table, confirmed in ((job(seed=2), False), (job(straggler=2, lag_ms=60, seed=1), True)):
        d = analyze(table, now_ns=max(table.column("ts").to_pylist()) + 10**9)
        monkeypatch.setattr(asking, "diagnose", lambda job, d=d, t=table, **kw: (d, t))
        answer, text = tools.diagnose(4242, 60.0, 10.0, None, 5.0)
        assert [(f["kind"], f["rank"]) for f in answer.findings] == [("straggler", 2)]
        if confirmed:
            assert answer.unconfirmed is None and "does not confirm" not in text
            continue
        assert answer.unconfirmed and active[0]["text"] in answer.unconfirmed
        assert "last found at 06:40:00 UTC" in answer.unconfirmed, answer.unconfirmed
        assert answer.unconfirmed in text and answer.verdict == d.verdict
