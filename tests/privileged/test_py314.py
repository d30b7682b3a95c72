"""A 4-rank Gloo job on CPython 3.14 (Debian unstable's python3.14 and torch,
in the chroot .ci/py314.sh makes), started with ``PROBING=1`` through
``probing hook``: its stacks read from outside with the right lines, its
collectives traced with the stacks of their calls, ``diagnose --cluster``
naming the slowed rank and its function, and the job's view of its
environment unchanged. One job for the module: a 3.14 rank takes seconds to
import torch in the chroot. Root-only (the chroot); PROBING_REQUIRE_PRIVILEGED=1
(CI) turns skips into failures."""

from __future__ import annotations

import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from probing.cli.demo import free_port, trace_all
from probing.guest import place
from tests.conftest import (
    PY314_BUILD_S,
    REPO,
    SLOWDOWN,
    cli,
    live_engines,
    py314_python,
    require_bpf,
    stop_engine,
)
from tests.privileged.helpers import ok

# the first test may wait for the 3.14 root filesystem's background build (.ci/run)
pytestmark = [pytest.mark.privileged, pytest.mark.timeout(PY314_BUILD_S + 300)]
WORLD = 4
LOOKED_FOR = ["typer", "rich", "pytest", "pyarrow", "datafusion", "psutil", "probing", "bcc",
              "elftools", "numpy"]  # fmt: skip

JOB = """
import importlib.util, json, os, sys, time
import torch, torch.distributed as dist

SLOW = int(os.environ["SLOW_RANK"])


def view():
    return {"path": list(sys.path), "python": sys.version.split()[0],
            "found": [m for m in LOOKED if importlib.util.find_spec(m) is not None]}


def load_batch():
    time.sleep(0.01 + (0.06 if dist.get_rank() == SLOW else 0.0))  # LOAD


def train_step(t):
    dist.all_reduce(t)  # ALL_REDUCE


dist.init_process_group("gloo")
print("view " + json.dumps(view()), flush=True)
t = torch.ones(1024)
while True:
    load_batch()
    train_step(t)  # STEP
""".replace("LOOKED", repr(LOOKED_FOR))


def line_of(tag: str) -> int:
    return next(i for i, ln in enumerate(JOB.splitlines(), 1) if ln.endswith(f"# {tag}"))


class Job(NamedTuple):
    script: Path
    pids: list[int]
    views: list[dict]  # type: ignore[type-arg]
    slow: int


def _engine(env: dict[str, str], runtime: Path) -> None:
    """The engine the ranks hand themselves to, started from here: a guest in
    the chroot cannot start probing's Python, which lives outside it."""
    sock = Path(place.engine_path(str(runtime / f"probing-{os.getuid()}"),
                                  place.engine_key(env, sys.executable)))  # fmt: skip
    subprocess.run([sys.executable, "-m", "probing.node.service", "--daemon"], env=env,
                   check=True, timeout=60 * SLOWDOWN, cwd=REPO)  # fmt: skip
    deadline = time.monotonic() + 60 * SLOWDOWN
    while not sock.exists():
        assert time.monotonic() < deadline, f"the engine never served {sock}"
        time.sleep(0.05)


def _ranks(python: str, env: dict[str, str], script: Path, runtime: Path) -> list[subprocess.Popen]:  # type: ignore[type-arg]
    port = free_port()
    return [
        subprocess.Popen(
            [python, str(script)],
            env=dict(
                env,
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(WORLD),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),  # fmt: skip
            stdout=subprocess.PIPE,
            text=True,
            cwd=runtime,
            start_new_session=True,
        )  # fmt: skip
        for r in range(WORLD)
    ]


@pytest.fixture(scope="module")
def job() -> Iterator[Job]:
    require_bpf()
    python = py314_python()
    hooked = cli("hook", "--python", python, timeout=120)
    assert hooked.returncode == 0, hooked.stderr
    runtime = Path(tempfile.mkdtemp(prefix="probing-py314-"))
    slow = random.randrange(WORLD)
    print(f"straggler: rank {slow}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROBING", "RANK"))}
    env.update(PROBING_RUNTIME_DIR=str(runtime), PROBING_ENGINE_IDLE_S="120",
               PROBING_KEEP_DEAD_S="30", SLOW_RANK=str(slow),
               USE_LIBUV="0")  # Debian's torch: its TCPStore has no libuv  # fmt: skip
    script = runtime / "train.py"  # a file of the user's: its frames are user code
    script.write_text(JOB)
    _engine(env, runtime)
    procs = _ranks(python, dict(env, PROBING="1"), script, runtime)
    old = os.environ.get("PROBING_RUNTIME_DIR")
    os.environ["PROBING_RUNTIME_DIR"] = str(runtime)  # cli() asks this job's engine
    try:
        views = []
        for p in procs:
            line = p.stdout.readline() if p.stdout else ""
            assert line.startswith("view "), f"rank pid {p.pid} did not start: {line!r}"
            views.append(json.loads(line[5:]))
        yield Job(script, [p.pid for p in procs], views, slow)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=60)
        stop_engine(runtime)
        gone = time.monotonic() + 30 * SLOWDOWN  # its last files written, then removed
        while live_engines(runtime) and time.monotonic() < gone:
            time.sleep(0.05)
        shutil.rmtree(runtime, ignore_errors=True)
        os.environ.pop("PROBING_RUNTIME_DIR")
        if old is not None:
            os.environ["PROBING_RUNTIME_DIR"] = old
        assert cli("hook", "--python", python, "--remove", timeout=120).returncode == 0


