"""Cluster signals under a pipeline: SIGTERM (preemption) and SLURM's requeue signal, acted on by
every rank at the same batch.

Lightning's handlers act where and when the signal lands. Its SIGTERM handler joins a broadcast of
the default group from inside the handler, which its DDP pairs with the broadcast every rank makes
at each batch; a pipeline makes no such broadcast (the flag travels with its logs instead), so the
signalled rank would wait in the handler for ever while the others wait for it. Its SLURM requeue
handler saves a checkpoint from inside the handler, in the middle of whatever the rank was doing:
under a pipeline a checkpoint is a collective (drain, then gather every stage), which the other ranks
are not making at that moment.

Here a handler only notes the signal. The notes travel to every rank in the log relay
(:meth:`Signals.outgoing`, :meth:`Signals.collect`), which every rank receives at the same batch, and
every rank acts at the start of the next training batch (:meth:`Signals.act`): the requeue handler
of Lightning runs there (its checkpoint then a proper collective), and SIGTERM raises Lightning's
``SIGTERMException`` on every rank at once, so ``on_exception`` callbacks (a checkpoint on
preemption) run everywhere at the same step. A signal that lands during validation or testing is
acted on at the next training batch.
"""

from __future__ import annotations

import importlib
import logging
from types import FrameType
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_prefixed_message

__all__ = ["Signals"]

log = logging.getLogger(__name__)


class Signals:
    """Takes over ``trainer``'s SIGTERM and requeue handlers (before Lightning registers them, which it
    does after the strategy's ``setup``)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.sigterm_here = False  # this rank received SIGTERM
        self.requeue_here: int | None = None  # this rank received the requeue signal (its number), not yet sent
        self.sigterm = False  # some rank received SIGTERM (as the relay has told every rank)
        self.requeue: int | None = None
        connector = trainer._signal_connector
        connector._sigterm_notifier_fn = self._note_sigterm
        connector._slurm_sigusr_handler_fn = self._note_requeue

    def _note_sigterm(self, signum: int, frame: FrameType | None) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", self.trainer.local_rank))
        launcher = self.trainer.strategy.launcher
        if not self.sigterm_here and launcher is not None:  # as Lightning: pass it on to the processes it started
            launcher.kill(signum)
        self.sigterm_here = True

    def _note_requeue(self, signum: int, frame: FrameType | None) -> None:
        log.info(rank_prefixed_message(f"Received the requeue signal: {signum}", self.trainer.local_rank))
        self.requeue_here = signum

    def outgoing(self) -> dict[str, Any]:
        """This rank's notes, for the relay (a requeue note is sent once)."""
        notes = {"sigterm": self.sigterm_here, "requeue": self.requeue_here}
        self.requeue_here = None
        return notes

    def collect(self, notes: dict[str, Any]) -> None:
        """One rank's notes, as the relay delivered them."""
        self.sigterm |= notes["sigterm"]
        if notes["requeue"] is not None:
            self.requeue = notes["requeue"]

    def act(self) -> None:
        """At the start of a training batch, on every rank: requeue (Lightning's handler: logger
        finalised, checkpoint saved, ``scontrol requeue`` by rank 0), then stop on SIGTERM."""
        connector = self.trainer._signal_connector
        if self.requeue is not None:
            signum, self.requeue = self.requeue, None
            type(connector)._slurm_sigusr_handler_fn(connector, signum, None)
        if self.sigterm:
            connector.received_sigterm = True
            raise _sigterm_exception(self.trainer)()


def _sigterm_exception(trainer: Any) -> type[BaseException]:
    """``SIGTERMException`` of the package ``trainer`` comes from (``lightning.pytorch`` or the
    standalone ``pytorch_lightning``: each has its own, and its loop catches only its own)."""
    package = "pytorch_lightning" if type(trainer).__module__.startswith("pytorch_lightning") else "lightning.pytorch"
    return importlib.import_module(f"{package}.utilities.exceptions").SIGTERMException
