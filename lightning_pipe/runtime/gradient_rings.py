"""Gradients reduced point to point along a schedule's rings (Cyclic Data Parallelism's dp form,
Fournier & Oyallon 2024, §4.2, Fig. 2b-ii).

A stage whose owners form a :class:`~lightning_pipe.schedule.ir.Ring` is not all-reduced at its
update. Instead, as soon as an owner's last backward of the stage in a step is done, it takes the
partial sum from the previous owner of the ring, adds its own gradient and passes the sum on; the
last owner (the reducer) then holds the step's sum and passes it to the first owner of the spread,
and each of those takes it at its update of the step and passes it on. A step's gradient of a stage
therefore crosses ``2(W - 1)`` links, the volume of a bandwidth-optimal ring all-reduce
(Patarasuk & Yuan 2009), spread over the step instead of at its end, and with no collective.

(These rings are the schedule's, of workers; the shared-memory rings that carry messages between two
processes are sized in :mod:`~lightning_pipe.runtime.shared_memory_sizes`.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from lightning_pipe.runtime.transport import Transport
from lightning_pipe.runtime.weights import StageWeights
from lightning_pipe.schedule.ir import Action, Kind, Schedule

__all__ = ["RingReducer"]

PARTIAL, SUM = "ring partial", "ring sum"


class RingReducer:
    """This worker's part in the reductions of ``schedule.rings``.

    Attributes:
        sent: messages sent, by ``(kind, stage, receiving worker)``, ``kind`` :data:`PARTIAL` or
            :data:`SUM` (what the tests count).
    """

    def __init__(self, schedule: Schedule, worker: int, ranks: Sequence[int], transport: Transport) -> None:
        self.rings = schedule.rings
        self.stages = frozenset(range(len(self.rings)))  # the stages reduced along rings
        self.worker = worker
        self.ranks = list(ranks)
        self.transport = transport
        self.expected: dict[tuple[str, int, int], tuple[int, int]] = {}
        self.sent: Counter[tuple[str, int, int]] = Counter()

    def expect(self, peer: int, action: Action, last_gradient: tuple[int, int] | None) -> None:
        """Announce what ``peer`` sends this worker after ``action`` (``last_gradient``: the stage
        and step whose last gradient on ``peer`` it is), in the order ``peer`` sends it."""
        if last_gradient is not None:
            stage, step = last_gradient
            ring = self.rings[stage]
            if ring.gathers_to(peer) == self.worker:
                self._expect(peer, PARTIAL, stage, step)
            if peer == ring.reducer and ring.spreads_to(peer) == self.worker:
                self._expect(peer, SUM, stage, step)
        if action.kind is Kind.UPDATE and action.stage in self.stages:
            ring = self.rings[action.stage]
            if peer != ring.reducer and ring.spreads_to(peer) == self.worker:
                self._expect(peer, SUM, action.stage, action.step)

    def _expect(self, peer: int, kind: str, stage: int, step: int) -> None:
        rank = self.ranks[peer]
        self.expected[(kind, stage, step)] = (rank, self.transport.expect(rank, (kind, stage)))

    def gather(self, weights: StageWeights, stage: int, step: int) -> None:
        """After this worker's last gradient of ``stage`` in ``step``: add the previous owner's partial
        sum and pass it on (the reducer passes the whole sum to the spread)."""
        ring = self.rings[stage]
        if ring.gathered_from(self.worker) is not None:
            weights.add(step, self._receive(PARTIAL, stage, step))
        following = ring.gathers_to(self.worker)
        if following is not None:
            self._send(following, PARTIAL, stage, _trainable_gradients(weights, step))
        elif ring.spread:
            self._send(ring.spread[0], SUM, stage, _trainable_gradients(weights, step))

    def spread(self, weights: StageWeights, stage: int, step: int) -> None:
        """At this worker's update of ``stage`` in ``step``: take the step's sum (the reducer has it)
        in place of its own gradient and pass it on."""
        ring = self.rings[stage]
        if self.worker == ring.reducer:
            return
        weights.pop_gradients(step)
        weights.add(step, self._receive(SUM, stage, step))
        following = ring.spreads_to(self.worker)
        if following is not None:
            self._send(following, SUM, stage, _trainable_gradients(weights, step))

    def _receive(self, kind: str, stage: int, step: int) -> list[torch.Tensor | None]:
        peer, sequence = self.expected.pop((kind, stage, step))
        return self.transport.receive(peer, sequence)

    def _send(self, worker: int, kind: str, stage: int, gradients: list[torch.Tensor | None]) -> None:
        self.transport.send(self.ranks[worker], gradients, (kind, stage))
        self.sent[(kind, stage, worker)] += 1


def _trainable_gradients(weights: StageWeights, step: int) -> list[torch.Tensor | None]:
    """``step``'s gradient of each trainable weight so far (``None`` where none reached it), left in
    the stage."""
    buffer = weights.pop_gradients(step)
    weights.gradients[step] = buffer
    return [buffer[index] for index in weights.trainable]