def test_the_314_job_runs_3_14_with_the_hook_and_nothing_of_probing_to_import(job: Job) -> None:
    for pid, before in zip(job.pids, job.views, strict=True):
        assert before["python"].startswith("3.14."), before
        assert not {"probing", "typer", "datafusion", "pyarrow", "bcc"} & set(before["found"])
        info = json.loads(ok("query", "--pid", str(pid), "--format", "json",
                             "SELECT python FROM process.info"))  # fmt: skip
        assert info[0]["python"].startswith("3.14"), info
    pid, before = job.pids[0], job.views[0]
    now = ok("eval", "--pid", str(pid), "json.dumps(view())")  # its repr: a str literal
    assert json.loads(ast.literal_eval(now.strip())) == before
    maps = Path(f"/proc/{pid}/maps").read_text()
    for lib in ("libbcc", "libLLVM", "libclang", "datafusion"):
        assert lib not in maps, f"{lib} was loaded into the job"


def test_stack_from_outside_shows_the_314_frames_at_their_lines(job: Job) -> None:
    want = f"load_batch ({job.script}:{line_of('LOAD')})"
    deadline = time.monotonic() + 30 * SLOWDOWN
    while True:  # the rank is in load_batch's sleep most of its time, not always
        res = cli("stack", "--pid", str(job.pids[0]), "--no-inject", timeout=60)
        assert res.returncode == 0, res.stderr
        lines = [ln.strip() for ln in res.stdout.splitlines() if ln.startswith("    ")]
        if want in lines or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert "Python v3.14" in res.stdout, res.stdout
    at = lines.index(want)
    assert lines[at + 1].startswith(f"<module> ({job.script}:"), res.stdout


@pytest.fixture(scope="module")
def traced(job: Job) -> Job:
    errors = trace_all(job.pids, ["gloo"])
    assert not errors, errors
    return job


def test_traced_collectives_carry_the_stack_of_their_call(traced: Job) -> None:
    job = traced
    site = f"{job.script}:{line_of('ALL_REDUCE')} train_step"
    sql = ("SELECT s.callsite, count(*) AS n FROM gloo.calls c JOIN python.callsites s "
           "USING (stack_id) GROUP BY s.callsite")  # fmt: skip
    deadline = time.monotonic() + 60 * SLOWDOWN
    while True:
        rows = json.loads(ok("query", "--pid", str(job.pids[1]), "--format", "json", sql))
        if rows or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [r["callsite"] for r in rows] == [site], rows
    frames = json.loads(ok("query", "--pid", str(job.pids[1]), "--format", "json",
                           "SELECT s.func, s.line, s.file FROM gloo.calls c JOIN python.stacks s "
                           "USING (stack_id) GROUP BY s.func, s.line, s.file"))  # fmt: skip
    got = {(f["func"], f["line"]) for f in frames if f["file"] == str(job.script)}
    assert ("train_step", line_of("ALL_REDUCE")) in got and ("<module>", line_of("STEP")) in got, (
        frames
    )


def test_diagnose_names_the_slowed_rank_and_its_function(traced: Job) -> None:
    job = traced
    other = job.pids[(job.slow + 1) % WORLD]
    deadline = time.monotonic() + 60 * SLOWDOWN
    while True:
        said = cli("diagnose", "--pid", str(other), "--cluster", "--window", "8",
                   "--format", "json", timeout=120)  # fmt: skip
        assert said.returncode == 0, said.stderr
        d = json.loads(said.stdout)
        fn = [w for w in d["why"] if w["kind"] == "function" and w["rank"] == job.slow]
        if (d["stragglers"] and fn) or time.monotonic() > deadline:
            break
        time.sleep(1)
    print(d["verdict"])
    assert d["stragglers"] and d["stragglers"][0]["rank"] == job.slow, d["verdict"]
    assert fn and fn[0]["what"] == "load_batch", d["why"]
    assert f": load_batch ({job.script}:" in d["verdict"], d["verdict"]
    # the sampler's stacks (python.samples): the slowed rank's time off CPU
    # in load_batch's sleep, at its line
    off = json.loads(ok("query", "--pid", str(job.pids[job.slow]), "--format", "json",
                        "SELECT s.line, sum(p.dur_ns) AS ns FROM python.samples p "
                        "JOIN python.stacks s USING (stack_id) WHERE p.kind = 'off' "
                        "AND s.depth = 0 AND s.func = 'load_batch' GROUP BY s.line"))  # fmt: skip
    assert off and max(off, key=lambda r: r["ns"])["line"] == line_of("LOAD"), off


IDLE = """
import time


def idle():
    while True:
        time.sleep(0.05)  # IDLE


print("ready", flush=True)
idle()
"""


def test_a_314_process_is_injected_in_its_chroot_and_answers(runtime_dir: Path) -> None:
    """``probing inject`` of a 3.14 process that has no probe: the library and
    the guest staged where its chroot sees them, the engine started here."""
    require_bpf()
    python = py314_python()
    script = runtime_dir / "idle.py"
    script.write_text(IDLE)
    env = {k: v for k, v in os.environ.items() if k != "PROBING"}
    proc = subprocess.Popen([python, str(script)], env=env, stdout=subprocess.PIPE, text=True,
                            cwd=runtime_dir)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert "Python 3.14" in ok("inject", "--pid", str(proc.pid))
        assert ok("eval", "--pid", str(proc.pid), "sys.version").startswith("'3.14.")
        stack = ok("stack", "--pid", str(proc.pid))
        line = next(i for i, ln in enumerate(IDLE.splitlines(), 1) if ln.endswith("# IDLE"))
        assert f"idle ({script}:{line})" in stack, stack
    finally:
        proc.kill()
        proc.wait(timeout=60)
