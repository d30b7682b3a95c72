"""What the stack sampler costs a traced step (root; one JSON object).

One process runs training-like steps (a torch MLP forward/backward with
torch's default threads, ~``--work-ms`` of Python work, a ``--sleep-ms``
data-loader sleep) in rounds of three phases, interleaved so the machine's
drift hits each alike: untraced, traced (the gloo family, Python stacks)
with the sampler off (``PROBING_SAMPLE_HZ=0``), and traced with the sampler
on at its default rate (``probing.bpf.sampler.SAMPLE_HZ``). Figures: the
median step time of each phase, the sampler's cost as a share of the traced
step (median of the per-round differences), the CPU time of the sampler's
thread per second, and what it recorded (rows, samples, stacks).
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

from probing.bpf import sampler as smp
from probing.bpf.tracer import Tracer
from probing.store import Store


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60, help="per phase per round")
    p.add_argument("--work-ms", type=float, default=10.0)
    p.add_argument("--sleep-ms", type=float, default=5.0)
    args = p.parse_args()
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    steps(model, 10, args)  # warm
    phases: dict[str, list[float]] = {"untraced": [], "traced": [], "traced_sampled": []}
    rounds: list[dict[str, float]] = []
    sampler_cpu = sampled_s = 0.0
    rows = samples = 0
    for _ in range(args.rounds):
        medians = {}
        for phase in phases:
            tracer = None
            if phase != "untraced":
                os.environ["PROBING_SAMPLE_HZ"] = "0" if phase == "traced" else str(smp.SAMPLE_HZ)
                tracer = Tracer(["gloo"], store=Store())
                tracer.start()
            cpu0, t0 = thread_cpu_s("probing-sampler"), time.monotonic()
            got = steps(model, args.steps, args)
            if phase == "traced_sampled":
                sampler_cpu += thread_cpu_s("probing-sampler") - cpu0
                sampled_s += time.monotonic() - t0
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
    print(
        json.dumps(
            {
                "rounds": args.rounds,
                "steps_per_phase": args.steps,
                "sample_hz": smp.SAMPLE_HZ,
                "step_ms_median": {k: round(statistics.median(v), 3) for k, v in phases.items()},
                "sampler_cost_share_of_traced_step": round(statistics.median(cost), 4),
                "sampler_cost_per_round": [round(c, 4) for c in cost],
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
