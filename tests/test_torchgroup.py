"""A training process recognised by what it is: the agent's policy attaches
a process that has formed a torch process group (its backend's threads,
``probing.node.torchgroup``), whatever started it; never one that only
imported torch, a launcher, or one with ``PROBING=0``. On fake ``/proc``
trees, and on real processes whose threads are named so."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from probing import proc
from probing.node import agent as node_agent
from probing.node import torchgroup
from probing.node.agent import Agent, Policy, SeenProcess

# thread names read on running jobs here (torch 2.13, CPU): a Gloo rank of
# mp.spawn and of Lightning's own launcher; rank 0 serves the store besides
GLOO_RANK = ["python", "python", "pt_gloo_runloop", "pt_gloo_runloop", "gloo_tcp_loop"]
GLOO_RANK0 = [*GLOO_RANK, "pt_tcpstore_uv"]
MP_SPAWN_PARENT = ["python", "python"]
# torchrun's elastic agent: it serves the job's store, forms no group
TORCHRUN_AGENT = ["torchrun", "pt_elastic", "pt_tcpstore_uv", "torchrun"]
NCCL_RANK = ["python", "pt_autograd_0", "pt_nccl_watchdg", "pt_nccl_heartbt", "cuda-EvtHandlr"]


def fake_proc(root: Path, pid: int, threads: list[str]) -> None:
    for i, name in enumerate(threads):
        task = root / str(pid) / "task" / str(pid + i)
        task.mkdir(parents=True)
        (task / "comm").write_text(name + "\n")


@pytest.fixture
def fake_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(proc, "ROOT", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    ("threads", "shown"),
    [
        (GLOO_RANK, "pt_gloo_runloop"),
        (GLOO_RANK0, "pt_gloo_runloop"),
        (NCCL_RANK, "pt_nccl_watchdg"),
        (["python", "pt_xccl_heartbt"], "pt_xccl_heartbt"),  # Intel's backend
        (["python", "pt_nccl2_heartb"], "pt_nccl2_heartb"),  # 15 characters kept
        (["python", "gloo_tcp_loop"], "gloo_tcp_loop"),
        (MP_SPAWN_PARENT, ""),
        (TORCHRUN_AGENT, ""),
        (["python", "pt_tcpstore"], ""),  # a store, no group
        (["python", "pt_thread_pool", "pt_autograd_0"], ""),  # torch, no group
        (["python", "my_gloo_loop", "pt_gloo"], ""),
    ],
)
def test_a_group_shows_by_its_backends_threads_and_nothing_else_does(
    threads: list[str], shown: str
) -> None:
    assert torchgroup.group_thread(threads) == shown


def test_a_process_under_proc_that_formed_a_group_says_by_which_thread(fake_root: Path) -> None:
    fake_proc(fake_root, 100, GLOO_RANK)
    fake_proc(fake_root, 200, MP_SPAWN_PARENT)
    assert torchgroup.formed(100) == "torch process group (thread pt_gloo_runloop)"
    assert torchgroup.formed(200) == ""
    assert torchgroup.formed(300) == ""  # gone: nothing shows


def test_the_threads_are_read_until_the_first_that_shows_a_group(fake_root: Path) -> None:
    fake_proc(fake_root, 100, ["python", "pt_gloo_runloop", "python"])
    (fake_root / "100" / "task" / "102" / "comm").unlink()  # a thread that ended meanwhile
    names = torchgroup.thread_names(100)
    assert next(names) == "python"
    assert next(names) == "pt_gloo_runloop"
    assert list(names) == []
    assert torchgroup.formed(100)


RANK_ENV = {"MASTER_PORT": "29500", "RANK": "1"}
PYTHON = ["python", "train.py"]


def asked(answer: str) -> tuple[list[int], Callable[[], str]]:
    calls: list[int] = []

    def formed() -> str:
        calls.append(1)
        return answer

    return calls, formed


def test_the_policy_takes_a_process_with_a_group_that_no_launcher_named() -> None:
    group = "torch process group (thread pt_gloo_runloop)"
    _, formed = asked(group)
    assert Policy().why({"HOME": "/root"}, PYTHON, "", formed) == group
    assert Policy().why({"HOME": "/root"}, PYTHON, "") == ""  # nothing formed
    assert Policy(groups=False).why({}, PYTHON, "", formed) == ""


def test_the_policy_never_takes_an_opted_out_process_or_a_launcher_whatever_its_threads() -> None:
    calls, formed = asked("torch process group (thread pt_gloo_runloop)")
    for value in ("0", "off", "false"):
        assert Policy().why({"PROBING": value}, PYTHON, "", formed) == ""
    torchrun = ["/venv/bin/python", "/venv/bin/torchrun", "--nproc-per-node", "4", "t.py"]
    assert Policy().why({}, torchrun, "", formed) == ""
    required = Policy(require=(("TEAM", "a"),))
    assert required.why({"TEAM": "b"}, PYTHON, "", formed) == ""
    assert required.why({"TEAM": "a"}, PYTHON, "", formed)
    assert len(calls) == 1  # asked of the last only: the others were refused first


def test_a_launchers_variables_still_name_why_and_its_threads_are_not_read() -> None:
    calls, formed = asked("torch process group (thread pt_gloo_runloop)")
    assert Policy().why(RANK_ENV, PYTHON, "", formed) == "MASTER_PORT and RANK"
    assert Policy().why({"SLURM_PROCID": "3"}, PYTHON, "", formed) == "SLURM_PROCID"
    assert calls == []


@pytest.mark.parametrize(
    ("cluster", "job"),
    [
        ({"store": "127.0.0.1:41234", "rank": 2}, "rendezvous=127.0.0.1:41234"),
        ({"store": "fe80::1:29500"}, "rendezvous=fe80::1:29500"),
        ({"store": None, "rank": -1}, None),  # still learning it
        (None, None),  # no cluster node
    ],
)
def test_a_job_no_launcher_named_is_named_by_its_groups_store(
    cluster: dict[str, object] | None, job: str | None
) -> None:
    assert node_agent._rendezvous_job(cluster) == job


# a process that gives a thread of its own each name it reads on stdin, as a
# Gloo group's are named (a thread may write its own comm), then says "named"
NAMED = """
import sys, threading
def loop(name, named):
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(name)
    named.set()
    threading.Event().wait()
