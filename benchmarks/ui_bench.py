"""``probing ui``: page load times, and what a page refreshing every second costs
the probes; prints JSON. Root (BPF) and chromium needed.

A 4-rank DDP job (``probing.cli.demo.DemoJob``, Gloo, one rank slowed) is traced
with dynamic injection; ``probing ui --pid P`` runs as a user runs it, and
headless Chromium (``tests/chromium.py``) opens its pages.

* ``pages``: per page, the median of ``--loads`` loads, from navigation to
  the page's data drawn (``body.dataset.loaded``; the SQL page: a query's
  table shown), next to the median time of the page's API call alone
  (``GET /api/<page>``, from Python: the baseline the browser adds to).
* ``probe_cpu``: the job's ranks' CPU (every thread, probes included: the
  probe runs inside them) while the Job page refreshes every second, against
  the same job with no page open, in interleaved rounds of ``--phase-s``
  seconds (idle, ui, idle, ui, ...) so both see the same machine; the
  difference is what the UI costs the probes. The ``probing ui`` process's own
  CPU is reported beside it.

    sudo python benchmarks/ui_bench.py [--loads 3] [--phase-s 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from probing.cli.demo import DemoJob, trace_all  # noqa: E402
from tests.chromium import Browser  # noqa: E402

WORLD = 4
CACHE_S = 2.5  # longer than the UI's cache of an answer (probing.cli.ui.data)
SQL = "SELECT rank, op, count(*) AS calls FROM comm.collectives GROUP BY rank, op"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """CPU seconds of a process, all its threads (exited ones included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def wait_traced(pid: int, n: int = 40, timeout: float = 120.0) -> None:
    sql = "SELECT rank, count(*) AS n FROM gloo.calls GROUP BY rank"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = subprocess.run(
            [sys.executable, "-m", "probing", "query", "-p", str(pid), "--cluster", "-f", "json",
             sql], capture_output=True, text=True,
        )  # fmt: skip
        rows = json.loads(r.stdout or "[]") if r.returncode == 0 else []
        if len(rows) == WORLD and min(x["n"] for x in rows) >= n:
            return
        time.sleep(1)
    raise SystemExit("the job's collectives were not traced in time")


def page_loads(browser: Browser, url: str, base: str, token: str, loads: int) -> dict:  # type: ignore[type-arg]
    page = browser.page(url)
    page.wait_for("location.pathname == '/job'", timeout=30)
    out = {}
    for name in ("job", "diagnose", "gpu", "sql"):
        times, api = [], []
        for _ in range(loads):
            # the API alone first, then the page: each after the UI's cache expired
            t0 = time.perf_counter()
            if name == "sql":
                body = json.dumps({"sql": SQL, "all": True}).encode()
                req = urllib.request.Request(
                    f"{base}/api/sql?token={token}", data=body,
                    headers={"Content-Type": "application/json"},
                )  # fmt: skip
            else:
                req = urllib.request.Request(f"{base}/api/{name}?token={token}")
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
            api.append(time.perf_counter() - t0)
            page.goto("about:blank")
            time.sleep(CACHE_S)
            t0 = time.perf_counter()
            page.goto(f"{base}/{name}?refresh=3600")
            if name == "sql":
                page.wait_for("!!document.querySelector('#run')", timeout=60)
                page.evaluate(f"document.querySelector('#sql').value = {json.dumps(SQL)}")
                page.evaluate("document.querySelector('#run').click()")
                page.wait_for("!!document.querySelector('#sql-table, #sql-error')", timeout=120)
            else:
                page.wait_for("Number(document.body.dataset.loaded || 0) >= 1", timeout=120)
            times.append(time.perf_counter() - t0)
            time.sleep(CACHE_S)
        out[name] = {"load_s_median": round(statistics.median(times), 3),
                     "api_s_median": round(statistics.median(api), 3)}  # fmt: skip
    return out


def probe_cpu(browser: Browser, job: DemoJob, ui_pid: int, base: str, phase_s: float,
              rounds: int) -> dict:  # type: ignore[type-arg]  # fmt: skip
    page = browser.page("about:blank")
    phases: dict[str, list[float]] = {"idle": [], "ui": []}
    ui_cpu: dict[str, list[float]] = {"idle": [], "ui": []}
    for _ in range(rounds):
        for phase in ("idle", "ui"):
            page.goto("about:blank" if phase == "idle" else f"{base}/job?refresh=1")
            time.sleep(2)  # the page settles into its refresh loop
            before = sum(cpu_s(p) for p in job.pids)
            u0, t0 = cpu_s(ui_pid), time.monotonic()
            time.sleep(phase_s)
            dt = time.monotonic() - t0
            phases[phase].append(100 * (sum(cpu_s(p) for p in job.pids) - before) / dt)
            ui_cpu[phase].append(100 * (cpu_s(ui_pid) - u0) / dt)
    idle, ui = statistics.median(phases["idle"]), statistics.median(phases["ui"])
    return {
        "ranks_cpu_pct_idle": round(idle, 1),
        "ranks_cpu_pct_ui_refresh_1s": round(ui, 1),
        "delta_pct": round(ui - idle, 1),
        "rounds": {k: [round(v, 1) for v in vs] for k, vs in phases.items()},
        "ui_process_cpu_pct": {k: round(statistics.median(v), 1) for k, v in ui_cpu.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    job = DemoJob(WORLD, job_args=["--slow-rank", "1", "--slow-ms", "40"])
    ui = None
    try:
        job.wait_ready(timeout=120)
        errors = trace_all(job.pids, ["gloo"])
        if errors:
            raise SystemExit(f"tracing failed: {errors}")
        wait_traced(job.pids[0])
        cmd = [sys.executable, "-m", "probing", "ui", "--pid", str(job.pids[0])]
        ui = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = ui.stdout.readline() if ui.stdout else ""
        m = re.search(r"open (http://127\.0\.0\.1:\d+)/\?token=(\S+)", line)
        if not m:
            raise SystemExit(f"probing ui printed no URL: {line!r}")
        base, token = m.group(1), m.group(2)
        with Browser() as browser:
            pages = page_loads(browser, f"{base}/?token={token}", base, token, args.loads)
            cpu = probe_cpu(browser, job, ui.pid, base, args.phase_s, args.rounds)
        print(json.dumps({"pages": pages, "probe_cpu": cpu, "ranks": WORLD,
                          "cpus": os.cpu_count()}, indent=1))  # fmt: skip
    finally:
        if ui is not None:
            ui.terminate()
            ui.wait(10)
        job.stop()


if __name__ == "__main__":
    main()
