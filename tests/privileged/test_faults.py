"""Faults in a traced 4-rank job (issue 20): a rank killed, a rank stopped,
a probe whose store budget is full. Root-only (BPF)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from probing.cli.demo import trace_all
from tests.conftest import cli, require_bpf
from tests.jobs.launch import GROUP_BY_RANK, WORLD
from tests.jobs.launch import uprobe_pids as _uprobe_pids

pytestmark = pytest.mark.privileged


def _cluster_query(pid: int, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "probing", "query", "--pid", str(pid), "--cluster", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_rank_killed_during_a_cluster_query(launch) -> None:  # type: ignore[no-untyped-def]
    """kill -9 of a traced rank while a cluster query runs: the query
    answers with the others' rows (the dead process has no threads), the
    kernel holds no uprobes for it, and its probe, kept by the engine,
    answers the next query marked dead.

    The ranks have left their process group when the rank dies: a Gloo peer
    that resets a connection aborts the others from Gloo's own thread
    (``gloo::IoException``, std::terminate), which no probe can prevent."""
    require_bpf()
    job = launch("env", "--steps", "40", "--linger")
    job.wait_steps(1)
    ranks = job.ranks()
    errors = trace_all(list(ranks.values()), ["gloo"])
    assert not errors, errors
    _wait(lambda: job.out.read_text().count(" done") == WORLD, 120, "the ranks never finished")
    victim = ranks[3]
    _wait(lambda: victim in _uprobe_pids(), 10, "the victim never held uprobes")
    q = _cluster_query(ranks[0], "--timeout", "8", GROUP_BY_RANK, "--format", "json")
    os.kill(victim, signal.SIGKILL)  # while the query starts or runs
    out, err = q.communicate(timeout=60)
    assert q.returncode == 0, err + job.tail()
    # the others' rows; rank 3's where its probe answered as it died (the engine keeps it)
    assert {0, 1, 2} <= {r["rank"] for r in json.loads(out)}, out
    _wait(lambda: victim not in _uprobe_pids(), 10, "uprobes left behind by the killed rank")
    alive = "SELECT rank, alive FROM process.info ORDER BY rank"
    again = cli("query", "--pid", str(ranks[0]), "--cluster", "--timeout", "3", alive,
                "--format", "json")  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert [(r["rank"], r["alive"]) for r in json.loads(again.stdout)] == [
        (0, True), (1, True), (2, True), (3, False)
    ], again.stdout  # fmt: skip
    for r in (0, 1, 2):  # the survivors' probes still answer on their own
        assert cli("query", "--pid", str(ranks[r]), "SELECT 1 AS one").returncode == 0


def test_a_stopped_rank_gives_a_partial_answer_in_time(launch) -> None:  # type: ignore[no-untyped-def]
    """A rank stopped (SIGSTOP) holds up nothing: its guest is never waited
    for; the node's engine answers for it with what it keeps (its /proc, its
    tables), in time, and so do the others."""
    require_bpf()
    job = launch("env")
    job.wait_steps(1)
    ranks = job.ranks()
    errors = trace_all(list(ranks.values()), ["gloo"])
    assert not errors, errors
    os.kill(ranks[1], signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = cli("query", "--pid", str(ranks[0]), "--cluster", "--timeout", "3", GROUP_BY_RANK)
        took = time.monotonic() - t0
        own = cli("query", "--pid", str(ranks[1]), "SELECT name FROM process.threads")
    finally:
        os.kill(ranks[1], signal.SIGCONT)
    assert r.returncode == 0, r.stderr
    assert took < 15, took  # the timeout, plus the CLI's start; generous
    rows = [line.split() for line in r.stdout.splitlines()]
    assert {row[0] for row in rows if row and row[0].isdigit()} == {"0", "1", "2", "3"}, r.stdout
    assert own.returncode == 0, own.stderr  # its own query too, from what the engine keeps


def test_a_full_store_retires_old_rows_and_keeps_answering(launch) -> None:  # type: ignore[no-untyped-def]
    """A traced rank whose store budget (``PROBING_STORE_BYTES``) is tiny."""
    require_bpf()
    job = launch("env", "--work-ms", "1", env={"PROBING_STORE_BYTES": "16384"})
    job.wait_steps(1)
    ranks = job.ranks()
    errors = trace_all(list(ranks.values()), ["gloo"])
    assert not errors, errors
    sql = (
        "SELECT retired_rows, rows FROM probing.tables "
        "WHERE \"schema\" = 'python' AND \"table\" = 'stacks' OR \"schema\" = 'gloo'"
    )

    def retired() -> bool:
        r = cli("query", "--pid", str(ranks[0]), sql, "--format", "json")
        assert r.returncode == 0, r.stderr
        return any(row["retired_rows"] > 0 for row in json.loads(r.stdout))

    _wait(retired, 120, "nothing was ever retired")

    def collectives() -> int:
        r = cli("query", "--pid", str(ranks[0]), "SELECT count(*) AS n FROM comm.collectives",
                "--format", "json")  # fmt: skip
        assert r.returncode == 0, r.stderr
        return int(json.loads(r.stdout)[0]["n"])

    # and it keeps answering, with the rows it still holds: at 16 KB a chunk is
    # retired as soon as it is sealed, so for a moment that can be none at all
    for _ in range(3):
        _wait(lambda: collectives() > 0, 60, "no collective was ever held again")
    assert job.procs[0].poll() is None, job.tail()
