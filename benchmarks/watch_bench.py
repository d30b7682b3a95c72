"""The always-on detector: how fast it names a slowed rank, what it costs,
and whether a healthy job gets a finding; today's detector and the one in
this tree, in the same run (root; one JSON object).

A 4-rank Gloo job (probing's own environment, ``PROBING=1``, torch's default
threads; each step 20 ms of sleep and an all-reduce) under each detector:
``new``, this tree's, at its default period; ``old``, the one of
``--baseline`` (a commit; by default the last before issue 40's faster
detection), every 5 s as it was: the job runs this tree with that commit's
``probing/analyze/`` put in place of this tree's and its detector made by the
engine (a copy of ``probing/`` first on the job's and its engine's
``PYTHONPATH``: ``overlay``); ``off``
(``PROBING_DETECT_S=0``), the CPU baseline.

CPU (``--cpu-runs`` times): one job of each, side by side (the same load on
them all), traced by ``probing trace --cluster --background``, healthy for
``--healthy`` s: each engine's user + system time per rank per second (the
probes, the tracing and the detector run there; the detector's is its
engine's minus the ``off`` one's), and the ranks'. Latency (``--runs``
times each, alternating): a job alone, traced, healthy for ``--settle`` s
and a random part of 5 s (every finding written counted), then one rank,
drawn at random, sleeps 60 ms more a step: the time until
``analyze.findings`` names it (asked every ``POLL_S``).

``--noisy S``: at the end, one job of each detector side by side, ``S`` s
healthy, with two spinning processes on this machine: every finding
counted. ``--noise`` adds the spinning processes to the timed runs too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from probing.cli.client import ProbeClient  # noqa: E402
from probing.cli.demo import free_port  # noqa: E402

WORLD = 4
TOKEN = "bench-token"
JOB = (ROOT / "tests" / "jobs" / "slowable.py").read_text()
BASELINE = "2828ba5726ed7ff2655e15f7cacb753419782217"  # the last watch.py before issue 40's
OLD_PERIOD_S = 5.0  # PROBING_DETECT_S then
POLL_S = 0.1  # how often the bench asks analyze.findings
USED_PORTS: set[int] = set()


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


def findings(pid: int) -> list[dict[str, Any]]:
    sql = "SELECT kind, rank, ts, cleared_ns FROM analyze.findings"
    rows: list[dict[str, Any]] = ProbeClient.for_pid(pid).query(sql).to_pylist()
    return rows


def overlay(ref: str) -> str:
    """A copy of this tree's ``probing/`` with ``ref``'s detector in it: the
    directory to put first on ``PYTHONPATH``. ``ref``'s detector is its
    ``probing/analyze/watch.py``, over its ``probing/analyze/`` (copied over
    this tree's); this tree's engine makes the one that
    ``probing/node/detector/watch.py`` names, pointed at it."""
    where = tempfile.mkdtemp(prefix="watch-bench-old-")
    shutil.copytree(ROOT / "probing", Path(where) / "probing",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    old = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "probing/analyze"],
                         capture_output=True, check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", where], input=old, check=True)
    (Path(where) / "probing" / "node" / "detector" / "watch.py").write_text(
        f'"""The detector of {ref}."""\n\nfrom probing.analyze.watch import Watch  # noqa: F401\n'
    )
    return where


class Job:
    """A 4-rank slowable job under one detector: ``settings`` are its
    ``PROBING_*`` (and ``PYTHONPATH``) beside the usual."""

    def __init__(self, settings: dict[str, str]) -> None:
        self.runtime = tempfile.mkdtemp(prefix="watch-bench-")
        self.flag = Path(self.runtime) / "slow"
        self.slow = random.randrange(WORLD)
        port = free_port()
        while port in USED_PORTS:  # a port another job of this run was given
            port = free_port()
        USED_PORTS.add(port)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PROBING", "RANK"))}
        self.procs = []
        for r in range(WORLD):
            env = dict(base, PROBING="1", PROBING_RUNTIME_DIR=self.runtime, PROBING_TOKEN=TOKEN,
                       RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SLOW_RANK=str(self.slow),
                       SLOW_FILE=str(self.flag), **settings)  # fmt: skip
            self.procs.append(subprocess.Popen([sys.executable, "-c", JOB], env=env))
        self.pids = [p.pid for p in self.procs]
        self.engines: list[int] = []

    def client_env(self) -> None:
        os.environ["PROBING_RUNTIME_DIR"] = self.runtime  # where the CLI and clients look

    def joined(self, timeout: float = 180.0) -> None:
        self.client_env()
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(
                    ProbeClient.for_pid(p).health().get("cluster", {}).get("addr")
                    for p in self.pids
                ):
                    return
            except Exception:  # not up yet
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the job's probes never joined\n")
            time.sleep(0.5)

    def trace(self) -> None:
        self.client_env()
        r = subprocess.run([sys.executable, "-m", "probing", "trace", "--pid", str(self.pids[0]),
                            "--cluster", "--background", "--no-nccl", "--no-cuda"],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        if r.returncode:
            raise SystemExit(f"trace --cluster failed: {r.stdout}{r.stderr}")
        self.engines = engines(self.runtime)

    def findings(self) -> list[dict[str, Any]]:
        self.client_env()
        return findings(self.pids[0])

    def kill(self) -> None:
        """The ranks, then the job's engine (else it keeps what they left
        ``PROBING_KEEP_DEAD_S``, using CPU beside the next runs)."""
        for p in self.procs:
            p.kill()
            p.wait()
        for pid in engines(self.runtime):
            try:
                psutil.Process(pid).terminate()
            except psutil.Error:
                pass


def one(settings: dict[str, str], settle: float) -> dict[str, Any]:
    """A job under ``settings``, traced: the findings of ``settle`` s healthy,
    then the time to name its slowed rank."""
    job = Job(settings)
    out: dict[str, Any] = {"slow_rank": job.slow}
    try:
        job.joined()
        job.trace()
        # at a random point of the old detector's 5 s (and the new one's looks)
        time.sleep(settle + random.uniform(0, OLD_PERIOD_S))
        out["healthy_findings"] = job.findings()
        job.flag.touch()
        onset_ns, start = time.time_ns(), time.monotonic()
        while not any(f["kind"] == "straggler" for f in job.findings()):
            if time.monotonic() - start > 120:
                out["latency_s"] = None
                break
            time.sleep(POLL_S)
        else:
            out["latency_s"] = round(time.monotonic() - start, 2)
        out["load_avg_1m"] = round(os.getloadavg()[0], 1)
        named = [f for f in job.findings() if f["kind"] == "straggler"]
        out["named"] = [f["rank"] for f in named]
        # when the detection that wrote it began (the poll's delay left out)
        out["detected_s"] = round((named[0]["ts"] - onset_ns) / 1e9, 2) if named else None
    finally:
        job.kill()
    return out


def calls(job: Job, t0: int, t1: int) -> int:
    """The collectives ``job``'s ranks traced between wall ns ``t0`` and ``t1``."""
    job.client_env()
    sql = f"SELECT count(*) AS n FROM comm.collectives WHERE ts >= {t0} AND ts < {t1}"
    return sum(int(ProbeClient.for_pid(p).query(sql)["n"][0].as_py()) for p in job.pids)


