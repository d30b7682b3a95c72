"""Cost of a probe in an idle process, measured side by side; prints JSON.

Three copies of the same idle Python program run at once: without a probe,
with an idle probe (PROBING=1, no query yet) and with a probe that has
answered one query (the node's engine loaded its database). For each: RSS,
and CPU time used over the same 10 s window. Also: time from process start
to the first answered query, the latency of a small query (median of 20),
and what each step of a job's probe start and first query adds to the job
(RSS, time, packages).
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

from probing.cli.client import ProbeClient

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


# what a job loads, in the order it loads it: the package (the .pth hook),
# its guest serving and handed to the node's engine (PROBING=1 / inject /
# probing.enable), then its first query, answered by the engine
IMPORT_STEPS = (
    ("probing", "import probing"),
    ("serving (probing.enable)", "probing.enable()"),
    ("first query (probing.query)", "probing.query('SELECT pid FROM process.info')"),
)
# the engine's, never loaded into the job by any step above
DEFERRED = ("numpy", "pyarrow", "datafusion", "probing.node", "probing.analyze")
IMPORT_COST = """
import json, resource, sys, time
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
out = []
for label, code in json.loads(sys.argv[1]):
    before = set(sys.modules)
    r0, t0, c0 = rss(), time.perf_counter(), time.process_time()
    exec(code)
    new = set(sys.modules) - before
    tops = sorted({m.split(".")[0] for m in new} - set(sys.stdlib_module_names) - {"probing"})
    tops = [t for t in tops if not t.startswith("_")] + sorted({"ssl"} & new)
    out.append([label, rss() - r0, time.perf_counter() - t0, time.process_time() - c0,
                len(new), tops[:12]])
extra = sorted(m for m in ("elftools", "psutil", "typer", "bcc") + DEFERRED if m in sys.modules)
print(json.dumps([out, extra]))
import probing; probing.disable()
"""


def import_costs(root: str | None = None) -> dict[str, object]:
    """What each step of a job's probe start and first query adds to the job,
    in one fresh interpreter, in the order it takes them: RSS (MB), wall and
    CPU ms, modules, and the top-level packages new in that step; and which
    of the engine's modules (``DEFERRED``) the job holds after them (none).
    ``root``: the checkout to import probing from (None: this one)."""
    env = dict(os.environ, PYTHONPATH=root or os.path.join(os.path.dirname(__file__), ".."))
    code = IMPORT_COST.replace("DEFERRED", repr(DEFERRED))
    r = subprocess.run(
        [sys.executable, "-c", code, json.dumps(IMPORT_STEPS)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=tempfile.gettempdir(),
    )  # fmt: skip - no checkout in the cwd
    steps, loaded = json.loads(r.stdout)
    table = {
        label: {
            "rss_mb": round(mb, 1),
            "ms": round(s * 1e3, 1),
            "cpu_ms": round(c * 1e3, 1),
            "modules": n,
            "packages": tops,
        }  # fmt: skip
        for label, mb, s, c, n, tops in steps
    }
    return {
        "steps": table,
        "total_rss_mb": round(sum(v["rss_mb"] for v in table.values()), 1),  # type: ignore[misc]
        "total_ms": round(sum(v["ms"] for v in table.values()), 1),  # type: ignore[misc]
        "total_cpu_ms": round(sum(v["cpu_ms"] for v in table.values()), 1),  # type: ignore[misc]
        "engine_modules_in_the_job": loaded,
    }


def import_costs_side_by_side(rounds: int = 5) -> dict[str, object]:
    """``import_costs`` of this checkout and, with ``BENCH_BASELINE_PATH``
    (an older checkout's root), of that one, interleaved; per step the
    median of ``rounds`` fresh interpreters."""
    roots = {"now": None}
    if os.environ.get("BENCH_BASELINE_PATH"):
        roots["baseline"] = os.environ["BENCH_BASELINE_PATH"]
    runs: dict[str, list[dict[str, object]]] = {k: [] for k in roots}
    for _ in range(rounds):
        for name, root in roots.items():
            runs[name].append(import_costs(root))
    out: dict[str, object] = {"rounds": rounds, "loadavg": os.getloadavg()}
    for name, results in runs.items():
        steps = results[0]["steps"]
        out[name] = {
            "steps_median": {
                label: {
                    k: statistics.median(r["steps"][label][k] for r in results)  # type: ignore[index]
                    for k in ("ms", "cpu_ms", "rss_mb")
                }  # fmt: skip
                for label in steps  # type: ignore[union-attr]
            },
            "total_ms_median": statistics.median(r["total_ms"] for r in results),  # type: ignore[misc]
            "total_cpu_ms_median": statistics.median(r["total_cpu_ms"] for r in results),  # type: ignore[misc]
            "engine_modules_in_the_job": results[0]["engine_modules_in_the_job"],
        }
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
        "import_costs": import_costs_side_by_side(),
    }
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
