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
from tests.conftest import SLOWDOWN, require_bpf
from tests.test_cluster import TOKEN, wait_ready
from tests.test_mcp import ok, over_stdio

pytestmark = pytest.mark.privileged

WORLD = 4


@pytest.fixture
def slow_job(runtime_dir: Path) -> Iterator[tuple[DemoJob, int]]:
    """A 4-rank DDP job started with its probes, one rank's data loader
    40 ms slower (drawn at random, printed); every probe in the cluster."""
    require_bpf()
    rank = random.randrange(WORLD)
    print(f"straggler: rank {rank}")
    job = DemoJob(
        WORLD,
        job_args=("--slow-rank", str(rank), "--slow-ms", f"{40 * SLOWDOWN:g}"),
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
    # over the cluster a finding's own rank is table_rank (rank: the probe that answered)
    assert stragglers and {r["table_rank"] for r in stragglers} == {rank}, findings["rows"]
    assert findings["scope"] == "cluster"

    exported = ok(got["export"])
    assert exported["path"].startswith(str(out.resolve())) and exported["bytes"] > 1000
    assert f"from {WORLD} rank(s)" in exported["summary"] and " 0 events" not in exported["summary"]

    assert all(r["ok"] for r in ok(got["stop"])["ranks"])
    assert set(got["stopped"].values()) == {"stopped"}, got["stopped"]
    audit = (out / "audit.jsonl").read_text()
    assert '"tool": "trace_start"' in audit and '"tool": "trace_stop"' in audit