def cpu(settings: dict[str, dict[str, str]], healthy: float) -> dict[str, Any]:
    """One job of each detector side by side (started in a random order),
    traced, ``healthy`` s: each engine's CPU and the ranks', per rank per
    second, and the collectives traced per rank per second."""
    jobs: dict[str, Job] = {}
    names = random.sample(list(settings), len(settings))
    try:
        for name in names:  # one at a time: each up before the next starts
            jobs[name] = Job(settings[name])
            jobs[name].joined()
        for job in jobs.values():
            job.trace()
        time.sleep(3)  # past the trace's start
        pids = {n: (job.pids, job.engines) for n, job in jobs.items()}
        t0 = {n: (cpu_s(r), cpu_s(e)) for n, (r, e) in pids.items()}
        w0 = time.time_ns()
        time.sleep(healthy)
        t1 = {n: (cpu_s(r), cpu_s(e)) for n, (r, e) in pids.items()}
        w1 = time.time_ns()
        out: dict[str, Any] = {"load_avg_1m": round(os.getloadavg()[0], 1), "order": names}
        for n in jobs:
            out[n] = {
                "ranks": round((t1[n][0] - t0[n][0]) / healthy / WORLD, 4),
                "engine": round((t1[n][1] - t0[n][1]) / healthy / WORLD, 4),
                "calls": round(calls(jobs[n], w0, w1) / healthy / WORLD, 1),
                "findings": len(jobs[n].findings()),
            }
        return out
    finally:
        for job in jobs.values():
            job.kill()


