"""A Gloo job as ``srun`` starts it: each task takes its rank, world size and
local rank from Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``)
and sets ``MASTER_ADDR``/``MASTER_PORT`` itself, in its own process, as
Megatron's and most Slurm recipes' scripts do under srun (the port from the
job id, or the first argument). Then slowable.py's step: 20 ms of work and an
all-reduce, the rank ``SLOW_RANK`` 60 ms more once ``SLOW_FILE`` exists.

    srun -n 4 python srun_job.py [MASTER_PORT]

Its environment, as /proc shows it, carries Slurm's variables only (no
``RANK``, no ``MASTER_PORT``): os.environ's changes stay in the process."""

import os
import runpy
import sys


def main() -> None:
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # one node: the launch node
    port = (
        sys.argv[1] if len(sys.argv) > 1 else str(10000 + int(os.environ["SLURM_JOB_ID"]) % 20000)
    )
    os.environ.setdefault("MASTER_PORT", port)
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "slowable.py"),
                   run_name="__main__")  # fmt: skip


if __name__ == "__main__":  # not on import (pytest's doctest collection imports it)
    main()
