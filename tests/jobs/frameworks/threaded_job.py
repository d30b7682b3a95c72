"""A job whose training loop runs in a worker thread: the main thread idles in
the launcher's own loop (as some launchers and serving frameworks do), DDP on
CPU/Gloo, 4 ranks.

    torchrun --nproc-per-node 4 threaded_job.py

The thread that trains (``trainer``) issues every collective. The user's code
is ``decode_batch``, called once a step in that thread. Environment: ``STEPS``
(20; 0 runs until killed), ``SLOW_RANK``, ``SLOW_MS`` and ``SLOW_KIND``
(``sleep``: off CPU, ``cpu``: a busy loop) slow it on one rank, ``LOSS_FILE``
gets ``step <n> loss <rank's loss>`` lines (from rank 0, or from every rank
where the name holds ``{rank}``). Each rank prints ``ready rank=<r> pid=<pid>``
once its process group is up.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STEPS = int(os.environ.get("STEPS", "20"))
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_MS = float(os.environ.get("SLOW_MS", "0"))
SLOW_KIND = os.environ.get("SLOW_KIND", "sleep")
RANK = int(os.environ.get("RANK", "0"))
DIM, BATCH, CLASSES = 128, 16, 16


def decode_batch(x: torch.Tensor) -> torch.Tensor:
    """The user's input decoding: slowed by SLOW_MS on SLOW_RANK."""
    if RANK == SLOW_RANK and SLOW_MS > 0:
        if SLOW_KIND == "cpu":
            end = time.perf_counter() + SLOW_MS / 1000
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(SLOW_MS / 1000)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def train(failed: list[BaseException]) -> None:
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, CLASSES))
        model = DistributedDataParallel(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        name = os.environ.get("LOSS_FILE", "")
        keep = name and ("{rank}" in name or RANK == 0)
        out = open(name.replace("{rank}", str(RANK)), "w", buffering=1) if keep else None
        for step in range(1, STEPS + 1) if STEPS else itertools.count(1):
            g = torch.Generator().manual_seed(1000 * RANK + step)
            x = torch.randn(BATCH, DIM, generator=g)
            y = torch.randint(0, CLASSES, (BATCH,), generator=g)
            loss = nn.functional.cross_entropy(model(decode_batch(x)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if out:
                out.write(f"step {step} loss {loss.item()!r}\n")
    except BaseException as err:  # said by the main thread, which exits with it
        failed.append(err)


def main() -> None:
    dist.init_process_group("gloo")
    sys.stdout.write(f"ready rank={RANK} pid={os.getpid()}\n")
    sys.stdout.flush()
    failed: list[BaseException] = []
    worker = threading.Thread(target=train, args=(failed,), name="trainer")
    worker.start()
    while worker.is_alive():  # the launcher's own loop, in the main thread
        time.sleep(0.05)
    if failed:
        raise failed[0]
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