def noisy(settings: dict[str, dict[str, str]], seconds: float) -> dict[str, Any]:
    """One job of each detector side by side, ``seconds`` healthy: their findings."""
    jobs: dict[str, Job] = {}
    try:
        for name, s in settings.items():
            jobs[name] = Job(s)
            jobs[name].joined()
        for job in jobs.values():
            job.trace()
        time.sleep(seconds)
        return {
            name: {"findings": job.findings(), "load_avg_1m": round(os.getloadavg()[0], 1)}
            for name, job in jobs.items()
        }
    finally:
        for job in jobs.values():
            job.kill()


def summary(runs: list[dict[str, Any]], cpus: list[dict[str, Any]], name: str) -> dict[str, Any]:
    lat = sorted(r["latency_s"] for r in runs if r.get("latency_s") is not None)
    det = sorted(r["detected_s"] for r in runs if r.get("detected_s") is not None)
    costs = sorted(c[name]["engine"] - c["off"]["engine"] for c in cpus)
    # the tracing's cost goes with the collectives traced: the off engine's per call
    scaled = sorted(
        c[name]["engine"] - c["off"]["engine"] * c[name]["calls"] / c["off"]["calls"]
        for c in cpus
        if c["off"]["calls"]
    )
    return {
        "runs": len(runs),
        "named_right": sum(r.get("named") == [r["slow_rank"]] for r in runs),
        "named_after_onset_s": {
            "median": round(statistics.median(lat), 2) if lat else None,
            "min": lat[0] if lat else None,
            "max": lat[-1] if lat else None,
            "all": lat,
        },
        "detection_began_after_onset_s": det,
        "detector_cpu_per_rank": round(statistics.median(costs), 4) if costs else None,
        "detector_cpu_per_rank_all": [round(c, 4) for c in costs],
        "detector_cpu_per_rank_per_call": round(statistics.median(scaled), 4) if scaled else None,
        "detector_cpu_per_rank_per_call_all": [round(c, 4) for c in scaled],
        "healthy_findings": sum(len(r["healthy_findings"]) for r in runs),
        "load_avg_1m": [r["load_avg_1m"] for r in runs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--healthy", type=float, default=60.0, help="seconds of each CPU run")
    ap.add_argument("--cpu-runs", type=int, default=3, help="CPU runs (each detector side by side)")
    ap.add_argument("--runs", type=int, default=10, help="slowdowns timed, per detector")
    ap.add_argument("--settle", type=float, default=20.0, help="healthy seconds before each")
    ap.add_argument("--detectors", default="old,new", help="old, new or both (old,new)")
    ap.add_argument("--baseline", default=BASELINE, help="the commit of the old detector")
    ap.add_argument("--noisy", type=float, default=0.0, help="healthy noisy seconds at the end")
    ap.add_argument("--noise", action="store_true", help="two spinning processes in the runs too")
    args = ap.parse_args()
    names = [n for n in args.detectors.split(",") if n]
    settings: dict[str, dict[str, str]] = {"off": {"PROBING_DETECT_S": "0"}, "new": {}}
    if "old" in names:
        path = overlay(args.baseline)
        settings["old"] = {"PYTHONPATH": path, "PROBING_ENGINE_ENV": "PYTHONPATH",
                           "PROBING_DETECT_S": str(OLD_PERIOD_S)}  # fmt: skip
    spin = [sys.executable, "-c", "while True: pass"]
    hogs = [subprocess.Popen(spin) for _ in range(2)] if args.noise else []
    out: dict[str, Any] = {"noise": args.noise, "baseline": args.baseline, "cpus": os.cpu_count()}
    try:
        cpus = []
        for _ in range(args.cpu_runs):
            cpus.append(cpu({n: settings[n] for n in ["off", *names]}, args.healthy))
            print("cpu", json.dumps(cpus[-1]), file=sys.stderr, flush=True)
        out["cpu_runs"] = cpus
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for _ in range(args.runs):
            for n in names:  # alternating: both under the same load
                runs[n].append(one(settings[n], args.settle))
                print(n, json.dumps(runs[n][-1]), file=sys.stderr, flush=True)
        for n in names:
            out[n] = {"summary": summary(runs[n], cpus, n), "runs": runs[n]}
    finally:
        for h in hogs:
            h.kill()
    if args.noisy:
        hogs = [subprocess.Popen(spin) for _ in range(2)]
        try:
            found = noisy({n: settings[n] for n in names}, args.noisy)
        finally:
            for h in hogs:
                h.kill()
        out["noisy_healthy"] = {"seconds": args.noisy, **found}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