print("up", flush=True)
for line in sys.stdin:
    named = threading.Event()
    threading.Thread(target=loop, args=(line.strip(), named), daemon=True).start()
    named.wait()
    print("named", flush=True)
"""


def named(p: subprocess.Popen[str], thread: str) -> None:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(thread + "\n")
    p.stdin.flush()
    assert p.stdout.readline() == "named\n"


def test_a_scan_attaches_the_processes_that_formed_a_group_once_they_have(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real scans of the node (``_attach`` stood in for: no root here): of
    this test's processes, the one whose thread shows a Gloo group is
    attached, as a group; one that only runs Python and one that opted out
    are not; one whose group comes later is at the first scan after."""
    mark = uuid.uuid4().hex
    attached: list[tuple[int, str]] = []

    def attach(self: Agent, pid: int, why: str, job: str, age: float) -> SeenProcess:
        attached.append((pid, why))
        return SeenProcess(pid, why, job, age, 0.0, "tracing")

    monkeypatch.setattr(Agent, "_attach", attach)
    env = {**os.environ, "PROBING_AGENT_TEST": mark}
    env.pop("PROBING", None)
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", NAMED],
            env={**env, **extra},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for name, extra in (
            ("group", {}),
            ("plain", {}),
            ("opted_out", {"PROBING": "0"}),
            ("later", {}),
        )  # fmt: skip
    }
    try:
        for p in procs.values():
            assert p.stdout is not None and p.stdout.readline() == "up\n"
        named(procs["group"], "pt_gloo_runloop")
        named(procs["opted_out"], "gloo_tcp_loop")
        named(procs["plain"], "pt_tcpstore_uv")  # a store: no group
        agent = Agent(Policy(require=(("PROBING_AGENT_TEST", mark),)))
        agent.scan()
        group, later = procs["group"].pid, procs["later"].pid
        assert attached == [(group, "torch process group (thread pt_gloo_runloop)")]
        assert agent.seen[group].job == "?"  # no launcher named it, no probe to ask yet
        named(procs["later"], "pt_nccl_watchdg")
        agent.scan()
        assert attached[1:] == [(later, "torch process group (thread pt_nccl_watchdg)")]
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=10)
    agent.scan()
    assert not agent.seen  # gone: forgotten
