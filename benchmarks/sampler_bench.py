"""What the stack sampler costs a traced step (root; one JSON object).

One process runs training-like steps (a torch MLP forward/backward with
torch's default threads, ~``--work-ms`` of Python work, a ``--sleep-ms``
data-loader sleep) in rounds of three phases, interleaved so the machine's
drift hits each alike: untraced, traced (the gloo family, Python stacks)
with the sampler off (``PROBING_SAMPLE_HZ=0``), and traced with the sampler
on at its default rate (``probing.node.bpf.sampler.SAMPLE_HZ``). Figures: the
median step time of each phase and the per-round step-time differences
(noisy on a busy machine), and the sampler's direct cost per step: the CPU
time of its reading thread plus the kernel time of its BPF programs
(``run_time_ns``, with ``kernel.bpf_stats_enabled`` on for the run), as a
share of the traced step; and what it recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch
from torch import nn

from probing.node.bpf import sampler as smp
from probing.node.bpf.tracer import Tracer
from probing.node.store import Store


def load_batch(ms: float) -> torch.Tensor:
    time.sleep(ms / 1000)
    return torch.randn(64, 512)


def python_work(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def steps(model: nn.Module, n: int, args: argparse.Namespace) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        x = load_batch(args.sleep_ms)
        python_work(args.work_ms)
        model(x).square().mean().backward()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def thread_cpu_s(name: str) -> float:
    """CPU seconds of this process's thread called ``name`` (0 if none)."""
    ids = {t.native_id for t in threading.enumerate() if t.name == name}
    total = 0.0
    for tid in ids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return total


def bpf_run_ns(bpf: object) -> int:
    """Kernel time spent in the sampler's BPF programs so far (``run_time_ns`` of
    each program's fdinfo; counted while ``kernel.bpf_stats_enabled`` is 1)."""
    total = 0
    fds = getattr(bpf, "_progs", {}).values()  # loader.Program: name -> program fd
    for fd in fds:
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                for line in f:
                    if line.startswith("run_time_ns:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


def wait_sampler(tracer: Tracer, timeout: float = 60.0) -> object:
    """The tracer's sampler once it runs (it may start beside the uprobes)."""
    deadline = time.monotonic() + timeout
    while getattr(tracer, "sampler", None) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return getattr(tracer, "sampler", None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60, help="per phase per round")
    p.add_argument("--work-ms", type=float, default=10.0)
    p.add_argument("--sleep-ms", type=float, default=5.0)
    args = p.parse_args()
    stats = "/proc/sys/kernel/bpf_stats_enabled"
    with open(stats) as f:
        stats_before = f.read().strip()
    with open(stats, "w") as f:
        f.write("1")
    try:
        run(args)
    finally:
        with open(stats, "w") as f:
            f.write(stats_before)


def run(args: argparse.Namespace) -> None:
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    steps(model, 10, args)  # warm
    phases: dict[str, list[float]] = {"untraced": [], "traced": [], "traced_sampled": []}
    rounds: list[dict[str, float]] = []
    sampler_cpu = sampled_s = 0.0
    bpf_ns = 0
    sampled_steps = 0
    rows = samples = 0
    for _ in range(args.rounds):
        medians = {}
        for phase in phases:
            tracer = None
            if phase != "untraced":
                os.environ["PROBING_SAMPLE_HZ"] = "0" if phase == "traced" else str(smp.SAMPLE_HZ)
                tracer = Tracer(["gloo"], store=Store())
                tracer.start()
                if phase == "traced_sampled" and wait_sampler(tracer) is None:
                    raise SystemExit(f"the sampler did not start: {tracer.last_error}")
            live = getattr(tracer, "sampler", None)
            bpf0 = bpf_run_ns(live.bpf) if live is not None else 0
            cpu0, t0 = thread_cpu_s("probing-sampler"), time.monotonic()
            got = steps(model, args.steps, args)
            if phase == "traced_sampled" and live is not None:
                sampler_cpu += thread_cpu_s("probing-sampler") - cpu0
                sampled_s += time.monotonic() - t0
                bpf_ns += bpf_run_ns(live.bpf) - bpf0
                sampled_steps += len(got)
            if tracer is not None:
                s = getattr(tracer, "sampler", None)
                if s is not None:
                    s.read()
                    table = s.table.to_arrow()
                    rows += table.num_rows
                    samples += sum(
                        c for k, c in zip(table["kind"].to_pylist(), table["count"].to_pylist(),
                                          strict=True) if k == "cpu"
                    )  # fmt: skip
                tracer.stop()
            phases[phase] += got
            medians[phase] = statistics.median(got)
        rounds.append(medians)
    os.environ.pop("PROBING_SAMPLE_HZ", None)
    cost = [(r["traced_sampled"] - r["traced"]) / r["traced"] for r in rounds]
    traced_ms = statistics.median(phases["traced"])
    # the sampler's own work per step: its reading thread plus its BPF programs (the
    # sched_switch program runs at every context switch of the machine, so this
    # charges the step with what other processes' switches cost too)
    direct_ms = (sampler_cpu * 1000 + bpf_ns / 1e6) / max(sampled_steps, 1)
    print(
        json.dumps(
            {
                "rounds": args.rounds,
                "steps_per_phase": args.steps,
                "sample_hz": smp.SAMPLE_HZ,
                "step_ms_median": {k: round(statistics.median(v), 3) for k, v in phases.items()},
                "sampler_direct_ms_per_step": round(direct_ms, 4),
                "sampler_direct_share_of_traced_step": round(direct_ms / traced_ms, 5),
                "sampler_bpf_ms_per_s": round(bpf_ns / 1e6 / max(sampled_s, 1e-9), 3),
                "step_time_difference_share_median": round(statistics.median(cost), 4),
                "step_time_difference_per_round": [round(c, 4) for c in cost],
                "tracing_cost_share_of_untraced_step": round(
                    statistics.median(
                        [(r["traced"] - r["untraced"]) / r["untraced"] for r in rounds]
                    ),
                    4,
                ),
                "sampler_thread_cpu_ms_per_s": round(1000 * sampler_cpu / max(sampled_s, 1e-9), 3),
                "python_samples_rows": rows,
                "on_cpu_samples": samples,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
