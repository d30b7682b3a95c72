"""A torch FSDP2 job (``fully_shard``): 4 small residual MLP blocks on CPU/Gloo.

    torchrun --nproc-per-node 4 fsdp2.py            # FSDP over all 4 ranks
    MESH=2d torchrun --nproc-per-node 4 fsdp2.py    # 2 x 2 mesh: FSDP on "dp", TP on "tp"

With ``MESH=2d`` each block's MLP is split by tensor parallelism
(``ColwiseParallel`` then ``RowwiseParallel``) inside each "tp" pair and the
blocks are sharded by FSDP across the "dp" pairs; the two ranks of a tp pair
see the same batch. The user's code is ``heavy_features``, called once a step
in the first block's forward. Environment: ``STEPS`` (20; 0 runs until killed),
``SLOW_RANK``, ``SLOW_MS`` and ``SLOW_KIND`` (``sleep``: off CPU, ``cpu``: a busy
loop) slow it on one rank, ``LOSS_FILE`` gets ``step <n> loss <rank's loss>``
lines (from rank 0, or from every rank where the name holds ``{rank}``).
Each rank prints ``ready rank=<r> pid=<pid>`` once its process group is up.
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

STEPS = int(os.environ.get("STEPS", "20"))
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_MS = float(os.environ.get("SLOW_MS", "0"))
SLOW_KIND = os.environ.get("SLOW_KIND", "sleep")
RANK = int(os.environ.get("RANK", "0"))
DIM = 128


def heavy_features(x: torch.Tensor) -> torch.Tensor:
    """The user's feature code: slowed by SLOW_MS on SLOW_RANK."""
    if RANK == SLOW_RANK and SLOW_MS > 0:
        if SLOW_KIND == "cpu":
            end = time.perf_counter() + SLOW_MS / 1000
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(SLOW_MS / 1000)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Block(nn.Module):
    """x + MLP(norm(x)); the first block also runs the user's features."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = heavy_features(x)
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build(two_d: bool) -> tuple[nn.Module, int]:
    """The sharded model, and the rank's data-parallel index (which batch it sees)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(i == 0) for i in range(4)), nn.Linear(DIM, 16))
    if not two_d:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        for block in model[:4]:
            parallelize_module(block, mesh["tp"], plan)
    for block in model[:4]:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh["dp"].get_local_rank()


def main() -> None:
    dist.init_process_group("gloo")
    sys.stdout.write(f"ready rank={RANK} pid={os.getpid()}\n")
    sys.stdout.flush()
    name = os.environ.get("LOSS_FILE", "")
    keep = name and ("{rank}" in name or RANK == 0)
    out = open(name.replace("{rank}", str(RANK)), "w", buffering=1) if keep else None
    model, dp = build(os.environ.get("MESH") == "2d")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, STEPS + 1) if STEPS else itertools.count(1):
        g = torch.Generator().manual_seed(1000 * dp + step)
        x, y = torch.randn(16, DIM, generator=g), torch.randint(0, 16, (16,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if out:
            out.write(f"step {step} loss {loss.item()!r}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
