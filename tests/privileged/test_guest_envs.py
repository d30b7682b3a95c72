"""Jobs in environments that do not have probing: other numpy and pyarrow
versions, other Python minors, only the hook. Each is injected (or started
with ``PROBING=1``), traced, queried, evaluated and dumped, and sees the same
environment afterwards as before: ``sys.path``, what ``find_spec`` finds,
``numpy.__version__`` and ``pyarrow.__version__``. Nothing of BCC or LLVM
lands in the job, and the probe adds little to its memory. Job environments
come from ``.ci/jobenvs.sh`` (run by ``make setup``)."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest

from tests.conftest import SLOWDOWN, cli, require_bpf
from tests.privileged.helpers import env_python, ok

pytestmark = pytest.mark.privileged

# packages a job might probe for, several of which probing itself depends on
LOOKED_FOR = ["typer", "rich", "pytest", "hypothesis", "pyarrow", "numpy", "datafusion",
              "psutil", "probing", "bcc", "elftools", "pynvml", "transformers",
              "accelerate"]  # fmt: skip
# the guest's one private name, `_probing_guest`, is in sys.modules once it is
# loaded (so find_spec finds it): the only name the job can see of probing
RSS_BUDGET_KB = 30 * 1024
PROBING_SITE = sysconfig.get_paths()["purelib"]  # probing's own environment

JOB = """
import importlib.util, json, sys, time
try:
    import numpy
except ImportError:
    numpy = None
try:
    import pyarrow
except ImportError:
    pyarrow = None

def view():
    return {
        "path": list(sys.path),
        "found": [m for m in LOOKED if importlib.util.find_spec(m) is not None],
        "numpy": getattr(numpy, "__version__", None),
        "pyarrow": getattr(pyarrow, "__version__", None),
    }

def step(i):
    a = numpy.arange(256) * i if numpy is not None else [j * i for j in range(256)]
    return sum(a[:8])

print(json.dumps(view()), flush=True)
i = 0
while True:
    step(i)
    i += 1
    time.sleep(0.002)
