"""A DeepSpeed job: ZeRO stage 1, 2 or 3 on CPU over Gloo, 4 ranks.

    torchrun --nproc-per-node 4 deepspeed_job.py --zero 2
    deepspeed --num_gpus 4 deepspeed_job.py --zero 2    # appends --local_rank=N

A small residual MLP trained by ``deepspeed.initialize`` with the user's own
``torch.optim.SGD`` (ZeRO calls a client optimizer untested:
``"zero_allow_untested_optimizer": true``), fp32, gradients clipped to 1.0 as
0.19 does by default. ZeRO-3 keeps no parameter whole (persistence threshold
0) and prefetches none: each layer's are gathered as it runs, as in a model
too big for one rank (this one's would all be kept whole, and gathered at once).
``deepspeed.init_distributed`` on CPU would JIT-build its shared-memory op
first (~60 s, and a run killed during the build leaves a lock that hangs every
later one): the job replaces ``deepspeed.comm.torch.build_shm_op`` with a
no-op (the module is reached as ``sys.modules["deepspeed.comm.torch"]``: its
attribute path names torch).

The user's code is ``mix_features``, called once a step in the forward.
Environment: ``STEPS`` (20; 0 runs until killed), ``SLOW_RANK``, ``SLOW_MS``
and ``SLOW_KIND`` (``sleep``: off CPU, ``cpu``: a busy loop) slow it on one
rank, ``HANG_RANK`` stops in it for good once the file ``HANG_FILE`` exists,
``LOSS_FILE`` gets ``step <n> loss <rank's loss>`` lines (from rank 0,
or from every rank where the name holds ``{rank}``). Each rank prints
``ready rank=<r> pid=<pid>`` once its engine is built (ZeRO-3 partitions
the model there: seconds of broadcasts), before its first step.
With ``ACCURACY_TRUTH`` set, each rank records its steps and the time it spent
slowed for ``benchmarks/accuracy.py`` (``truth.py``), slowed from step
``ONSET_STEP`` (0: from the start).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import deepspeed
import torch
import torch.distributed as dist
from torch import nn
from truth import TRUTH

STEPS = int(os.environ.get("STEPS", "20"))
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_MS = float(os.environ.get("SLOW_MS", "0"))
SLOW_KIND = os.environ.get("SLOW_KIND", "sleep")
HANG_RANK = int(os.environ.get("HANG_RANK", "-1"))
HANG_FILE = os.environ.get("HANG_FILE", "")
DIM, BATCH, CLASSES = 128, 16, 16
RANK = -1  # set once the process group is up


def mix_features(x: torch.Tensor) -> torch.Tensor:
    """The user's feature code: slowed by SLOW_MS on SLOW_RANK."""
    while RANK == HANG_RANK and HANG_FILE and os.path.exists(HANG_FILE):
        time.sleep(0.05)  # stopped for good once the file exists: the others wait
    if RANK == SLOW_RANK and SLOW_MS > 0 and TRUTH.slowing():
        began = time.perf_counter()
        if SLOW_KIND == "cpu":
            end = time.perf_counter() + SLOW_MS / 1000
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(SLOW_MS / 1000)
        TRUTH.spent(began)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = mix_features(x)
        return self.head(x + self.down(nn.functional.gelu(self.up(x))))


def main() -> None:
    global RANK
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher's
    args = parser.parse_args()
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # no 60 s JIT build
    deepspeed.init_distributed(dist_backend="gloo")
    RANK = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        # ZeRO-3 partitions every parameter and gathers each as its layer runs
        # (no prefetch), as it does a model too big to keep whole
        "zero_optimization": {
            "stage": args.zero,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    sys.stdout.write(f"ready rank={RANK} pid={os.getpid()}\n")
    sys.stdout.flush()
    TRUTH.start(RANK)
    name = os.environ.get("LOSS_FILE", "")
    keep = name and ("{rank}" in name or RANK == 0)
    out = open(name.replace("{rank}", str(RANK)), "w", buffering=1) if keep else None
    for step in range(1, STEPS + 1) if STEPS else itertools.count(1):
        g = torch.Generator().manual_seed(1000 * RANK + step)
        x = torch.randn(BATCH, DIM, generator=g)
        y = torch.randint(0, CLASSES, (BATCH,), generator=g)
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        TRUTH.step_end()
        if out:
            out.write(f"step {step} loss {loss.item()!r}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
