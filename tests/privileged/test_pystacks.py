"""Python stacks on traced calls, and stacks read from outside, for real:
a torch Gloo job and NVIDIA's libcudart (through ctypes) under BPF uprobes,
and a process whose thread holds the GIL in a C call that never returns.
Root-only; PROBING_REQUIRE_PRIVILEGED=1 (CI) turns skips into failures."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from probing.cli.client import ProbeClient
from probing.cli.demo import free_port
from tests.conftest import SLOWDOWN, cli, require, require_bpf
from tests.privileged.helpers import MARK, installed_lib, line_after, wait_line

pytestmark = pytest.mark.privileged

# train_step issues an all_reduce (Gloo) and a cudaMalloc (ctypes, the
# wheel's libcudart), each marked: train_step at the line of the call.
TRAIN = (
    """
import ctypes, json, os, sys, threading, time, traceback
import torch, torch.distributed as dist

rank, port, go, cudart_path = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
blocked = len(sys.argv) > 5
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
cudart = ctypes.CDLL(cudart_path)
"""
    + MARK
    + """

def train_step(t):
    dist.all_reduce(mark("all_reduce", t))
    p = ctypes.c_void_p()
    cudart.cudaMalloc(mark("cudaMalloc", ctypes.byref(p)), ctypes.c_size_t(4096))


print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.02)
if rank == 1 and blocked:  # the peer comes late: rank 0 waits inside gloo
    while not os.path.exists(go + ".release"):
        time.sleep(0.02)
if rank == 0 and blocked:  # the collective on a thread; this one keeps the GIL busy
    th = threading.Thread(target=train_step, args=(torch.ones(100),), name="collective")
    th.start()
    time.sleep(0.5)
    print("marks " + json.dumps(marks), flush=True)
    n = 0
    while th.is_alive():
        n += 1
else:
    train_step(torch.ones(100))
    print("marks " + json.dumps(marks), flush=True)
print("done", flush=True)
time.sleep(600)
"""
)

FRAMES_SQL = """
SELECT s.stack_id, s.depth, s.file, s.line, s.func
FROM {table} c JOIN python.stacks s ON s.stack_id = c.stack_id
WHERE c.api = '{api}' ORDER BY s.depth
"""


def _job(spawn, tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    require_bpf()
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    port, go = free_port(), tmp_path / "go"
    ranks = [
        spawn(
            "",
            argv=[
                sys.executable,
                str(script),
                str(r),
                str(port),
                str(go),
                installed_lib("libcudart"),
                *extra,
            ],
        )  # fmt: skip
        for r in range(2)
    ]
    for t in ranks:
        wait_line(t, "ready")
    return script, go, ranks


def test_traced_calls_carry_the_stack_traceback_sees(spawn, tmp_path: Path) -> None:
    script, go, (r0, _) = _job(spawn, tmp_path)
    client = ProbeClient.for_pid(r0.pid, timeout=30 * SLOWDOWN)
    status = client.trace_start(["gloo", "cuda"])
    assert status["stacks"] is True
    go.touch()
    marks = json.loads(line_after(r0, "marks "))
    wait_line(r0, "done")
    for table, api, name in (
        ("gloo.calls", "gloo::allreduce", "all_reduce"),
        ("cuda.calls", "cudaMalloc", "cudaMalloc"),
    ):
        frames = client.query(FRAMES_SQL.format(table=table, api=api)).to_pylist()
        assert frames, f"{api} has no stack"
        want = marks[name]
        assert want[0] == str(script) and want[2] == "train_step"
        got = [[f["file"], f["line"], f["func"]] for f in frames]
        assert want in got, f"{api}: {want} not in {got}"
        # the outermost frame is the script's module level
        assert frames[-1]["func"] == "<module>" and frames[-1]["file"] == str(script)
        site = client.query(
            f"SELECT s.callsite FROM {table} c JOIN python.callsites s USING (stack_id) "
            f"WHERE c.api = '{api}'"
        ).to_pylist()
        assert site == [{"callsite": f"{script}:{want[1]} train_step"}]
    # the collective view carries the stack too
    ids = client.query("SELECT stack_id FROM comm.collectives").to_pylist()
    assert len(ids) == 1 and ids[0]["stack_id"] is not None
    client.trace_stop()


def test_a_call_blocked_without_the_gil_has_its_stack(spawn, tmp_path: Path) -> None:
    script, go, (r0, _) = _job(spawn, tmp_path, "blocked")
    client = ProbeClient.for_pid(r0.pid)
    client.trace_start(["gloo"])
    go.touch()
    marks = json.loads(
        line_after(r0, "marks ")
    )  # rank 0's thread is inside the all_reduce, waiting for rank 1
    try:
        rows = client.query(
            "SELECT c.dur_ns, c.stack_id, s.callsite FROM gloo.inflight c "
            "LEFT JOIN python.callsites s USING (stack_id)"
        ).to_pylist()
        assert len(rows) == 1, rows
        assert rows[0]["dur_ns"] is None, rows  # still in flight
        assert rows[0]["callsite"] == f"{script}:{marks['all_reduce'][1]} train_step", rows
        # the stack came from the thread that issued it, not the GIL holder
        frames = client.query(
            "SELECT s.func FROM gloo.inflight c JOIN python.stacks s USING (stack_id) "
            "ORDER BY s.depth"
        ).to_pylist()
        assert [f["func"] for f in frames][-3:] == [
            "Thread.run", "Thread._bootstrap_inner", "Thread._bootstrap"]  # fmt: skip
    finally:
        (tmp_path / "go.release").touch()
    wait_line(r0, "done")
    client.trace_stop()


SPIN_C = 'void spin_forever(void) { for (;;) __asm__ volatile(""); }\n'
HOLD_GIL = """
import ctypes, sys
lib = ctypes.PyDLL(sys.argv[1])  # PyDLL: the call keeps the GIL


