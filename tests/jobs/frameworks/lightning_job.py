"""A PyTorch Lightning job: an MLP trained by 4 CPU ranks on Gloo.

    python lightning_job.py                     # STRATEGY=ddp: Lightning starts ranks 1-3
    STRATEGY=ddp_spawn python lightning_job.py  # torch.multiprocessing spawns all 4

Lightning starts the other ranks itself: ``ddp`` runs this script again for
ranks 1-3 (rank 0 is the process started), ``ddp_spawn`` spawns 4 children of
it. The user's code is ``heavy_features``, called in the model's forward.
Environment: ``STEPS`` (20; 0 runs until killed), ``SLOW_RANK``, ``SLOW_MS``
and ``SLOW_KIND`` (``sleep``: off CPU, ``cpu``: a busy loop) slow it on one
rank, ``PACE_MS`` makes every rank wait that long a step (a job that is
not CPU-bound), ``WORK_MS`` makes every rank's ``heavy_features`` compute
that long (CPU time), ``CUDART`` (a CUDA runtime's path) makes every step
wait for its stream, and ``SLOW_KIND=gpu`` makes that wait ``SLOW_MS`` on
``SLOW_RANK`` (the stand-in runtime's ``FAKE_CUDA_SYNC_MS``: a slower GPU),
``LOSS_FILE`` gets ``step <n> loss <rank's loss>`` lines (from rank 0, or
from every rank where the name holds ``{rank}``). Each rank prints
``ready rank=<r> pid=<pid>`` once its process group is up.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

STEPS = int(os.environ.get("STEPS", "20"))
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_MS = float(os.environ.get("SLOW_MS", "0"))
SLOW_KIND = os.environ.get("SLOW_KIND", "sleep")
PACE_MS = float(os.environ.get("PACE_MS", "0"))  # every rank waits this long a step
WORK_MS = float(os.environ.get("WORK_MS", "0"))  # every rank computes this long a step
# a CUDA runtime whose stream each step waits for (the stand-in's, on a CPU machine)
CUDART = ctypes.CDLL(os.environ["CUDART"]) if os.environ.get("CUDART") else None


class Batches(Dataset):
    """Item i: a (features, class) pair from a generator seeded with i."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(256, generator=g), torch.randint(0, 16, (), generator=g)


def busy(ms: float) -> None:
    """Compute for ``ms`` of CPU time (the thread's, so a rank that waits for a
    CPU takes longer, as real feature code does)."""
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        pass


def heavy_features(x: torch.Tensor, rank: int) -> torch.Tensor:
    """The user's feature code: slowed by SLOW_MS on SLOW_RANK."""
    busy(WORK_MS)
    if rank == SLOW_RANK and SLOW_MS > 0 and SLOW_KIND != "gpu":
        if SLOW_KIND == "cpu":  # here, not in busy(): this is the function slowed
            end = time.thread_time() + SLOW_MS / 1000
            while time.thread_time() < end:
                pass
        else:
            time.sleep(SLOW_MS / 1000)
    return torch.tanh(x)


def sync_gpu() -> None:
    """The step's wait for its GPU (``torch.cuda.synchronize()`` in a GPU job)."""
    if CUDART is not None:
        CUDART.cudaStreamSynchronize(None)


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 16))
        self.out = None

    def setup(self, stage: str) -> None:
        rank = self.global_rank
        if rank == SLOW_RANK and SLOW_KIND == "gpu":  # the stand-in's sync waits this long
            os.environ["FAKE_CUDA_SYNC_MS"] = str(int(SLOW_MS))
        sys.stdout.write(f"ready rank={rank} pid={os.getpid()}\n")
        sys.stdout.flush()
        name = os.environ.get("LOSS_FILE", "")
        if name and ("{rank}" in name or rank == 0):
            self.out = open(name.replace("{rank}", str(rank)), "w", buffering=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(heavy_features(x, self.global_rank))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        if PACE_MS > 0:  # a job that waits for its input too: not every CPU is busy
            time.sleep(PACE_MS / 1000)
        loss = nn.functional.cross_entropy(self(x), y)
        sync_gpu()
        if self.out:
            self.out.write(f"step {self.global_step + 1} loss {loss.item()!r}\n")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=os.environ.get("STRATEGY", "ddp"),
        max_steps=STEPS or -1,
        max_epochs=None if STEPS else -1,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(), DataLoader(Batches(), batch_size=32))


if __name__ == "__main__":
    main()