""".replace("LOOKED", repr(LOOKED_FOR))


def start_job(python: str, runtime_dir: Path, **env: str) -> tuple[subprocess.Popen, dict]:
    full = {k: v for k, v in os.environ.items() if k != "PROBING"}
    full.update(PROBING_RUNTIME_DIR=str(runtime_dir), **env)
    proc = subprocess.Popen(  # not from the checkout: its probing/ would be importable
        [python, "-c", JOB], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=runtime_dir,
    )  # fmt: skip
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        proc.kill()
        raise AssertionError(f"the job did not start: {proc.communicate()[1][-800:]}")
    return proc, json.loads(line)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def view_now(pid: int) -> dict:
    out = ok("eval", "--pid", str(pid), "json.dumps(view())")  # its repr: a str literal
    return json.loads(ast.literal_eval(out.strip()))


def wait_for(pid: int, sql: str, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout * SLOWDOWN
    while True:
        out = ok("query", "--pid", str(pid), "--format", "json", sql)
        n = json.loads(out)[0]["n"]
        if n or time.monotonic() > deadline:
            return int(n)
        time.sleep(0.2)


def exercise(pid: int, before: dict, python_minor: str) -> None:
    """Query, eval, stack and trace the job; its view stays what it was."""
    rss0 = rss_kb(pid)
    info = json.loads(ok("query", "--pid", str(pid), "--format", "json",
                         "SELECT python, alive FROM process.info"))  # fmt: skip
    assert info[0]["python"].startswith(python_minor) and info[0]["alive"], info
    assert ok("eval", "--pid", str(pid), "6 * 7").strip() == "42"
    assert "step" in ok("stack", "--pid", str(pid)) or "<module>" in ok("stack", "--pid", str(pid))
    ok("trace", "--pid", str(pid), "--background")
    assert wait_for(pid, "SELECT count(*) AS n FROM python.samples") > 0
    assert wait_for(pid, "SELECT count(*) AS n FROM process.stacks") > 0
    maps = Path(f"/proc/{pid}/maps").read_text()
    # nothing of BCC/LLVM, and nothing of probing's own environment (its
    # numpy, pyarrow, datafusion): the job's own pyarrow may be there
    for lib in ("libbcc", "libLLVM", "libclang", "datafusion", PROBING_SITE):
        assert lib not in maps, f"{lib} was loaded into the job"
    grown = rss_kb(pid) - rss0
    assert grown < RSS_BUDGET_KB, f"the probe added {grown} kB to the job"
    assert view_now(pid) == before
    ok("trace", "--pid", str(pid), "--stop")


@pytest.mark.parametrize(
    "name,minor",
    [("np126", "3.11"), ("np126-pa15", "3.11"), ("py313", "3.13"), ("py310", "3.10")],
)
def test_a_job_without_probing_is_injected_traced_and_unchanged(
    name, minor, runtime_dir, tmp_path
) -> None:
    require_bpf()
    python = env_python(name)
    # the 3.13 job with an empty BPF cache: BCC compiles (in the engine), cold
    cold = {"PROBING_BPF_CACHE": str(tmp_path / "bpf-cache")} if name == "py313" else {}
    proc, before = start_job(python, runtime_dir, **cold)
    try:
        assert "probing" not in before["found"] and "typer" not in before["found"]
        ok("inject", "--pid", str(proc.pid))
        exercise(proc.pid, before, minor)
        if name == "np126-pa15":  # the job's own old pyarrow is the one it has
            assert before["pyarrow"] == "15.0.2" and before["numpy"] == "1.26.4"
    finally:
        proc.kill()
        proc.wait()


def test_probing_1_with_only_the_hook_installed(runtime_dir) -> None:
    require_bpf()
    python = env_python("hook312")
    r = cli("hook", "--python", python)
    assert r.returncode == 0, r.stderr
    try:
        proc, before = start_job(python, runtime_dir, PROBING="1")
        try:
            sock = runtime_dir / f"probing-{os.getuid()}" / f"{proc.pid}.sock"
            deadline = time.monotonic() + 30 * SLOWDOWN
            while not sock.exists():
                assert time.monotonic() < deadline, "the hook's probe never served"
                time.sleep(0.05)
            exercise(proc.pid, before, "3.12")
        finally:
            proc.kill()
            proc.wait()
    finally:
        assert cli("hook", "--python", python, "--remove").returncode == 0


def test_a_rank_killed_while_traced_still_answers(runtime_dir) -> None:
    """A 4-rank torch job in its own numpy 1.26 venv: traced, diagnosed; a
    rank killed with SIGKILL still answers from what it left."""
    require_bpf()
    from probing.cli.demo import DemoJob, trace_all

    python = env_python("torch-np126")
    job = DemoJob(4, job_args=["--slow-rank", "2", "--slow-ms", "40"], python=python,
                  env={"PROBING_RUNTIME_DIR": str(runtime_dir)})  # fmt: skip
    try:
        job.wait_ready(timeout=120 * SLOWDOWN)
        assert not trace_all(job.pids, ["gloo"])
        victim = job.pids[3]
        n = wait_for(victim, "SELECT count(*) AS n FROM comm.collectives")
        assert n > 0
        deadline = time.monotonic() + 30 * SLOWDOWN
        while True:
            r = cli("diagnose", "--pid", str(job.pids[0]), "--cluster", timeout=120)
            if "rank 2" in r.stdout or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert r.returncode in (0, 2) and "rank 2" in r.stdout, r.stdout + r.stderr
        os.kill(victim, signal.SIGKILL)
        job.procs[3].wait(timeout=60)
        left = json.loads(ok("query", "--pid", str(victim), "--format", "json",
                             "SELECT count(*) AS n FROM comm.collectives"))  # fmt: skip
        assert left[0]["n"] >= n
        alive = json.loads(ok("query", "--pid", str(victim), "--format", "json",
                              "SELECT alive FROM process.info"))  # fmt: skip
        assert alive[0]["alive"] is False
    finally:
        job.stop()