def stuck_in_c():
    lib.spin_forever()


def step():
    stuck_in_c()


print("spinning", flush=True)
step()
"""


@pytest.fixture
def spin_lib(tmp_path: Path) -> str:
    src, out = tmp_path / "spin.c", tmp_path / "libspin.so"
    src.write_text(SPIN_C)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(out), str(src)], check=True)
    return str(out)


def _stack_text(out: str) -> list[str]:
    return [ln.strip() for ln in out.splitlines() if ln.startswith("    ")]


@pytest.mark.parametrize("with_probe", [False, True], ids=["no-inject", "probe-stuck"])
def test_stack_of_a_thread_holding_the_gil(spawn, tmp_path: Path, spin_lib: str,
                                           with_probe: bool) -> None:  # fmt: skip
    import os

    require(os.geteuid() == 0, "reads another process's memory (root or ptrace)")
    script = tmp_path / "hold.py"
    script.write_text(HOLD_GIL)
    t = spawn("", argv=[sys.executable, str(script), spin_lib], probing=with_probe)
    wait_line(t, "spinning")
    time.sleep(0.3)
    args = ["stack", "--pid", str(t.pid)] + ([] if with_probe else ["--no-inject"])
    res = cli(*args, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "reading the stacks from outside" in res.stderr
    lines = _stack_text(res.stdout)
    want = [f"stuck_in_c ({script}:7)", f"step ({script}:11)", f"<module> ({script}:15)"]
    at = lines.index(want[0]) if want[0] in lines else -1
    assert lines[at : at + 3] == want, res.stdout  # innermost first, as the thread has them
    assert "Python v3." in res.stdout


def test_stack_from_outside_of_a_non_python_process_is_an_error() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        res = cli("stack", "--pid", str(proc.pid), "--no-inject")
    finally:
        proc.kill()
        proc.wait()
    assert res.returncode != 0
    assert res.stderr.count("\n") <= 2 and "not a Python process" in res.stderr
