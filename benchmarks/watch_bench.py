"""The always-on detector: how fast it names a slowed rank, what it costs,
and whether a healthy job gets a finding (root; one JSON object).

A 4-rank Gloo job (probing's own environment, ``PROBING=1``, torch's default
threads; each step 20 ms of sleep and an all-reduce) is started twice: with
the detector off (``PROBING_DETECT_S=0``) and on (every 5 s). Each time:
untraced for ``--phase`` s, then ``probing trace --cluster --background``
and ``--healthy`` s healthy (``--off-healthy`` with the detector off; every
finding written counted), then one rank,
drawn at random, sleeps 60 ms more a step: the time until
``analyze.findings`` names it. CPU is each process's user + system time
over a phase, per rank per second: the ranks' (untraced, traced) and the
node's engine's (where the probes and the detector run). ``--noise`` adds
two spinning processes on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probing.cli.client import ProbeClient  # noqa: E402
from probing.cli.demo import free_port  # noqa: E402

WORLD = 4
TOKEN = "bench-token"
JOB = (Path(__file__).resolve().parents[1] / "tests" / "jobs" / "slowable.py").read_text()


def cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def engines(runtime: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            cmd = p.info["cmdline"] or []
            env = p.info["environ"] or {}
        except psutil.Error:
            continue
        if "probing.node.service" in cmd and env.get("PROBING_RUNTIME_DIR") == runtime:
            out.append(p.pid)
    return out


def per_rank_s(pids: list[int], seconds: float) -> float:
    """CPU per rank per second of ``pids`` over ``seconds``."""
    before = cpu_s(pids)
    time.sleep(seconds)
    return round((cpu_s(pids) - before) / seconds / WORLD, 4)


def findings(pid: int) -> list[dict]:  # type: ignore[type-arg]
    return ProbeClient.for_pid(pid).query("SELECT kind, rank, ts FROM analyze.findings").to_pylist()


def one(detect_s: float, phase: float, healthy: float, slow: int) -> dict:  # type: ignore[type-arg]
    runtime = tempfile.mkdtemp(prefix="watch-bench-")
    os.environ["PROBING_RUNTIME_DIR"] = runtime  # where this script and the CLI find the probes
    flag = Path(runtime) / "slow"
    port = free_port()
    procs = []
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PROBING", "RANK"))}
    for r in range(WORLD):
        env = dict(base, PROBING="1", PROBING_RUNTIME_DIR=runtime, PROBING_TOKEN=TOKEN,
                   PROBING_DETECT_S=str(detect_s), RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   SLOW_RANK=str(slow), SLOW_FILE=str(flag))  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-c", JOB], env=env))
    pids = [p.pid for p in procs]
    out: dict = {"detect_s": detect_s, "slow_rank": slow}  # type: ignore[type-arg]
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if all(
                    ProbeClient.for_pid(p).health().get("cluster", {}).get("addr") for p in pids
                ):
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the job's probes never joined\n")
            time.sleep(0.5)
        time.sleep(3)  # past start-up
        out["ranks_cpu_untraced"] = per_rank_s(pids, phase)
        r = subprocess.run([sys.executable, "-m", "probing", "trace", "--pid", str(pids[0]),
                            "--cluster", "--background", "--no-nccl", "--no-cuda"],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        if r.returncode:
            raise SystemExit(f"trace --cluster failed: {r.stdout}{r.stderr}")
        eng = engines(runtime)
        t0 = cpu_s(pids), cpu_s(eng)
        time.sleep(healthy)
        t1 = cpu_s(pids), cpu_s(eng)
        out["ranks_cpu_traced"] = round((t1[0] - t0[0]) / healthy / WORLD, 4)
        out["engine_cpu_per_rank"] = round((t1[1] - t0[1]) / healthy / WORLD, 4)
        out["healthy_s"] = healthy
        out["healthy_findings"] = findings(pids[0])
        if detect_s:
            flag.touch()
            start = time.monotonic()
            while not any(f["kind"] == "straggler" for f in findings(pids[0])):
                if time.monotonic() - start > 120:
                    out["latency_s"] = None
                    break
                time.sleep(0.25)
            else:
                out["latency_s"] = round(time.monotonic() - start, 2)
            out["named"] = [f["rank"] for f in findings(pids[0]) if f["kind"] == "straggler"]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", type=float, default=20.0, help="untraced seconds measured")
    ap.add_argument("--healthy", type=float, default=60.0, help="traced healthy seconds")
    ap.add_argument(
        "--off-healthy", type=float, default=60.0, help="the same, detector off (CPU baseline)"
    )
    ap.add_argument("--runs", type=int, default=1, help="slowdowns timed (detector on)")
    ap.add_argument("--noise", action="store_true", help="two spinning processes too")
    args = ap.parse_args()
    hogs = []
    if args.noise:
        spin = [sys.executable, "-c", "while True: pass"]
        hogs = [subprocess.Popen(spin) for _ in range(2)]
    try:
        off = one(0, args.phase, args.off_healthy, random.randrange(WORLD))
        on = [one(5, args.phase, args.healthy, random.randrange(WORLD)) for _ in range(args.runs)]
    finally:
        for h in hogs:
            h.kill()
    lat = [r["latency_s"] for r in on if r.get("latency_s") is not None]
    print(json.dumps({
        "noise": args.noise, "detector_off": off, "detector_on": on,
        "latency_s": {"runs": len(on), "named_right": sum(r["named"] == [r["slow_rank"]]
                                                          for r in on),
                      "max": max(lat, default=None), "min": min(lat, default=None)},
        "detector_cpu_per_rank": round(
            sum(r["engine_cpu_per_rank"] for r in on) / len(on) - off["engine_cpu_per_rank"], 4),
        "healthy_findings": sum(len(r["healthy_findings"]) for r in on),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
