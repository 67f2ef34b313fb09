"""Stages computed away from their weights: FSDP and FSLPP (Rahimi et al. 2025, §3).

In these families a worker computes stages whose weights another worker owns (each stage's weights
live on one worker, or a few, and the others fetch them for each use). Here a worker *borrows* such a
stage: at the start of every call in which it computes the stage, the stage's first owner (the
*lender*) sends it the live weights and buffers; the borrower computes with them, and after its last
backward of the stage in the call sends the weight gradients back. The lender adds them to its own
before its update (and before the stage's owners, if several, reduce theirs), so the update is the
one of the whole mini-batch. Flushing schedules only: every call then computes with the weights of
the last update, which is what the lender holds when the call starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_pipe.errors import PipelineRuntimeError, PlanningError
from lightning_pipe.runtime.transport import Transport
from lightning_pipe.runtime.weights import StageWeights
from lightning_pipe.schedule.ir import COMPUTE, Action, Kind, Schedule

__all__ = [
    "Borrowing",
    "Lending",
    "check_borrowing",
    "last_gradients",
    "load_weights",
    "returned_gradients",
    "weights_message",
]


@dataclass(frozen=True)
class Lending:
    """Who lends what, seen from one worker.

    Attributes:
        lenders: stage this worker borrows → the worker that lends it (the stage's first owner).
        borrowers: stage this worker lends → the workers that borrow it.
    """

    lenders: dict[int, int]
    borrowers: dict[int, list[int]]

    @classmethod
    def of(cls, schedule: Schedule, worker: int) -> Lending:
        if schedule.relays:  # a relayed stage's whole state goes to the worker computing it (.stage_relays)
            return cls({}, {})
        computing: dict[int, set[int]] = {s: set() for s in range(schedule.stages)}
        for w, order in enumerate(schedule.orders):
            for action in order:
                if action.kind in COMPUTE:
                    computing[action.stage].add(w)
        lenders = {s: schedule.first_owner(s) for s, ws in computing.items() if worker in ws - set(schedule.owners[s])}
        borrowers = {
            s: sorted(ws - set(schedule.owners[s]))
            for s, ws in computing.items()
            if schedule.first_owner(s) == worker and ws - set(schedule.owners[s])
        }
        return cls(lenders, borrowers)


def check_borrowing(schedule: Schedule) -> None:
    """Refuse a non-flushing schedule in which a worker computes a stage it does not own: its calls
    overlap steps, so the weights a call needs may not be the lender's live ones. Every rank refuses
    alike: none waits."""
    if schedule.flush or schedule.relays:
        return
    for worker, order in enumerate(schedule.orders):
        for action in order:
            owners = schedule.owners[action.stage]
            if action.kind in COMPUTE and worker not in owners:
                raise PlanningError(
                    f"{schedule.family}: worker {worker} computes stage {action.stage}, whose weights live on "
                    f"worker(s) {list(owners)}, in a schedule without flushes; the runtime lends a stage's weights "
                    "to the workers that compute it only in flushing schedules (fsdp, fslpp)"
                )


def last_gradients(actions: Sequence[Action], stages: set[int] | dict[int, object]) -> dict[int, tuple[int, int]]:
    """Position of the last gradient action (``B`` or ``W``) of each (stage, step) of ``stages`` in
    ``actions`` → that (stage, step): where a borrower sends the step's gradients back."""
    if not stages:  # the common case, every call of a schedule without borrowing: nothing to scan
        return {}
    last: dict[tuple[int, int], int] = {}
    for position, action in enumerate(actions):
        if action.kind in (Kind.B, Kind.W) and action.stage in stages:
            last[(action.stage, action.step)] = position
    return {position: key for key, position in last.items()}


def weights_message(weights: StageWeights) -> list[torch.Tensor]:
    """What a lender sends: the stage's live parameters, then its buffers (batch-norm statistics)."""
    return [p.detach() for p in weights.params] + list(weights.module.buffers())


def load_weights(weights: StageWeights, message: list[torch.Tensor], version: int) -> None:
    """A borrower takes the lender's parameters and buffers (weight version ``version``) into its copy
    of the stage, in place."""
    targets = [*weights.params, *weights.module.buffers()]
    if len(targets) != len(message):
        raise PipelineRuntimeError(
            f"a lent stage has {len(message)} parameters and buffers, the borrower's copy {len(targets)}: every "
            "worker must build the same stage modules"
        )
    with torch.no_grad():
        for target, value in zip(targets, message, strict=True):
            target.copy_(value)
    weights.version = version


def returned_gradients(weights: StageWeights, step: int) -> list[torch.Tensor | None]:
    """What a borrower sends back after its last backward of ``step``: the gradient of each trainable
    weight (``None`` where none of its micro-batches reached it), taken out of its buffer."""
    buffer = weights.pop_gradients(step)
    return [buffer[index] for index in weights.trainable]


class Borrowing:
    """This worker's part in lending (its stages' weights out, their gradients back) and borrowing.

    Args:
        lending: who lends what, seen from this worker.
        worker, ranks: this worker and the global rank of each worker of its pipeline.
        weights: the stages this worker owns; borrowed: those it borrows (a copy without optimizer).
        transport: the pipeline's transport.
    """

    def __init__(
        self,
        lending: Lending,
        worker: int,
        ranks: list[int],
        weights: Mapping[int, StageWeights],
        borrowed: Mapping[int, StageWeights],
        transport: Transport,
    ) -> None:
        self.lending, self.worker, self.ranks = lending, worker, ranks
        self.weights, self.borrowed, self.transport = weights, borrowed, transport
        self._lent: dict[tuple[int, int, int], tuple[int, int]] = {}  # (stage, step, borrower) -> message

    def lend(self, peers: Callable[[int], list[Action]]) -> None:
        """Send the live weights of each stage this worker lends to the workers computing it in this call."""
        for stage, borrowers in self.lending.borrowers.items():
            for borrower in borrowers:
                if any(a.stage == stage and a.kind in COMPUTE for a in peers(borrower)):
                    self.transport.send(self.ranks[borrower], weights_message(self.weights[stage]), ("P", stage, 0))

    def borrow(self, actions: list[Action]) -> None:
        """Take the lenders' weights of the stages this worker borrows and computes in this call."""
        for stage, lender in self.lending.lenders.items():
            using = next((a for a in actions if a.stage == stage and a.kind in COMPUTE), None)
            if using is not None:
                peer = self.ranks[lender]
                message = self.transport.receive(peer, self.transport.expect(peer, ("P", stage, 0)))
                load_weights(self.borrowed[stage], message, using.version)

    def returns(self, peer: int, actions: Sequence[Action]) -> dict[int, tuple[int, int]]:
        """Position in ``peer``'s ``actions`` after which it sends back the gradients of a stage this
        worker lends it → that (stage, step)."""
        lent = {s for s, borrowers in self.lending.borrowers.items() if peer in borrowers}
        return last_gradients(actions, lent)

    def expect_gradients(self, peer: int, stage: int, step: int) -> None:
        """Post the receive of the gradients of ``stage`` in ``step`` that borrower ``peer`` sends back."""
        sender = self.ranks[peer]
        self._lent[(stage, step, peer)] = (sender, self.transport.expect(sender, ("G", stage, 0)))

    def give_back(self, stage: int, step: int) -> None:
        """A borrower's last backward of ``stage`` in ``step`` ran: its gradients go to the lender."""
        peer = self.ranks[self.lending.lenders[stage]]
        self.transport.send(peer, returned_gradients(self.borrowed[stage], step), ("G", stage, 0))

    def collect(self, action: Action) -> None:
        """Before a lent stage's update: add the gradients its borrowers computed in the step."""
        for borrower in self.lending.borrowers.get(action.stage, ()):
            expected = self._lent.pop((action.stage, action.step, borrower), None)
            if expected is not None:
                self.weights[action.stage].add(action.step, self.transport.receive(*expected))
