"""``make demo`` / ``probing demo``: the main job so far, on a built-in example.

Starts a small training-like job (plain Python: a data-loader thread, a
compute loop, a metrics table) *without* a probe, attaches to it with
``probing inject``, prints its threads' stacks, then asks SQL questions
through the ``probing`` command, exactly as a user would from another
terminal, and shuts it down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

EXAMPLE_JOB = textwrap.dedent(
    """
    import math, queue, random, threading, time
    import probing

    steps = probing.ExternalTable("steps", ["step", "ts_ns", "loss", "step_ms"])
    batches = queue.Queue(maxsize=4)
    step, loss = 0, 10.0

    def data_loader():
        while True:
            time.sleep(random.uniform(0.002, 0.006))   # "read and decode a batch"
            batches.put([random.random() for _ in range(512)])

    threading.Thread(target=data_loader, name="data-loader", daemon=True).start()
    while True:
        t0 = time.perf_counter()
        batch = batches.get()
        acc = sum(math.sin(x) * math.cos(x) for x in batch * 20)   # "forward/backward"
        loss = 10.0 / (1 + step / 50) + acc * 1e-6
        step += 1
        steps.append([step, time.time_ns(), loss, (time.perf_counter() - t0) * 1e3])
    """
)

QUESTIONS = [
    (
        "Which threads does the job run, and what are they doing?",
        "SELECT tid, name, state, is_python, round(cpu_user_s, 2) AS cpu_s "
        "FROM process.threads ORDER BY tid",
    ),
    (
        "What is the training loop's state right now (its own globals)?",
        "SELECT * FROM python.`{'step': step, 'loss': round(loss, 4)}`",
    ),
    (
        "How fast are steps, per 100 steps?",
        "SELECT step / 100 AS bucket, count(*) AS steps, round(avg(step_ms), 2) AS avg_ms, "
        "round(max(step_ms), 2) AS max_ms FROM python.steps GROUP BY 1 ORDER BY 1 LIMIT 5",
    ),
    (
        "What does the probe hold, and how well is it compressed?",
        'SELECT "schema", "table", rows, raw_bytes, stored_bytes, compression_ratio '
        "FROM probing.tables",
    ),
]


def _probing(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "probing", *args], capture_output=True, text=True, timeout=60
    )


def _show(*args: str) -> int:
    print(f"$ probing {' '.join(args)}", flush=True)
    r = _probing(*args)
    print((r.stdout or r.stderr).rstrip() + "\n", flush=True)
    return r.returncode


def main(seconds: float = 3.0) -> int:
    env = {k: v for k, v in os.environ.items() if k != "PROBING"}
    print("$ python example_job.py &          # started without probing", flush=True)
    job = subprocess.Popen([sys.executable, "-c", EXAMPLE_JOB], env=env)
    pid = str(job.pid)
    try:
        time.sleep(seconds)
        if job.poll() is not None:
            print("demo: the example job exited", file=sys.stderr)
            return 1
        print("# Attach to the running job: no restart, no code change", flush=True)
        for args in (("ps",), ("inject", "--pid", pid), ("stack", "--pid", pid)):
            if _show(*args):
                return 1
        for question, sql in QUESTIONS:
            print(f"# {question}")
            if _show("query", "--pid", pid, sql):
                return 1
        bad = "SELECT * FROM process.no_such_table"
        print("# A bad query gets the engine's message, and the probe keeps answering:")
        _show("query", "--pid", pid, bad)
        return 0
    finally:
        job.kill()
        job.wait()
        print(f"demo: stopped the example job (pid {job.pid})")


if __name__ == "__main__":
    sys.exit(main())
