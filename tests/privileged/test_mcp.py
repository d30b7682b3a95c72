"""``probing mcp`` on a real 4-rank Gloo job (``PROBING=1``, one slow rank),
driven by the MCP SDK's client over stdio as an agent would: ``diagnose``
records the untraced job and names the straggler, stopping only the ranks it
started; ``trace_start`` over the cluster, ``findings`` from the job's
always-on detector, ``export_timeline``, ``trace_stop``. Root-only (BPF)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client

from probing.cli.client import ProbeClient
from probing.cli.demo import DemoJob
from tests import test_mcp
from tests.conftest import SLOWDOWN, require_bpf
from tests.test_cluster import TOKEN, wait_ready
from tests.test_mcp import ok, over_stdio

pytestmark = pytest.mark.privileged
http_server_fixture = test_mcp.http_server  # the fixture http_server, here too

WORLD = 4


@pytest.fixture
def slow_job(runtime_dir: Path) -> Iterator[tuple[DemoJob, int]]:
    """A 4-rank DDP job started with its probes, one rank's data loader
    60 ms slower (drawn at random, printed); every probe in the cluster."""
    require_bpf()
    rank = random.randrange(WORLD)
    print(f"straggler: rank {rank}")
    job = DemoJob(
        WORLD,
        job_args=("--slow-rank", str(rank), "--slow-ms", f"{60 * SLOWDOWN:g}"),
        env={"PROBING": "1", "PROBING_TOKEN": TOKEN},
    )
    try:
        job.wait_ready(timeout=120 * SLOWDOWN)
        for pid in job.pids:
            wait_ready(pid, 60 * SLOWDOWN)
        yield job, rank
    finally:
        job.stop()


def _state(pid: int) -> str:
    return str(ProbeClient.for_pid(pid).trace_status().get("state"))


def test_an_agent_names_the_straggler_of_a_real_job(tmp_path: Path, slow_job) -> None:  # type: ignore[no-untyped-def]
    job, rank = slow_job
    pids = job.pids
    out = tmp_path / "out"
    # someone traces rank 2 already: the recording leaves that trace as it was
    assert ProbeClient.for_pid(pids[2]).trace_start(["gloo"])["state"] == "tracing"
    got: dict[str, Any] = {}
    peers_s = 5 * SLOWDOWN

    async def go(c: Client) -> None:
        got["diagnose"] = await c.call_tool(
            "diagnose", {"pid": pids[-1], "record": f"{4 * SLOWDOWN:g}s", "timeout": peers_s}
        )
        got["after"] = {pid: _state(pid) for pid in pids}
        got["start"] = await c.call_tool(
            "trace_start", {"pid": pids[0], "cluster": True, "families": ["gloo"]}
        )
        deadline = time.monotonic() + 90 * SLOWDOWN  # the detector runs every 5 s
        while True:
            found = await c.call_tool("findings", {"pid": pids[1], "timeout": peers_s})
            rows = ok(found)["rows"]
            if any(r["kind"] == "straggler" for r in rows) or time.monotonic() > deadline:
                got["findings"] = found
                break
            await anyio.sleep(1)
        got["export"] = await c.call_tool(
            "export_timeline", {"pid": pids[0], "window": "10s", "timeout": peers_s}
        )
        got["stop"] = await c.call_tool("trace_stop", {"pid": pids[0], "cluster": True})
        got["stopped"] = {pid: _state(pid) for pid in pids}

    over_stdio(tmp_path, go, "--allow-control", "--out-dir", str(out))
    verdict = ok(got["diagnose"])
    said = verdict["verdict"]
    assert verdict["scope"] == "cluster" and verdict["recorded_s"] == 4 * SLOWDOWN, said
    assert [s["rank"] for s in verdict["diagnosis"]["stragglers"]] == [rank], said
    assert said.startswith(f"rank {rank} on node "), said
    assert sorted(r["rank"] for r in verdict["diagnosis"]["ranks"]) == list(range(WORLD))
    # the recording stopped the ranks it started, not rank 2's own trace
    assert got["after"][pids[2]] == "tracing", got["after"]
    assert [got["after"][p] for p in pids if p != pids[2]] == ["stopped"] * (WORLD - 1), got[
        "after"
    ]

    ranks = ok(got["start"])["ranks"]
    assert sorted(r["rank"] for r in ranks) == list(range(WORLD)) and all(r["ok"] for r in ranks)
    findings = ok(got["findings"])
    stragglers = [r for r in findings["rows"] if r["kind"] == "straggler"]
    # over the cluster a finding's rank is the rank it blames (probe_rank: the detector's);
    # one problem, one finding, in the verdict's words
    assert [r["rank"] for r in stragglers] == [rank], findings["rows"]
    assert {r["probe_rank"] for r in stragglers} == {0} and "table_rank" not in findings["columns"]
    assert f"rank {rank} on node " in stragglers[0]["text"] and " ms step " in stragglers[0]["text"]
    assert findings["scope"] == "cluster"

    exported = ok(got["export"])
    assert exported["path"].startswith(str(out.resolve())) and exported["bytes"] > 1000
    assert f"from {WORLD} rank(s)" in exported["summary"] and " 0 events" not in exported["summary"]

    assert all(r["ok"] for r in ok(got["stop"])["ranks"])
    assert set(got["stopped"].values()) == {"stopped"}, got["stopped"]
    audit = (out / "audit.jsonl").read_text()
    assert '"tool": "trace_start"' in audit and '"tool": "trace_stop"' in audit


def _read_only_session(c: Client, pids: list[int], got: dict[str, Any]) -> Any:
    """What an agent without --allow-control does on the job: list the tools,
    diagnose (recording 4 s), a cluster query, a refused trace_start, and the
    clean errors of bad SQL, a dead pid and a result over the cap, each
    followed by a call that works."""

    async def go() -> None:
        got["tools"] = {t.name for t in (await c.list_tools()).tools}
        got["diagnose"] = await c.call_tool(
            "diagnose", {"pid": pids[-1], "record": f"{4 * SLOWDOWN:g}s", "timeout": 5 * SLOWDOWN}
        )
        sql = "SELECT rank, count(*) AS n FROM process.threads GROUP BY rank"
        got["query"] = await c.call_tool("query", {"pid": pids[0], "sql": sql, "cluster": True})
        got["start"] = await c.call_tool("trace_start", {"pid": pids[0], "cluster": True})
        got["bad_sql"] = await c.call_tool("query", {"pid": pids[0], "sql": "SELEC 1"})
        got["dead_pid"] = await c.call_tool("query", {"pid": 999999999, "sql": "SELECT 1"})
        got["capped"] = await c.call_tool(
            "query", {"pid": pids[0], "sql": "SELECT * FROM process.threads", "max_rows": 1}
        )
        got["after"] = await c.call_tool(
            "query", {"pid": pids[1], "sql": "SELECT pid FROM process.info"}
        )

    return go


def _check_read_only(got: dict[str, Any], pids: list[int], rank: int) -> None:
    from tests.test_mcp import TOOLS, failed

    assert got["tools"] == TOOLS
    verdict = ok(got["diagnose"])
    assert [s["rank"] for s in verdict["diagnosis"]["stragglers"]] == [rank], verdict["verdict"]
    assert sorted(r["rank"] for r in ok(got["query"])["rows"]) == list(range(WORLD))
    assert "--allow-control" in failed(got["start"])
    assert "SELEC" in failed(got["bad_sql"]) or "syntax" in failed(got["bad_sql"]).lower()
    assert "probing ps" in failed(got["dead_pid"]) or "no process" in failed(got["dead_pid"])
    capped = ok(got["capped"])
    assert len(capped["rows"]) == 1 and capped["truncated_by"] == "max_rows", capped
    assert ok(got["after"])["rows"] == [{"pid": pids[1]}]


def test_a_read_only_agent_over_stdio_and_http(tmp_path, slow_job, http_server_fixture) -> None:  # type: ignore[no-untyped-def]
    """Issue 41's session twice: over stdio, and over streamable HTTP with its
    token (refused without it)."""
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    from tests.test_mcp import _post

    job, rank = slow_job
    pids = job.pids
    got: dict[str, Any] = {}

    async def go(c: Client) -> None:
        await _read_only_session(c, pids, got)()

    over_stdio(tmp_path, go)
    _check_read_only(got, pids, rank)

    _, url = http_server_fixture("--host", "0.0.0.0", token=TOKEN)
    local = url.replace("0.0.0.0", "127.0.0.1")
    assert _post(local, {})[0] == 401  # no token: refused at the door
    over_http: dict[str, Any] = {}

    async def main() -> None:
        async with httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {TOKEN}"}, timeout=180 * SLOWDOWN
        ) as http:
            transport = streamable_http_client(local, http_client=http)
            async with Client(transport, read_timeout_seconds=180) as c:
                await _read_only_session(c, pids, over_http)()

    anyio.run(main)
    _check_read_only(over_http, pids, rank)
