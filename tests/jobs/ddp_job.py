"""A DDP job started the ways users start theirs (torchrun, or srun/mpirun-style env).

    torchrun --nproc-per-node 4 ddp_job.py [--steps N] [--slow-rank R --slow-ms MS]
    RANK=r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python ddp_job.py ...

It reads its place from the environment (``init_process_group("gloo")``:
env://, so in the env launch rank 0 hosts the store), keeps torch's default
thread count, and trains a 256-1024-512-16 MLP on seeded data (3.2 MB of
parameters: DDP's 1 MiB first bucket and the rest, two all-reduces a step,
as a real model's several buckets): each rank prints
``rank <r> step <i> loss <value> t <wall s>`` every step, the same values with or without a
probe. Options add what real jobs have: ``--workers N`` (a DataLoader whose
workers fork), ``--groups`` (2 x 2 data- and tensor-parallel groups made with
``new_group``, one all-reduce in each per step). This file imports nothing
from probing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Batches(Dataset):
    """Seeded batches, the same for a rank whatever runs beside it."""

    def __init__(self, rank: int, n: int) -> None:
        self.rank, self.n = rank, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.rank + i)
        return torch.randn(32, 256, generator=g), torch.randint(0, 16, (32,), generator=g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=0, help="0: until killed")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--work-ms", type=float, default=5.0, help="other work per step")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--groups", action="store_true", help="2 x 2 data/tensor-parallel groups")
    p.add_argument(
        "--on-error",
        choices=("exit", "wait"),
        default="exit",
        help="wait: after a collective fails (a peer died), stay up like a rank waiting for "
        "its elastic agent",
    )
    p.add_argument(
        "--linger", action="store_true", help="after the last step, stay up (no process group)"
    )
    args = p.parse_args()
    try:
        train(args)
        sys.stdout.write(f"rank {os.environ['RANK']} done\n")
        sys.stdout.flush()
        while args.linger:
            time.sleep(1)
    except Exception as err:  # the job's own failure, reported
        sys.stdout.write(f"rank {os.environ['RANK']} failed: {type(err).__name__}\n")
        sys.stdout.flush()
        if args.on_error == "exit":
            raise
        while True:
            time.sleep(1)


def train(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(
            nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 16)
        )
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dp = tp = None
    if args.groups:  # every rank creates every group, in the same order
        dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp, tp = dps[rank % 2], tps[rank // 2]
    steps = args.steps or 10**9
    loader = DataLoader(
        Batches(rank, steps),
        batch_size=None,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )
    for step, (x, y) in enumerate(loader):
        if rank == args.slow_rank:
            time.sleep(args.slow_ms / 1000)
        deadline = time.perf_counter() + args.work_ms / 1000
        while time.perf_counter() < deadline:  # the step's other work, in Python
            pass
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.groups:
            t = torch.full((4,), float(rank))
            dist.all_reduce(t, group=dp)
            dist.all_reduce(t, group=tp)
        line = f"rank {rank} step {step} loss {loss.item():.6f} t {time.time():.6f}\n"
        sys.stdout.write(line)  # one write a line: ranks sharing a pipe never mix
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
