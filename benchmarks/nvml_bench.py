"""CPU cost of NVML sampling at 10 Hz and 100 Hz, beside a probe that does not sample.

Runs pynvml's real code path against the stand-in libnvidia-ml.so.1 the
tests build (tests/fixtures/fake_nvml.c, 2 GPUs, every counter answered),
or against the real driver when this machine has one (BENCH_REAL_NVML=1).
Three idle processes side by side; CPU (user+system) over the same window.
Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from probing.cli.client import ProbeClient

REPO = Path(__file__).resolve().parent.parent
WINDOW_S = 10.0
IDLE = "import time\nwhile True: time.sleep(1)\n"


def build_standin(d: str) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("needs a C compiler (make setup installs gcc)")
    src = REPO / "tests" / "fixtures" / "fake_nvml.c"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", f"{d}/libnvidia-ml.so.1", str(src)],
                   check=True)  # fmt: skip
    return d


def main() -> None:
    real = os.environ.get("BENCH_REAL_NVML") == "1"
    with tempfile.TemporaryDirectory() as d:
        os.environ["PROBING_RUNTIME_DIR"] = d  # where the targets' probes listen
        env = dict(os.environ, PROBING="1")
        if not real:
            env["LD_LIBRARY_PATH"] = build_standin(d)
        procs = {}
        for label, interval in (("no sampling", None), ("10 Hz", "100ms"), ("100 Hz", "10ms")):
            e = dict(env, **({"PROBING_NVML_INTERVAL": interval} if interval else {}))
            procs[label] = subprocess.Popen([sys.executable, "-c", IDLE], env=e)
        try:
            time.sleep(3)  # probes up, pynvml loaded, first samples taken
            ps = {k: psutil.Process(p.pid) for k, p in procs.items()}
            samples0 = {k: _samples(p.pid) for k, p in procs.items()}  # loads the engine
            time.sleep(1)
            samples0 = {k: _samples(p.pid) for k, p in procs.items()}
            before = {k: sum(p.cpu_times()[:2]) for k, p in ps.items()}
            time.sleep(WINDOW_S)
            after = {k: sum(p.cpu_times()[:2]) for k, p in ps.items()}
            samples1 = {k: _samples(p.pid) for k, p in procs.items()}
        finally:
            for p in procs.values():
                p.kill()
                p.wait()
    out = {"benchmark": "nvml", "library": "real" if real else "stand-in", "window_s": WINDOW_S}
    for k in procs:
        cpu = after[k] - before[k]
        n = samples1[k] - samples0[k]
        out[k] = {
            "cpu_pct_of_one_core": round(100 * cpu / WINDOW_S, 2),
            "samples": n,
            "rate_hz": round(n / WINDOW_S, 1),
            "cpu_us_per_sample": round(cpu / n * 1e6, 1) if n else None,
        }
    print(json.dumps(out, indent=1))


def _samples(pid: int) -> int:
    deadline = time.monotonic() + 10
    while True:
        try:
            rows = ProbeClient.for_pid(pid).query("SELECT samples FROM nvml.status")
            return rows.column(0)[0].as_py()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


if __name__ == "__main__":
    main()
