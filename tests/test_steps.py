"""The job's step from the pattern its collectives repeat (``probing.analyze.steps``),
on synthetic jobs of the shapes users run: DDP's buckets, gradient
accumulation, FSDP's gathers and reduce-scatters per layer, Megatron's TP,
DP and PP groups, an evaluation every N steps, a pipeline's transfers; each
generated with its true step, under jitter and a noisy step length."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from probing.analyze import steps as st
from probing.analyze.collectives import Collective

T0 = 1_763_880_000 * 10**9

Call = tuple[str, int, float]  # (op, bytes, ms into the step)


def job(
    pattern: Sequence[Call], step_ms: float, *, steps: int = 40, seed: int = 0,
    noise: float = 0.1, comm: str = "gloo/pg0", ranks: int = 4,
    extra: dict[int, Sequence[Call]] | None = None,
) -> tuple[list[Collective], float]:  # fmt: skip
    """``steps`` steps issuing ``pattern`` each (and ``extra[k]`` after step k's);
    a step's length varies by ``noise`` (its data, the machine) at its start,
    each arrival by 0.3 ms; the true median step (ms)."""
    rng = np.random.default_rng(seed)
    out, seq, t, lengths = [], 0, float(T0), []
    for k in range(steps):
        wait = abs(rng.normal(0, noise * step_ms))  # the next batch, the optimizer
        calls = [*pattern, *(extra or {}).get(k, ())]
        for op, nbytes, at in calls:
            ts = {r: int(t + (wait + at + abs(rng.normal(0, 0.3))) * 1e6) for r in range(ranks)}
            end = max(ts.values()) + 200_000
            out.append(Collective(comm, seq, op, ranks, nbytes, ts, dict.fromkeys(ts, end)))
            seq += 1
        length = step_ms + wait + max(at for _, _, at in calls) - max(at for _, _, at in pattern)
        lengths.append(length)
        t += length * 1e6
    return out, float(np.median(lengths))


DDP_2 = [("allreduce", 1 << 20, 60.0), ("allreduce", 5 << 20, 61.0)]
DDP_EQUAL = [("allreduce", 25 << 20, 60.0 + 2 * i) for i in range(5)]
FSDP = (
    [("allgather", 1 << 20, 4.0 * i) for i in range(4)]
    + [("allgather", 1 << 20, 30.0 + 8 * i) for i in range(4)]
    + [("reducescatter", 4 << 20, 33.0 + 8 * i) for i in range(4)]
)


@pytest.mark.parametrize(
    "name, pattern, period",
    [
        ("one all-reduce a step", [("allreduce", 4096, 50.0)], 1),
        ("DDP's two buckets", DDP_2, 2),
        ("five buckets of one size", DDP_EQUAL, 5),
        ("FSDP: 4 layers' gathers and reduce-scatters", FSDP, 12),
    ],
)
@pytest.mark.parametrize("seed", range(3))
def test_the_period_is_the_patterns_and_the_step_its_time(
    name: str, pattern: list[Call], period: int, seed: int
) -> None:
    cs, truth = job(pattern, 110.0, seed=seed)
    found = st.find(cs)
    assert found.job is not None, name
    assert found.job.period == period, name
    assert abs(found.job.ms - truth) < 0.1 * truth, (name, found.job.ms, truth)


def test_gradient_accumulation_steps_at_the_optimizer() -> None:
    # 4 micro-batches of 30 ms, the buckets all-reduced after the 4th only
    cs, truth = job([("allreduce", 1 << 20, 118.0), ("allreduce", 5 << 20, 119.0)], 125.0)
    assert st.find(cs).job.period == 2  # type: ignore[union-attr]
    assert abs(st.find(cs).job.ms - truth) < 0.1 * truth  # type: ignore[union-attr]


def test_an_evaluation_every_n_steps_moves_the_step_little() -> None:
    # every 10th step evaluates: 200 ms more, and an all-reduce of its metric
    evals = {k: [("allreduce", 8, 300.0)] for k in range(9, 40, 10)}
    cs, _ = job(DDP_2, 100.0, extra=evals, seed=4)
    step = st.find(cs).job
    assert step is not None and step.period == 2
    assert abs(step.ms - 100.0) < 15.0  # the median step is the training step's


def test_megatrons_groups_agree_on_the_step() -> None:
    # TP: 20 alike all-reduces evenly spaced, DP: the gradient buckets, both one
    # 180 ms step; a third group syncs only every 5 steps (a checkpoint's barrier)
    tp, truth = job([("allreduce", 1 << 16, 3.0 * i) for i in range(20)], 180.0,
                    comm="gloo/pg1", noise=0.02)  # fmt: skip
    dp, _ = job(DDP_2, 180.0, comm="gloo/pg2", noise=0.02)
    chore, _ = job([("barrier", 0, 0.0)], 900.0, steps=8, comm="gloo/pg3", noise=0.02)
    step = st.find([*tp, *dp, *chore]).job
    assert step is not None and abs(step.ms - truth) < 0.1 * truth, step


def test_a_pipelines_transfers_give_its_step() -> None:
    # a middle stage's 1F1B schedule of 4 microbatches: recv/send forward, then back
    rows, t = [], T0
    rng = np.random.default_rng(1)
    for _ in range(30):
        for m in range(4):
            for op, peer, at in (("recv", 0, 0.0), ("send", 2, 6.0), ("recv", 2, 14.0),
                                 ("send", 0, 22.0)):  # fmt: skip
                ts = int(t + (30 * m + at + abs(rng.normal(0, 0.3))) * 1e6)
                rows.append({"rank": 1, "op": op, "peer": peer, "bytes": 4096, "ts": ts})
        t += 160e6  # 4 x 30 ms of microbatches, 40 ms of flush and optimizer
    step = st.find(st.of_transfers(rows)).job
    assert step is not None and step.period == 16 and abs(step.ms - 160.0) < 16.0


def test_nothing_repeated_is_no_step() -> None:
    cs, _ = job([("allreduce", 4096, 50.0)], 100.0, steps=4)
    assert st.find(cs).job is None  # fewer than MIN_STEPS periods of two
    assert st.find([]).job is None
