"""A small DDP training job, one process per rank, started *without* probing.

    python job.py --rank R --world 4 --port 29500 [--slow-rank 2 --slow-ms 40]
                       [--hang-rank 1 --hang-step 30] [--work 10] [--steps 0]
                       [--truth FILE] [--thread]

Each step loads a batch (``load_batch``: a data loader that sleeps like one
reading and decoding from storage; slower on ``--slow-rank``), runs forward
and backward through an MLP of 2.4 MB of parameters wrapped in
DistributedDataParallel (two real all-reduces of the gradients per step:
DDP's first 1 MiB bucket, then the rest) and an SGD step. ``--hang-rank``
stops for good in its data loader at ``--hang-step``: the others wait in
the all-reduce it never joins. ``--truth`` appends ``<rank> <step> <start>
<backward> <end>`` (wall-clock s: the step's start, its backward pass's, where
the all-reduces are issued, and its end) per step to that file (one write a
line: every rank may append to one file): the job's own step times and
arrivals, what a verdict is checked against. ``--thread`` trains in a thread named
``trainer`` while the main thread joins it (a launcher's way). Prints
``ready`` once the first step is done. This file imports nothing from
probing: run it by path.
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time

import torch
import torch.distributed as dist
from torch import nn


def load_batch(rank: int, args: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read and decode one batch (storage latency, with a little noise)."""
    stuck = step >= args.hang_step >= 0 or (args.hang_file and os.path.exists(args.hang_file))
    if rank == args.hang_rank and stuck:
        threading.Event().wait()  # the loader never returns: a stuck read
    if args.slow_file:  # "RANK MS": which rank is slow, changeable while the job runs
        try:
            with open(args.slow_file) as f:
                slow_rank, slow_ms = f.read().split()
            args.slow_rank, args.slow_ms = int(slow_rank), float(slow_ms)
        except (OSError, ValueError):
            pass
    delay = args.load_ms + (args.slow_ms if rank == args.slow_rank else 0.0)
    time.sleep(delay * random.uniform(0.9, 1.1) / 1000)
    x = torch.randn(32, 64)
    a, w = torch.randn(256, 256), torch.randn(256, 256) * 0.05
    for _ in range(args.work):  # decode/augment: a fixed amount of CPU work
        a = torch.tanh(a @ w)
    return x + a[:32, :64] * 0, torch.randint(0, 10, (32,))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--master", default="127.0.0.1", help="rank 0's address")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--steps", type=int, default=0, help="0: until killed")
    p.add_argument("--load-ms", type=float, default=20.0)
    p.add_argument("--work", type=int, default=0, help="CPU work per batch (~0.5 ms units)")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=40.0)
    p.add_argument("--slow-file", help="a file holding 'RANK MS', read every step")
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=-1)
    p.add_argument("--hang-file", help="--hang-rank gets stuck once this file exists")
    p.add_argument("--truth", help="append '<rank> <step> <start> <backward> <end>' (wall s)")
    p.add_argument("--thread", action="store_true", help="train in a thread named trainer")
    p.add_argument("--small", action="store_true", help="a 9.6k-parameter MLP: one all-reduce")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    os.environ["RANK"] = str(args.rank)
    dist.init_process_group(
        args.backend,
        init_method=f"tcp://{args.master}:{args.port}",
        rank=args.rank,
        world_size=args.world,
    )
    device = torch.device("cpu")
    if args.backend == "nccl":  # one GPU per rank (shared round-robin if fewer)
        device = torch.device("cuda", args.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    # 2.4 MB of parameters: DDP's buckets (1 MiB first, then 25 MiB) make two
    # all-reduces a step, as a real model's several do
    net = (
        nn.Sequential(
            nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10)
        )
        if not args.small
        else nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    )
    net = net.to(device)
    model = nn.parallel.DistributedDataParallel(net)
    if args.thread:  # the main thread only waits, as under some launchers
        trainer = threading.Thread(target=train, args=(model, device, args), name="trainer")
        trainer.start()
        trainer.join()
    else:
        train(model, device, args)
    dist.destroy_process_group()


def train(model: nn.Module, device: torch.device, args: argparse.Namespace) -> None:
    """The training loop: ``--steps`` steps (0: until killed), each timed into
    ``--truth`` where given."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    truth = open(args.truth, "a", buffering=1) if args.truth else None
    step = 0
    while args.steps <= 0 or step < args.steps:
        t0 = time.time()
        x, y = (t.to(device) for t in load_batch(args.rank, args, step))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        t_backward = time.time()
        loss.backward()  # DDP all-reduces the gradients here, bucket by bucket
        opt.step()
        if truth is not None:
            truth.write(f"{args.rank} {step} {t0:.6f} {t_backward:.6f} {time.time():.6f}\n")
        step += 1
        if step == 1:
            print("ready", flush=True)


if __name__ == "__main__":
    main()
