"""A Gloo job step: 20 ms of work and an all-reduce, on each rank torchrun's
way (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The rank ``SLOW_RANK``
works 60 ms more a step once the file ``SLOW_FILE`` exists: a slowdown that
starts while the job runs. Runs until killed."""

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    t = torch.ones(256)
    slow = (
        os.environ.get("SLOW_FILE") if os.environ["RANK"] == os.environ.get("SLOW_RANK") else None
    )
    while True:
        time.sleep(0.02)
        if slow and os.path.exists(slow):
            time.sleep(0.06)  # the rank's own work, 60 ms longer a step
        dist.all_reduce(t)


if __name__ == "__main__":
    main()
