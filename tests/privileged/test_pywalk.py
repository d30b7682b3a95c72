"""The BPF walk of a traced call's Python stack (``bpf/pyframes.h``) against
the stack the job itself sees, on each CPython minor a job may run (the job
environments of ``.ci/jobenvs.sh``: 3.10's heap frames, 3.11-3.13's data
stack). The call is made 60 frames deep, of frames of ~1 KB each, so the
walk's 32 frames span more than one of the data stack's 16 KB chunks, and
through the two kinds of frame outside it: a generator's, and (3.12+) the
entry frame a call from C (``map``) puts on the C stack. Root-only;
PROBING_REQUIRE_PRIVILEGED=1 (CI) turns skips into failures."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.conftest import SLOWDOWN, require_bpf
from tests.privileged.helpers import env_python, installed_lib, ok

pytestmark = pytest.mark.privileged

LOCALS = 120  # a frame of ~1 KB (8 bytes a local)

JOB = """
import ctypes, json, os, sys, time, traceback

cudart = ctypes.CDLL(sys.argv[1])
go = sys.argv[2]


def call():
    p = ctypes.c_void_p()
    seen = traceback.extract_stack(); cudart.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(64))
    print("seen " + json.dumps([[f.filename, f.lineno, f.name] for f in seen]), flush=True)


def gen(n):
    yield deep(n)


ARGS = ", ".join(f"a{i}" for i in range(LOCALS))
exec(f'''
def deep(n):
    {ARGS} = range(LOCALS)
    if n == 0:
        return call()
    if n % 7 == 0:
        return list(map(deep, [n - 1]))
    if n % 11 == 0:
        return next(gen(n - 1))
    return deep(n - 1)
''')

print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.02)
deep(60)
time.sleep(600)
""".replace("LOCALS", str(LOCALS))

FRAMES = (
    "SELECT s.file, s.line, s.func FROM cuda.calls c JOIN python.stacks s "
    "ON s.stack_id = c.stack_id WHERE c.api = 'cudaMalloc' ORDER BY s.depth"
)


@pytest.mark.parametrize("env,minor", [("py310", "3.10"), ("np126", "3.11"),
                                       ("hook312", "3.12"), ("py313", "3.13")])  # fmt: skip
def test_the_walked_stack_is_the_one_the_job_sees(env, minor, runtime_dir, tmp_path) -> None:
    require_bpf()
    python = env_python(env)
    script, go = tmp_path / "job.py", tmp_path / "go"
    script.write_text(JOB)
    job = subprocess.Popen(  # not from the checkout: its probing/ would be importable
        [python, str(script), installed_lib("libcudart"), str(go)], cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PROBING"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert job.stdout and job.stdout.readline().strip() == "ready", job.communicate()[1]
        ok("trace", "--pid", str(job.pid), "--background")
        go.touch()
        line = job.stdout.readline()
        assert line.startswith("seen "), job.communicate()[1][-800:]
        seen = [tuple(f) for f in json.loads(line[5:])][::-1]  # innermost first
        deadline = time.monotonic() + 30 * SLOWDOWN
        while True:
            out = ok("query", "--pid", str(job.pid), "--format", "json", FRAMES)
            walked = [(f["file"], f["line"], f["func"]) for f in json.loads(out)]
            if walked or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert seen[0][2] == "call" and len(seen) > 60, seen[:3]
        # 32 frames walked, less the entry frames of the calls from C (3.12+: map, next)
        assert len(walked) >= 24, f"{minor}: {len(walked)} frames walked"
        assert walked == seen[: len(walked)], f"{minor}: walked {walked} seen {seen[:33]}"
        ok("trace", "--pid", str(job.pid), "--stop")
    finally:
        job.kill()
        job.wait()
