"""``probing.procs.job_pids``: the ranks on this machine of a process's job,
from the variables their launcher gave them and their process tree, as
``inject --job`` and ``trace --job`` find them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from probing.procs import job_pids

# a launcher: starts N ranks with MASTER_* and RANK (as torchrun does), each of
# which forks a DataLoader-like worker; it prints the ranks' pids, then waits
LAUNCHER = """
import os, subprocess, sys, time
rank = '''
import os, sys, time
if os.fork() == 0:  # a worker process of the rank: same variables, not a rank
    time.sleep(600)
print(os.getpid(), flush=True)
time.sleep(600)
'''
kids = []
for r in range(int(sys.argv[1])):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK=str(r))
    kids.append(subprocess.Popen([sys.executable, "-c", rank], env=env, stdout=subprocess.PIPE,
                                 text=True))
print(" ".join(k.stdout.readline().strip() for k in kids), flush=True)
time.sleep(600)
"""

# Lightning's way: rank 0 is the script the user ran; it sets MASTER_PORT in its
# own os.environ and runs itself again for ranks 1.. with those variables
SELF_LAUNCH = """
import os, subprocess, sys, time
if "LOCAL_RANK" not in os.environ:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    kids = [subprocess.Popen([sys.executable, "-c", sys.argv[2], *sys.argv[1:]],
                             env=dict(os.environ, LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                             text=True) for r in (1, 2)]
    print(os.getpid(), *(k.stdout.readline().strip() for k in kids), flush=True)
else:
    print(os.getpid(), flush=True)
time.sleep(600)
"""


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        tree = [p.pid]
        try:
            tree += [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
        for pid in tree:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        p.wait(timeout=10)


def _launch(started: list[subprocess.Popen[str]], argv: list[str]) -> list[int]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    started.append(p)
    line = p.stdout.readline()  # type: ignore[union-attr]
    assert line, "the launcher printed nothing"
    return [int(x) for x in line.split()]


def _workers_up(ranks: list[int]) -> None:
    deadline = time.monotonic() + 10
    while not all(psutil.Process(r).children() for r in ranks):
        assert time.monotonic() < deadline, "the ranks' workers never started"
        time.sleep(0.05)


def test_the_ranks_of_a_launched_job_and_not_their_workers_nor_another_job(started) -> None:  # type: ignore[no-untyped-def]
    ranks = _launch(started, [sys.executable, "-c", LAUNCHER, "3", "29501"])
    other = _launch(started, [sys.executable, "-c", LAUNCHER, "2", "29502"])
    _workers_up(ranks + other)
    for r in ranks:
        assert job_pids(r) == sorted(ranks)
    assert job_pids(started[0].pid) == sorted(ranks)  # the launcher: its ranks, not itself
    assert job_pids(other[1]) == sorted(other)


def test_a_rank_zero_that_started_the_others_itself(started) -> None:  # type: ignore[no-untyped-def]
    pids = _launch(started, [sys.executable, "-c", SELF_LAUNCH, "29503", SELF_LAUNCH])
    for p in pids:
        assert job_pids(p) == sorted(pids)


def test_a_process_of_no_job_is_alone(tmp_path: Path, started) -> None:  # type: ignore[no-untyped-def]
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], text=True)
    started.append(p)
    assert job_pids(p.pid) == [p.pid]


def test_a_rank_whose_process_is_gone_from_its_node_is_said_exited(started) -> None:  # type: ignore[no-untyped-def]
    """4 ranks started with ``LOCAL_WORLD_SIZE`` 4 (torchrun's variables); rank 1
    killed: it is the one exited, whichever rank is asked. Without the local
    variables (ranks set in code), nothing is claimed."""
    from probing.procs import exited_ranks

    code = "import time; print(flush=True); time.sleep(600)"
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env = dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT="29504", LOCAL_WORLD_SIZE="4")
    for r in range(4):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))  # fmt: skip
        started.append(p)
        assert p.stdout is not None and p.stdout.readline() == "\n"
    assert [exited_ranks(p.pid) for p in started] == [[]] * 4
    started[1].kill()
    started[1].wait()
    assert exited_ranks(started[0].pid) == [1] and exited_ranks(started[3].pid) == [1]
    alone = dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT="29505")
    plain = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env=alone)  # fmt: skip
    started.append(plain)
    assert plain.stdout is not None and plain.stdout.readline() == "\n"
    assert exited_ranks(plain.pid) == []
