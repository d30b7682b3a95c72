"""A DDP job started by ``torch.multiprocessing.spawn``, ranks given explicitly.

    python mp_spawn.py

The parent picks a free port and spawns 4 processes; each calls
``init_process_group("gloo", rank=r, world_size=4, init_method="tcp://...")``
and nothing sets RANK or WORLD_SIZE in the environment: a tool must learn the
rank from the process group, not from the environment. Each rank trains a
256-512-16 MLP under DDP on seeded data. The user's code is ``heavy_features``.
Environment: ``STEPS`` (20; 0 runs until killed), ``SLOW_RANK``, ``SLOW_MS``
and ``SLOW_KIND`` (``sleep``: off CPU, ``cpu``: a busy loop) slow it on one
rank, ``LOSS_FILE`` gets ``step <n> loss <rank's loss>`` lines (from rank 0,
or from every rank where the name holds ``{rank}``). Each rank prints
``ready rank=<r> pid=<pid>`` once its process group is up.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

WORLD = 4
STEPS = int(os.environ.get("STEPS", "20"))
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_MS = float(os.environ.get("SLOW_MS", "0"))
SLOW_KIND = os.environ.get("SLOW_KIND", "sleep")


def heavy_features(x: torch.Tensor, rank: int) -> torch.Tensor:
    """The user's feature code: slowed by SLOW_MS on SLOW_RANK."""
    if rank == SLOW_RANK and SLOW_MS > 0:
        if SLOW_KIND == "cpu":
            end = time.perf_counter() + SLOW_MS / 1000
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(SLOW_MS / 1000)
    return torch.tanh(x)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(32, 256, generator=g), torch.randint(0, 16, (32,), generator=g)


def worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)  # as torchrun does: 4 ranks share the cores
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, init_method=f"tcp://127.0.0.1:{port}"
    )
    sys.stdout.write(f"ready rank={rank} pid={os.getpid()}\n")
    sys.stdout.flush()
    name = os.environ.get("LOSS_FILE", "")
    keep = name and ("{rank}" in name or rank == 0)
    out = open(name.replace("{rank}", str(rank)), "w", buffering=1) if keep else None
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 16))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, STEPS + 1) if STEPS else itertools.count(1):
        x, y = batch(rank, step)
        loss = nn.functional.cross_entropy(model(heavy_features(x, rank)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if out:
            out.write(f"step {step} loss {loss.item()!r}\n")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(worker, args=(free_port(),), nprocs=WORLD)
