"""A user's training script: ``python -m tests.strategy_script ROOT STRATEGY``. Lightning starts the
other processes itself (``pipe*`` re-runs this script, ``pipe_spawn`` spawns), as it does for DDP."""

from __future__ import annotations

import sys

import lightning as L
import torch

import lightning_pipe  # noqa: F401 - registers the strategy names
from tests.lightning_cases import Chain, loader

if __name__ == "__main__":
    root, strategy = sys.argv[1], sys.argv[2]
    model = Chain(blocks=4, width=32)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        default_root_dir=root,
        log_every_n_steps=1,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader(8), loader(2, seed=7))
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), f"{root}/final.pt")
