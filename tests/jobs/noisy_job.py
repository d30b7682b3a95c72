"""A DDP job with the noise of an ordinary one, and a slowdown switched at run time.

    RANK=r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python noisy_job.py \\
        --control FILE [--threads 0] [--hidden 512] [--work-ms 20] [--groups]

torch's default thread count (``--threads 0``), a 256-``hidden``-16 MLP,
``--work-ms`` of other Python work per step (``other_work``) and a data loader
that sleeps ``--load-ms`` (``load_batch``). Every step reads ``--control``:
``RANK KIND MS`` slows one rank by MS ms in one place, by KIND:

* ``loader``: ``load_batch`` sleeps longer (off-CPU: a slow read);
* ``compute``: ``augment`` spins for MS ms of CPU time (on-CPU: extra work in one
  function);
* ``tp``: ``tensor_parallel`` spins before the tensor-parallel all-reduce
  (``--groups``: 2 x 2 data- and tensor-parallel groups made with ``new_group``);
* ``hang``: that rank stops in ``load_batch``, before the tensor-parallel
  all-reduce when ``--groups`` (in ``tensor_parallel``), until the control
  file says otherwise (a later test goes on with the same job);
* ``none``: nobody.

Prints ``ready`` after the first step. Imports nothing from probing.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

CONTROL: str | None = None  # --control
RANK = -1


def held() -> None:
    """This rank stopped (a read that does not return, a peer it waits on)
    while the control file says it hangs."""
    while control(CONTROL)[:2] == (RANK, "hang"):
        time.sleep(0.05)


def control(path: str | None) -> tuple[int, str, float]:
    if not path:
        return -1, "none", 0.0
    try:
        with open(path) as f:
            rank, kind, ms = f.read().split()
        return int(rank), kind, float(ms)
    except (OSError, ValueError):
        return -1, "none", 0.0


def load_batch(step: int, load_ms: float, extra_ms: float, hang: bool) -> tuple[torch.Tensor, ...]:
    """Read one batch: storage latency (a sleep, off the CPU)."""
    if hang:
        held()  # a read that does not return
    time.sleep((load_ms + extra_ms) / 1000)
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 256, generator=g), torch.randint(0, 16, (32,), generator=g)


def augment(x: torch.Tensor, extra_ms: float) -> torch.Tensor:
    """Per-batch preprocessing: extra CPU work on the slowed rank (``extra_ms`` of
    this thread's CPU time: longer on a busy machine, as real work is)."""
    end = time.thread_time() + extra_ms / 1000
    while time.thread_time() < end:
        pass
    return x


def other_work(ms: float) -> None:
    """The step's other work (logging, metrics, bookkeeping), in Python."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def tensor_parallel(t: torch.Tensor, extra_ms: float, hang: bool) -> torch.Tensor:
    """This rank's tensor-parallel shard of work."""
    if hang:
        held()
    end = time.perf_counter() + extra_ms / 1000
    while time.perf_counter() < end:
        pass
    return t * 1.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--control")
    p.add_argument("--threads", type=int, default=0, help="0: torch's default")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--work-ms", type=float, default=20.0)
    p.add_argument("--load-ms", type=float, default=5.0)
    p.add_argument("--groups", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    global CONTROL, RANK
    CONTROL, RANK = args.control, int(os.environ["RANK"])
    rank = RANK
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 16))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dp = tp = None
    if args.groups:  # every rank creates every group, in the same order
        dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp, tp = dps[rank % 2], tps[rank // 2]
    step = 0
    while True:
        slow, kind, ms = control(args.control)
        mine = slow == rank
        hang = mine and kind == "hang"
        x, y = load_batch(step, args.load_ms, ms if mine and kind == "loader" else 0.0,
                          hang and not args.groups)  # fmt: skip
        x = augment(x, ms if mine and kind == "compute" else 0.0)
        other_work(args.work_ms)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients here
        opt.step()
        if args.groups:
            t = torch.full((4,), float(rank))
            dist.all_reduce(t, group=dp)
            t = tensor_parallel(t, ms if mine and kind == "tp" else 0.0, hang)
            dist.all_reduce(t, group=tp)
        step += 1
        if step == 1:
            print("ready", flush=True)


if __name__ == "__main__":
    main()
