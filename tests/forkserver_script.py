"""A user's script that fits twice in one process with ``start_method="forkserver"``, as a Hydra
multirun's jobs do: ``python -m tests.forkserver_script ROOT``.

Before each fit the script sets ``LIGHTNING_PIPE_TEST_VALUE`` and seeds Lightning (``PL_GLOBAL_SEED``),
and before the second it turns torch's deterministic algorithms on; the server that forks the
processes started at the first fit, so the second fit's processes see this call's values only if the
launcher hands them over. Every rank prints, when training starts, ``seen: value=... rank=...
seed=... deterministic=... shared=N`` (N: the parameters it holds in memory shared with other
processes); the main process saves each fit's trained model to ``ROOT/<value>.pt``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch

from lightning_pipe import PipelineStrategy
from tests.lightning_cases import Chain, loader, state

VARIABLE = "LIGHTNING_PIPE_TEST_VALUE"


class Seen(L.Callback):
    """Print what this rank's process was given (one write: the ranks share the pipe)."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        shared = sum(1 for p in module.parameters() if not p.is_meta and p.is_shared())
        line = (
            f"seen: value={os.environ.get(VARIABLE)} rank={trainer.global_rank} "
            f"seed={os.environ.get('PL_GLOBAL_SEED')} deterministic={torch.are_deterministic_algorithms_enabled()} "
            f"shared={shared}\n"
        )
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), line.encode())


def main() -> None:
    root = sys.argv[1]
    for seed, value in enumerate(("first", "second"), start=1):
        os.environ[VARIABLE] = value
        L.seed_everything(seed)
        torch.use_deterministic_algorithms(value == "second")
        model = Chain(blocks=4, width=32)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=PipelineStrategy(start_method="forkserver"),
            max_epochs=2,
            default_root_dir=f"{root}/{value}",
            enable_progress_bar=False,
            callbacks=[Seen()],
        )
        trainer.fit(model, loader(8), loader(2, seed=7))
        torch.save(state(model), f"{root}/{value}.pt")


if __name__ == "__main__":
    main()
