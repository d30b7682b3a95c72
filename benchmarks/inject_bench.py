"""Attach cost: `probing inject` to the first answered query, and what the target feels.

Ten fresh targets (``BENCH_INJECT_RUNS``), each a plain `python -c` loop (not started with probing)
that notes every pause longer than 2 ms between two ~0.1 ms iterations.
For each: inject, then query; the borrowed thread's stop time comes from
the injector. The target's pauses are read back through the probe itself
and split into the second before injection (baseline) and the injection
window. Then `probing query`, `stack` and `ps` side by side with `py-spy
dump` (the bench extra installs it) and a bare `python -c pass`, wall and
CPU time, on a target whose probe has answered once. With
``BENCH_BASELINE_PATH`` (an older checkout's root), its ``probing query``,
``stack`` and ``ps`` are timed in the same rounds (``baseline_*``), and its
targets are injected with its own injector and asked with its own client.

Prints one JSON object. Needs root (ptrace).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from probing.cli.client import ProbeClient
from probing.inject import inject

TARGET = """
import time
PAUSES = []
last = time.monotonic()
x = 0
while True:
    for i in range(2000):
        x += i
    now = time.monotonic()
    if now - last > 0.002:
        PAUSES.append((last, now - last))
    last = now
"""
RUNS = int(os.environ.get("BENCH_INJECT_RUNS", 10))

# runs with the tree under test on sys.path: inject, then the first query
# (time.monotonic is system-wide, so the target's pauses line up)
_MEASURE = """
import json, sys, time
import pyarrow  # the client's decoder, loaded before the clock starts
from probing.cli.client import ProbeClient
from probing.inject import inject
pid = int(sys.argv[1])
t0 = time.monotonic()
res = inject(pid)
t1 = time.monotonic()
client = ProbeClient.for_pid(pid)
client.query("SELECT pid FROM process.info")
t2 = time.monotonic()
pauses = client.query("SELECT * FROM python.`PAUSES`").column(0).to_pylist()
print(json.dumps({"t0": t0, "t1": t1, "t2": t2, "stopped_s": res.stopped_s, "pauses": pauses}))
"""


def _ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "median": round(statistics.median(xs) * 1000, 2),
        "min": round(xs[0] * 1000, 2),
        "max": round(xs[-1] * 1000, 2),
    }


def _env(root: str | None) -> dict[str, str]:
    """The environment of a process that imports ``root``'s probing (None:
    the installed one), without a probe of its own at start-up."""
    env = {k: v for k, v in os.environ.items() if k not in ("PROBING", "PYTHONPATH")}
    if root:
        env["PYTHONPATH"] = root
    return env


def _spawn(cwd: str, root: str | None = None) -> subprocess.Popen[bytes]:
    """A target; ``root``: the checkout its injected probe imports (None:
    the installed one)."""
    return subprocess.Popen([sys.executable, "-c", TARGET], cwd=cwd, env=_env(root))


TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(path: str) -> float:
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _probe_cpu_s(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` but its main one (which spins
    all along), those that have ended included: the probe's."""
    return _cpu_s(f"/proc/{pid}/stat") - _cpu_s(f"/proc/{pid}/task/{pid}/stat")


def attach_runs(cwd: str) -> dict[str, object]:
    """RUNS injections; with ``BENCH_BASELINE_PATH`` also into targets whose
    probe comes from that checkout, interleaved (``baseline``)."""
    roots: dict[str, str | None] = {"now": None}
    if os.environ.get("BENCH_BASELINE_PATH"):
        roots["baseline"] = os.environ["BENCH_BASELINE_PATH"]
    runs = {name: _Runs() for name in roots}
    for _ in range(RUNS):
        for name, root in roots.items():
            runs[name].once(cwd, root)
    out = runs["now"].report()
    if "baseline" in runs:
        out["baseline"] = runs["baseline"].report()
        out["baseline_path"] = roots["baseline"]
    out["loadavg"] = os.getloadavg()
    return out


