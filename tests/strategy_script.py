"""A user's training script: ``python -m tests.strategy_script ROOT STRATEGY [--devices N] [--num-nodes N]``.

Started plainly, Lightning starts the other processes itself (``pipe*`` re-runs this script,
``pipe_spawn`` spawns), as it does for DDP. Started by ``torchrun`` or ``srun`` (one process per
device on every node), each process runs it once and Lightning's cluster environment gives it its
rank. Every rank prints ``launch: rank=... world=... node=... local=... environment=...`` after fit.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch

import lightning_pipe  # noqa: F401 - registers the strategy names
from tests.lightning_cases import Chain, loader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("strategy")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    options = parser.parse_args()
    model = Chain(blocks=4, width=32)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=options.devices,
        num_nodes=options.num_nodes,
        strategy=options.strategy,
        max_epochs=2,
        default_root_dir=options.root,
        log_every_n_steps=1,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader(8), loader(2, seed=7))
    environment = type(trainer.strategy.cluster_environment).__name__
    print(
        f"launch: rank={trainer.global_rank} world={trainer.world_size} node={trainer.node_rank} "
        f"local={trainer.local_rank} environment={environment}",
        flush=True,
    )
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), f"{options.root}/final.pt")


if __name__ == "__main__":
    main()
