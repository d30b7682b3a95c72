"""A Megatron-Core job: tensor parallel 2 x pipeline parallel 2 on 4 ranks.

    torchrun --nproc-per-node 4 megatron_job.py

``megatron.core.parallel_state`` builds the groups (Gloo, on CPU: every
group is Gloo, each with its ``group_desc``); rank r is TP rank r % 2 of
pipeline stage r // 2 (Megatron's order, tp-cp-ep-dp-pp; DP 1). Each stage
is a ``ColumnParallelLinear`` + ``RowParallelLinear`` pair (Megatron's
tensor-parallel layers: their all-reduces run on the TP group); stage 0
sends its activations to stage 1 and receives their gradients back (send/recv
on the PP group), stage 1 computes the loss; the gradients are all-reduced
over the DP group as Megatron's DDP does. The user's code is
``attention_block``, called in each stage's forward. Environment: ``STEPS``
(20; 0 runs until killed), ``SLOW_RANK``, ``SLOW_MS`` and ``SLOW_KIND``
(``sleep``: off CPU, ``cpu``: a busy loop) slow it on one rank, ``HANG_RANK``
stops in it for good once the file ``HANG_FILE`` exists, ``LOSS_FILE``
gets ``step <n> loss <loss>`` lines from the last stage's TP rank 0
(``{rank}`` in the name becomes its rank). Each rank prints ``ready rank=<r>
pid=<pid>`` once its groups are up.
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
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from truth import TRUTH

STEPS = int(os.environ.get("STEPS", "20"))
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_MS = float(os.environ.get("SLOW_MS", "0"))
SLOW_KIND = os.environ.get("SLOW_KIND", "sleep")
HANG_RANK = int(os.environ.get("HANG_RANK", "-1"))
HANG_FILE = os.environ.get("HANG_FILE", "")
RANK = int(os.environ.get("RANK", "0"))
DIM, BATCH, CLASSES = 128, 16, 8


def attention_block(x: torch.Tensor) -> torch.Tensor:
    """The user's code: slowed by SLOW_MS on SLOW_RANK."""
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
    return torch.relu(x)


class Stage(torch.nn.Module):
    """One pipeline stage: Megatron's column- then row-parallel linear layers."""

    def __init__(self, config: ModelParallelConfig, out: int) -> None:
        super().__init__()
        init = torch.nn.init.xavier_normal_
        self.up = tensor_parallel.ColumnParallelLinear(
            DIM, 2 * DIM, config=config, init_method=init, bias=True, gather_output=False
        )
        self.down = tensor_parallel.RowParallelLinear(
            2 * DIM, out, config=config, init_method=init, bias=True, input_is_parallel=True,
            skip_bias_add=False,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.up(x)
        y, _ = self.down(attention_block(h))
        return y


def main() -> None:
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    sys.stdout.write(f"ready rank={RANK} pid={os.getpid()}\n")
    sys.stdout.flush()
    TRUTH.start(RANK)
    config = ModelParallelConfig(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
    )  # fmt: skip
    torch.manual_seed(0)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    model = Stage(config, CLASSES if last else DIM)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pp_group, dp_group = ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group()
    nxt, prev = (
        ps.get_pipeline_model_parallel_next_rank(),
        ps.get_pipeline_model_parallel_prev_rank(),
    )
    name = os.environ.get("LOSS_FILE", "")
    says = last and ps.get_tensor_model_parallel_rank() == 0
    out = open(name.replace("{rank}", str(RANK)), "w", buffering=1) if name and says else None
    for step in range(1, STEPS + 1) if STEPS else itertools.count(1):
        g = torch.Generator().manual_seed(step)
        x, y = (
            torch.randn(BATCH, DIM, generator=g),
            torch.randint(0, CLASSES, (BATCH,), generator=g),
        )
        opt.zero_grad()
        if first:
            act = model(x)
            dist.send(act.detach(), nxt, group=pp_group)
            grad = torch.empty_like(act)
            dist.recv(grad, nxt, group=pp_group)
            act.backward(grad)
        else:
            act = torch.empty(BATCH, DIM)
            dist.recv(act, prev, group=pp_group)
            act.requires_grad_()
            loss = torch.nn.functional.cross_entropy(model(act), y)
            loss.backward()
            dist.send(act.grad, prev, group=pp_group)
            if out:
                out.write(f"step {step} loss {loss.item()!r}\n")
        for p in model.parameters():  # as Megatron's DDP: the gradients over the DP group
            if p.grad is not None:
                dist.all_reduce(p.grad, group=dp_group)
        opt.step()
        TRUTH.step_end()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
