"""A user's training script: ``python -m tests.strategy_script ROOT STRATEGY [--devices N] [--num-nodes N]
[--send SIGNAL --to-rank R --at-step S] [--evaluate]``.

Started plainly, Lightning starts the other processes itself (``pipe*`` re-runs this script,
``pipe_spawn`` spawns), as it does for DDP. Started by ``torchrun`` or ``srun`` (one process per
device on every node), each process runs it once and Lightning's cluster environment gives it its
rank. Every rank prints ``launch: rank=... world=... node=... local=... environment=...`` after fit.

With ``--send``, global rank R sends itself that signal after training step S, as a cluster does
to preempt a job (SIGTERM) or to warn of it (SLURM's SIGUSR1). A run that stops on an exception saves
``stopped.ckpt`` first (as a user's callback would on preemption), and every rank prints
``stopped: rank=... step=... exception=...``. With ``--evaluate`` the trained model is then validated,
tested and predicted with by the same trainer.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import lightning as L

import lightning_pipe  # noqa: F401 - registers the strategy names
from tests.lightning_cases import Chain, loader


class SendSignal(L.Callback):
    """Rank ``rank`` sends itself ``signum`` at the end of training step ``step``."""

    def __init__(self, signum: int, rank: int, step: int) -> None:
        self.signum, self.rank, self.step = signum, rank, step

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class SaveWhenStopped(L.Callback):
    """On an exception, save a checkpoint (every rank takes part) and say where each rank stopped."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_exception(self, trainer: L.Trainer, module: L.LightningModule, exception: BaseException) -> None:
        trainer.save_checkpoint(self.path)
        line = f"stopped: rank={trainer.global_rank} step={trainer.global_step} exception={type(exception).__name__}\n"
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), line.encode())  # one write: the ranks share the pipe, a line must not split


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("strategy")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--send", help="e.g. SIGTERM, SIGUSR1")
    parser.add_argument("--to-rank", type=int, default=0)
    parser.add_argument("--at-step", type=int, default=3)
    parser.add_argument("--evaluate", action="store_true", help="validate, test and predict after fit")
    options = parser.parse_args()
    callbacks: list[L.Callback] = [SaveWhenStopped(f"{options.root}/stopped.ckpt")]
    if options.send:
        callbacks.append(SendSignal(signal.Signals[options.send], options.to_rank, options.at_step))
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
        callbacks=callbacks,
    )
    trainer.fit(model, loader(8), loader(2, seed=7))
    environment = type(trainer.strategy.cluster_environment).__name__
    print(
        f"launch: rank={trainer.global_rank} world={trainer.world_size} node={trainer.node_rank} "
        f"local={trainer.local_rank} environment={environment}",
        flush=True,
    )
    trainer.save_checkpoint(f"{options.root}/final.ckpt")  # every rank: each holds only its stages
    if options.evaluate:  # the same trainer and model after fit, as a user's script goes on
        trainer.validate(model, loader(2, seed=7), verbose=False)
        trainer.test(model, loader(2, seed=8), verbose=False)
        predictions = trainer.predict(model, loader(2, seed=9))
        print(f"evaluated: rank={trainer.global_rank} predictions={len(predictions)}", flush=True)


if __name__ == "__main__":
    main()