class _Runs:
    def __init__(self) -> None:
        self.total: list[float] = []
        self.injected: list[float] = []
        self.stopped: list[float] = []
        self.first_query: list[float] = []
        self.probe_cpu: list[float] = []
        self.base_pause: list[float] = []
        self.window_pause: list[float] = []

    def once(self, cwd: str, root: str | None) -> None:
        proc = _spawn(cwd, root)
        try:
            time.sleep(1.2)  # a second of undisturbed baseline
            c0 = _probe_cpu_s(proc.pid)
            # each tree injects with its own injector and asks with its own
            # client (a subprocess), so an older checkout is measured whole
            out = subprocess.run(
                [sys.executable, "-c", _MEASURE, str(proc.pid)],
                check=True,
                capture_output=True,
                cwd=cwd,
                env=_env(root),
                text=True,
            ).stdout
            m = json.loads(out)
            self.probe_cpu.append(_probe_cpu_s(proc.pid) - c0)
            t0, t2 = m["t0"], m["t2"]
            self.total.append(t2 - t0)
            self.injected.append(m["t1"] - t0)
            self.first_query.append(t2 - m["t1"])
            self.stopped.append(m["stopped_s"])
            pauses = m["pauses"]
            base = [g for s, g in pauses if t0 - 1.0 <= s < t0]
            during = [g for s, g in pauses if t0 <= s < t2]
            self.base_pause.append(max(base, default=0.0))
            self.window_pause.append(max(during, default=0.0))
        finally:
            proc.kill()
            proc.wait()

    def report(self) -> dict[str, object]:
        total, injected, first_query = self.total, self.injected, self.first_query
        stopped, base_pause, window_pause = self.stopped, self.base_pause, self.window_pause
        return {
            "runs": RUNS,
            "inject_to_first_answer_ms": _ms(total),
            "probe_cpu_ms (inject to first answer, off the main thread)": _ms(self.probe_cpu),
            "inject_call_ms": _ms(injected),
            "first_query_ms (loads the SQL engine in the target)": _ms(first_query),
            "borrowed_thread_stopped_ms": _ms(stopped),
            "other_threads_stopped_ms": 0,
            "target_longest_pause_ms": {
                "baseline_1s_before": _ms(base_pause),
                "during_inject_and_first_query": _ms(window_pause),
            },
        }


def _timed(cmd: list[str], cwd: str, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Wall seconds of one command, and the CPU seconds it used (its children too)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, capture_output=True, cwd=cwd, env=env)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cli_vs_pyspy(cwd: str) -> dict[str, object]:
    """`probing query`, `stack` and `ps` against a target whose probe has
    answered once, side by side with `py-spy dump` and a bare interpreter
    start (`python -c pass`), interleaved RUNS times."""
    proc = _spawn(cwd)
    try:
        time.sleep(0.5)
        inject(proc.pid)
        pid = str(proc.pid)
        ProbeClient.for_pid(proc.pid).query("SELECT 1")
        pyspy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        commands = {
            "python_c_pass": [sys.executable, "-c", "pass"],
            "probing_query": [sys.executable, "-m", "probing", "query", "-p", pid, "SELECT 1"],
            "probing_stack": [sys.executable, "-m", "probing", "stack", "-p", pid],
            "probing_ps": [sys.executable, "-m", "probing", "ps"],
        }
        if os.access(pyspy, os.X_OK):
            commands["py_spy_dump"] = [pyspy, "dump", "--pid", pid]
        envs: dict[str, dict[str, str]] = {}
        baseline = os.environ.get("BENCH_BASELINE_PATH")
        if baseline:
            for name in ("probing_query", "probing_stack", "probing_ps"):
                commands[f"baseline_{name}"] = commands[name]
                envs[f"baseline_{name}"] = dict(os.environ, PYTHONPATH=baseline)
        walls: dict[str, list[float]] = {k: [] for k in commands}
        cpus: dict[str, list[float]] = {k: [] for k in commands}
        for _ in range(RUNS):
            for name, cmd in commands.items():
                wall, cpu = _timed(cmd, cwd, envs.get(name))  # cwd: no checkout on sys.path
                walls[name].append(wall)
                cpus[name].append(cpu)
        out: dict[str, object] = {"runs": RUNS, "target_ms": 100, "baseline_path": baseline}
        for name in commands:
            out[name] = {"wall_ms": _ms(walls[name]), "cpu_ms": _ms(cpus[name])}
        if "py_spy_dump" not in commands:
            out["py_spy_dump"] = None  # pip install py-spy (the bench extra) for the baseline
        return out
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    with tempfile.TemporaryDirectory() as cwd:  # targets do not find probing in their cwd
        report: dict[str, object] = {"benchmark": "inject", "attach": attach_runs(cwd)}
        if not os.environ.get("BENCH_ATTACH_ONLY"):
            report["cli"] = cli_vs_pyspy(cwd)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
