"""``probing diagnose --cluster`` on a 4-rank Gloo job that was never traced:
started with ``PROBING=1`` and PyTorch's Flight Recorder on
(``TORCH_FR_BUFFER_SIZE``), rank 2 stops for good in its data loader and
never enters the next gradient all-reduce. The recorder alone names it,
with the sequence number; with the recorder off the verdict says so."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from probing.cli.demo import DemoJob
from tests.conftest import SLOWDOWN, cli

pytestmark = pytest.mark.privileged

WORLD, STUCK = 4, 2
HANG_AFTER_S = 2.0


@pytest.fixture
def job() -> Iterator:
    started: list[DemoJob] = []

    def start(fr_size: str) -> DemoJob:
        env = {"PROBING": "1", "TORCH_FR_BUFFER_SIZE": fr_size}
        j = DemoJob(WORLD, job_args=("--hang-rank", str(STUCK), "--hang-step", "5"), env=env)
        started.append(j)
        j.wait_ready(timeout=120 * SLOWDOWN)
        return j

    yield start
    for j in started:
        j.stop()


def _query(pid: int, sql: str) -> list[dict]:  # type: ignore[type-arg]
    r = cli("query", "--pid", str(pid), "--cluster", "--format", "json", sql, timeout=120)
    assert r.returncode == 0, r.stderr
    rows: list[dict] = json.loads(r.stdout)  # type: ignore[type-arg]
    return rows


def _until_every_rank_answers(pid: int) -> None:
    sql = "SELECT rank, state FROM comm.flight_status ORDER BY rank"
    deadline = time.monotonic() + 60 * SLOWDOWN
    while [r["rank"] for r in _query(pid, sql)] != list(range(WORLD)):
        assert time.monotonic() < deadline, "not every rank joined the cluster"
        time.sleep(0.5)


def _diagnose(pid: int) -> dict:  # type: ignore[type-arg]
    r = cli(
        "diagnose", "--pid", str(pid), "--cluster", "--hang-after", f"{HANG_AFTER_S:g}s",
        "--format", "json", timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out: dict = json.loads(r.stdout)  # type: ignore[type-arg]
    print(out["verdict"])
    return out


def test_an_untraced_hang_is_named_by_the_flight_recorder(job) -> None:  # type: ignore[no-untyped-def]
    j = job("2000")
    pid = j.pids[0]
    _until_every_rank_answers(pid)
    time.sleep((HANG_AFTER_S + 1) * SLOWDOWN)  # the others wait longer than --hang-after
    status = _query(pid, "SELECT rank, state, buffer_size FROM comm.flight_status ORDER BY rank")
    assert status == [{"rank": r, "state": "on", "buffer_size": 2000} for r in range(WORLD)]
    # where each rank stands in the world group, by SQL: rank 2 behind (one
    # all-reduce a DDP bucket: the others entered each of the step's buckets)
    last = _query(
        pid, "SELECT rank, max(seq) AS seq FROM comm.flight WHERE NOT is_p2p AND pg = '0' "
        "GROUP BY rank ORDER BY rank",
    )  # fmt: skip
    seqs = {r["rank"]: r["seq"] for r in last}
    ahead, behind = seqs[0], seqs[STUCK]
    assert seqs == {0: ahead, 1: ahead, 2: behind, 3: ahead} and behind < ahead, seqs
    first = behind + 1  # the first all-reduce rank 2 never entered

    out = _diagnose(pid)
    assert not out["healthy"]
    [h] = out["hangs"]
    assert h["evidence"] == "flight recorder"
    assert (h["seq"], h["op"], h["missing_ranks"]) == (first, "all_reduce", [STUCK])
    assert h["waiting_ranks"] == [0, 1, 3] and h["age_s"] >= HANG_AFTER_S
    assert out["verdict"].startswith(
        f"hang: ranks 0, 1, 3 wait in all_reduce #{first} of process group 0 for "
    )
    assert (
        f"; rank {STUCK} never entered it (Flight Recorder: all_reduce #{first} of "
        in (out["verdict"])
    )
    assert f"rank {STUCK}'s last: all_reduce #{behind})" in out["verdict"]
    assert out["flight"] == ""
    # the stuck rank's own stack, from the same cluster query: its data loader
    assert any(line.startswith("load_batch ") for line in h["stacks"][str(STUCK)])


def test_with_the_recorder_off_the_verdict_says_so(job) -> None:  # type: ignore[no-untyped-def]
    j = job("0")
    pid = j.pids[0]
    _until_every_rank_answers(pid)
    time.sleep((HANG_AFTER_S + 1) * SLOWDOWN)
    assert _query(pid, "SELECT count(*) AS n FROM comm.flight") == [{"n": 0}]
    out = _diagnose(pid)
    said = (
        "Flight Recorder is off in ranks 0, 1, 2, 3: the job set TORCH_FR_BUFFER_SIZE=0; "
        "TORCH_FR_BUFFER_SIZE=2000 in the job's environment turns it on"
    )
    assert out["flight"] == said
    assert out["verdict"].endswith(f"; {said}")
    assert not any(h["evidence"] == "flight recorder" for h in out["hangs"])
