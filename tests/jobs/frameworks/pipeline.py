"""A pipeline-parallel job (``torch.distributed.pipelining``): 4 stages, GPipe.

    torchrun --nproc-per-node 4 pipeline.py

Rank r holds stage r of a 5-layer MLP (a manual split); ``ScheduleGPipe``
runs 4 microbatches a step, and the stages pass activations and gradients by
send/recv on Gloo. The loss is computed at the last stage (rank 3). The user's
code is ``stage_work``, called in each stage's forward, once per microbatch.
Environment: ``STEPS`` (20; 0 runs until killed), ``SLOW_RANK``, ``SLOW_MS``
and ``SLOW_KIND`` (``sleep``: off CPU, ``cpu``: a busy loop) slow it on one
stage (by 4 x SLOW_MS a step: once per microbatch), ``LOSS_FILE`` gets
``step <n> loss <mean over microbatches>`` lines from the last stage, the
only one with a loss (``{rank}`` in the name becomes 3). Each rank prints
``ready rank=<r> pid=<pid>`` once its process group is up. ``HANG_RANK``
stops for good in ``stage_work`` once the file ``HANG_FILE`` exists.
With ``ACCURACY_TRUTH`` set, each rank records its steps and the time it spent
slowed for ``benchmarks/accuracy.py`` (``truth.py``), slowed from step
``ONSET_STEP`` (0: from the start).
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from truth import TRUTH

STEPS = int(os.environ.get("STEPS", "20"))
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_MS = float(os.environ.get("SLOW_MS", "0"))
SLOW_KIND = os.environ.get("SLOW_KIND", "sleep")
RANK = int(os.environ.get("RANK", "0"))
HANG_RANK = int(os.environ.get("HANG_RANK", "-1"))
HANG_FILE = os.environ.get("HANG_FILE", "")
STAGES, DIM = 4, 256


def stage_work(x: torch.Tensor) -> torch.Tensor:
    """The user's per-stage code: slowed by SLOW_MS on SLOW_RANK; stuck for
    good on HANG_RANK once the file HANG_FILE exists (its neighbours wait)."""
    while RANK == HANG_RANK and HANG_FILE and os.path.exists(HANG_FILE):
        time.sleep(1)
    if RANK == SLOW_RANK and SLOW_MS > 0 and TRUTH.slowing():
        began = time.perf_counter()
        if SLOW_KIND == "cpu":
            end = time.perf_counter() + SLOW_MS / 1000
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(SLOW_MS / 1000)
        TRUTH.spent(began)
    return torch.relu(x)


class Stage(nn.Module):
    def __init__(self, last: bool) -> None:
        super().__init__()
        self.body = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 16) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = stage_work(self.body(x))
        return self.head(x) if self.head else x


def main() -> None:
    dist.init_process_group("gloo")
    sys.stdout.write(f"ready rank={RANK} pid={os.getpid()}\n")
    sys.stdout.flush()
    TRUTH.start(RANK)
    last = RANK == STAGES - 1
    name = os.environ.get("LOSS_FILE", "")
    out = open(name.replace("{rank}", str(RANK)), "w", buffering=1) if name and last else None
    torch.manual_seed(0)
    model = [Stage(i == STAGES - 1) for i in range(STAGES)]  # the whole model, split
    stage = PipelineStage(model[RANK], RANK, STAGES, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=nn.functional.cross_entropy)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.05)
    for step in range(1, STEPS + 1) if STEPS else itertools.count(1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, DIM, generator=g), torch.randint(0, 16, (32,), generator=g)
        opt.zero_grad()
        if RANK == 0:
            schedule.step(x)
        elif last:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses)
            if out:
                out.write(f"step {step} loss {torch.stack(losses).mean().item()!r}\n")
        else:
            schedule.step()
        opt.step()
        TRUTH.step_end()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
