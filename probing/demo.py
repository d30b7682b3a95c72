"""``make demo`` / ``probing demo``: the main job so far, on a built-in example.

Starts a small training-like job (plain Python: a data-loader thread, a
compute loop, a metrics table) with ``PROBING=1`` and no probing code in its
loop, then asks its probe SQL questions through the ``probing`` command,
exactly as a user would from another terminal, and shuts it down.
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


def main(seconds: float = 3.0) -> int:
    env = dict(os.environ, PROBING="1")
    print("$ PROBING=1 python example_job.py &", flush=True)
    job = subprocess.Popen([sys.executable, "-c", EXAMPLE_JOB], env=env)
    try:
        from probing.probe import paths

        deadline = time.monotonic() + 20
        while paths.find_socket(job.pid) is None:
            if job.poll() is not None or time.monotonic() > deadline:
                print("demo: the example job did not start its probe", file=sys.stderr)
                return 1
            time.sleep(0.05)
        time.sleep(seconds)
        print(f"\n$ probing ps\n{_probing('ps').stdout}")
        for question, sql in QUESTIONS:
            print(f'# {question}\n$ probing query --pid {job.pid} "{sql}"')
            r = _probing("query", "--pid", str(job.pid), sql)
            print(r.stdout or r.stderr)
            if r.returncode:
                return r.returncode
        bad = "SELECT * FROM process.no_such_table"
        print(
            f"# A bad query gets the engine's message, and the probe keeps answering:\n"
            f'$ probing query --pid {job.pid} "{bad}"'
        )
        print(_probing("query", "--pid", str(job.pid), bad).stderr)
        return 0
    finally:
        job.kill()
        job.wait()
        print(f"demo: stopped the example job (pid {job.pid})")


if __name__ == "__main__":
    sys.exit(main())
