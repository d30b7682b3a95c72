"""Cost of a probe in an idle process, measured side by side; prints JSON.

Three copies of the same idle Python program run at once: without a probe,
with an idle probe (PROBING=1, no query yet) and with a probe that has
answered one query (SQL engine loaded). For each: RSS, and CPU time used
over the same 10 s window. Also: time from process start to the first
answered query, and the latency of a small query (median of 20).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from probing.client import ProbeClient

IDLE = "import time\nwhile True: time.sleep(0.5)\n"
WINDOW_S = float(os.environ.get("BENCH_IDLE_S", 10))
TICK = os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(kb / 1024, 1)


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def wait_socket(rt: str, pid: int) -> None:
    path = os.path.join(rt, f"probing-{os.getuid()}", f"{pid}.sock")
    while not os.path.exists(path):
        time.sleep(0.005)


IMPORTS = ("numpy", "pyarrow", "pyarrow.compute", "datafusion", "psutil", "probing.store",
           "probing.engine", "probing.tables", "probing.probe.server")  # fmt: skip
IMPORT_COST = """
import resource, sys, time
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
before = set(sys.modules)
r0, t0 = rss(), time.perf_counter()
__import__(sys.argv[1])
print(rss() - r0, time.perf_counter() - t0, len(set(sys.modules) - before))
"""


def import_costs() -> dict[str, dict[str, float]]:
    """What each import the probe's first query needs costs on its own, in a
    fresh interpreter: RSS added (MB), seconds, modules loaded."""
    out = {}
    for mod in IMPORTS:
        r = subprocess.run([sys.executable, "-c", IMPORT_COST, mod], capture_output=True,
                           text=True, check=True)  # fmt: skip
        mb, s, n = r.stdout.split()
        out[mod] = {"rss_mb": round(float(mb), 1), "ms": round(float(s) * 1e3, 1),
                    "modules": int(n)}  # fmt: skip
    return out


def main() -> None:
    rt = tempfile.mkdtemp(prefix="probing-bench-")
    env = dict(os.environ, PROBING_RUNTIME_DIR=rt)
    env.pop("PROBING", None)
    os.environ["PROBING_RUNTIME_DIR"] = rt
    procs = {
        "no_probe": subprocess.Popen([sys.executable, "-c", IDLE], env=env),
        "idle_probe": subprocess.Popen([sys.executable, "-c", IDLE], env=dict(env, PROBING="1")),
    }
    t0 = time.perf_counter()
    queried = subprocess.Popen([sys.executable, "-c", IDLE], env=dict(env, PROBING="1"))
    procs["probe_after_query"] = queried
    wait_socket(rt, queried.pid)
    client = ProbeClient.for_pid(queried.pid)
    client.query("SELECT count(*) FROM process.threads")
    first_query_s = time.perf_counter() - t0
    lat = []
    for _ in range(20):
        q0 = time.perf_counter()
        client.query("SELECT count(*) FROM process.threads")
        lat.append(time.perf_counter() - q0)
    wait_socket(rt, procs["idle_probe"].pid)
    time.sleep(1.0)
    before = {k: cpu_s(p.pid) for k, p in procs.items()}
    time.sleep(WINDOW_S)
    after = {k: cpu_s(p.pid) for k, p in procs.items()}
    rss = {k: rss_mb(p.pid) for k, p in procs.items()}
    for p in procs.values():
        p.kill()
        p.wait()
    result = {
        "benchmark": "probe_idle",
        "window_s": WINDOW_S,
        "rss_mb": rss,
        "rss_added_mb": {
            "idle_probe": round(rss["idle_probe"] - rss["no_probe"], 1),
            "probe_after_query": round(rss["probe_after_query"] - rss["no_probe"], 1),
        },
        "cpu_s_in_window": {k: round(after[k] - before[k], 3) for k in procs},
        "start_to_first_query_ms": round(first_query_s * 1e3, 1),
        "small_query_ms_median": round(statistics.median(lat) * 1e3, 2),
        "import_costs": import_costs(),
    }
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
