"""A Gloo training job paced to a number of collectives a second (``engine_cost.py``).

Started the srun/mpirun way (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` set by the caller), one process a rank, on CPU:

- ``--shape ddp``: DDP over an MLP of ``--layers`` 128x128 layers, each
  gradient its own bucket (``bucket_cap_mb`` of one layer), so ``--layers``
  all-reduces a step;
- ``--shape fsdp2``: ``fully_shard`` on each layer and the root: an
  all-gather per layer forward and backward, a reduce-scatter per layer.

Each step sleeps what is left of ``--step-ms`` (0: flat out). Every second
a rank writes ``{"rank", "steps", "collectives", "t"}`` to ``--status`` +
``.rank{r}`` (DDP's all-reduces counted by a comm hook; FSDP2's not: -1).
Prints ``ready rank=R pid=P`` once its first step is done. Imports nothing
from probing: it is the job, not the tool.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

WIDTH = 128


def model(layers: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def ddp(layers: int, counted: list[int]) -> nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    one_layer_mb = (WIDTH * WIDTH + WIDTH) * 4 / 2**20
    m = DistributedDataParallel(model(layers), bucket_cap_mb=one_layer_mb)

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
        counted[0] += 1
        return allreduce_hook(state, bucket)

    m.register_comm_hook(None, hook)
    return m


def fsdp2(layers: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = model(layers)
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=("ddp", "fsdp2"), default="ddp")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=0.0)
    p.add_argument("--status", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    counted = [0]
    m = ddp(args.layers, counted) if args.shape == "ddp" else fsdp2(args.layers)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(8, WIDTH)
    steps, said, last = 0, False, 0.0
    while True:
        t0 = time.monotonic()
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
        steps += 1
        if not said:
            print(f"ready rank={rank} pid={os.getpid()}", flush=True)
            said = True
        now = time.monotonic()
        if now - last >= 1.0:
            last = now
            n = counted[0] if args.shape == "ddp" else -1
            row = {"rank": rank, "steps": steps, "collectives": n, "t": time.time()}
            tmp = f"{args.status}.rank{rank}.tmp"
            with open(tmp, "w") as f:
                json.dump(row, f)
            os.replace(tmp, f"{args.status}.rank{rank}")
        left = args.step_ms / 1e3 - (time.monotonic() - t0)
        if left > 0:
            time.sleep(left)


if __name__ == "__main__":
    main()
