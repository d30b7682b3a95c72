"""A Hugging Face ``Trainer`` job: a tiny random GPT-2 language model, DDP on Gloo.

    torchrun --nproc-per-node 4 hf_trainer.py

The user's code is ``collate_tokens``, the data collator: it runs in the
training process, or in the DataLoader's workers with ``WORKERS=N``.
Environment: ``STEPS`` (20; 0 runs until killed), ``SLOW_RANK``, ``SLOW_MS``
and ``SLOW_KIND`` (``sleep``: off CPU, ``cpu``: a busy loop) slow the collator
on one rank, ``LOSS_FILE`` gets ``step <n> loss <mean over ranks>`` lines
(from rank 0, or from every rank where the name holds ``{rank}``). Each rank
prints ``ready rank=<r> pid=<pid>`` once its process group is up. The model is
built from a config and the tokens are seeded: nothing is downloaded.
With ``ACCURACY_TRUTH`` set, each rank records its steps and the time it spent
slowed for ``benchmarks/accuracy.py`` (``truth.py``), slowed from step
``ONSET_STEP`` (0: from the start).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from truth import TRUTH

STEPS = int(os.environ.get("STEPS", "20"))
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_MS = float(os.environ.get("SLOW_MS", "0"))
SLOW_KIND = os.environ.get("SLOW_KIND", "sleep")
RANK = int(os.environ.get("RANK", "0"))
SEQ, VOCAB = 32, 256


class RandomTokens(Dataset):
    """Item i: SEQ token ids drawn from a generator seeded with i."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, VOCAB, (SEQ,), generator=g)}


def collate_tokens(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The user's collator: stack a batch, labels are the inputs (the model shifts)."""
    if RANK == SLOW_RANK and SLOW_MS > 0 and TRUTH.slowing():
        began = time.perf_counter()
        if SLOW_KIND == "cpu":
            end = time.perf_counter() + SLOW_MS / 1000
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(SLOW_MS / 1000)
        TRUTH.spent(began)
    ids = torch.stack([e["input_ids"] for e in examples])
    return {"input_ids": ids, "labels": ids.clone()}


class LossFile(TrainerCallback):
    """Writes ``step <n> loss <value>`` for each logged step, a line at a time."""

    def __init__(self, rank: int) -> None:
        name = os.environ.get("LOSS_FILE", "")
        keep = name and ("{rank}" in name or rank == 0)
        self.out = open(name.replace("{rank}", str(rank)), "w", buffering=1) if keep else None

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if self.out and logs and "loss" in logs:
            self.out.write(f"step {state.global_step} loss {logs['loss']!r}\n")


class Steps(TrainerCallback):
    """Each optimizer step's end, for the accuracy truth (``truth.py``)."""

    def on_step_end(self, args, state, control, **kwargs) -> None:
        TRUTH.step_end()


def main() -> None:
    args = TrainingArguments(
        output_dir=os.path.join(tempfile.gettempdir(), "hf_trainer"),  # nothing is saved
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        max_steps=STEPS or 10**9,
        per_device_train_batch_size=4,
        dataloader_num_workers=int(os.environ.get("WORKERS") or 0),
        disable_tqdm=True,
        learning_rate=1e-3,
        seed=0,
    )
    rank = args.process_index  # set up the devices, and with them the process group
    assert dist.is_initialized() or args.world_size == 1
    sys.stdout.write(f"ready rank={rank} pid={os.getpid()}\n")
    sys.stdout.flush()
    TRUTH.start(rank)
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=RandomTokens(),
        data_collator=collate_tokens,
        callbacks=[LossFile(rank), Steps()],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()


if __name__ == "__main__":
    main()
