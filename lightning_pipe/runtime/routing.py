"""Where each action runs and where its messages go: placement and message routing.

A compute action runs on the worker the schedule gives it. The schedule generated for enough steps
(the fill, two periods of the steady state and the drain of every worker's program) says which, and
later steps repeat the steady state's (:class:`Placement`). An action's messages are the activations a
forward sends the next stage and the input gradients a backward sends the stage before: each goes to
the worker of the action that takes it, through the transport, or by hand when that worker is this
one (:class:`Router`). Everything a worker receives in a call is known from its peers' actions, so
the receives are posted when the call starts, in the order each peer sends, with those of lent
weights' gradients (:mod:`~lightning_pipe.runtime.borrowing`), ring reductions
(:mod:`~lightning_pipe.runtime.gradient_rings`), relayed stages
(:mod:`~lightning_pipe.runtime.stage_relays`) and cues (``SIGNAL``/``WAIT``: Cyclic Data
Parallelism's uniform delay, Fournier & Oyallon 2024, §4.2). An evaluation's messages go through
the same router, from each stage's first owner to the next's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lightning_pipe.errors import PlanningError
from lightning_pipe.runtime.borrowing import Borrowing, Lending, last_gradients
from lightning_pipe.runtime.gradient_rings import RingReducer
from lightning_pipe.runtime.stage_relays import Relays
from lightning_pipe.runtime.transport import Transport
from lightning_pipe.schedule.ir import COMPUTE, Action, Kind, Schedule

__all__ = ["Key", "Placement", "Router"]

Key = tuple[str, int, int, int]
"""A message: ``("F", receiving stage, micro-batch, step)`` or ``("B", ...)``; ``("E", ...)`` in an
evaluation (:meth:`~lightning_pipe.runtime.executor.PipelineExecutor.evaluate`)."""


class Placement:
    """Which worker runs each compute action, and what messages each produces.

    Args:
        generated: the schedule generated for enough steps to hold the fill, two periods of the steady
            state and the drain of every worker's program.
        base, period: where this worker's program reaches its steady state, and its period (steps
            beyond the generated ones repeat those of the steady state).
        split_stages: the stages whose backward runs as ``I`` then ``W``.

    Raises:
        PlanningError: a forward and its backward run on different workers.
    """

    def __init__(self, generated: Schedule, base: int, period: int, split_stages: set[int]) -> None:
        where = {a.key: w for w, _, a in generated.actions() if a.kind in COMPUTE}
        for stage, mb, step in {
            (a.stage, a.microbatch, a.step) for _, _, a in generated.actions() if a.kind in COMPUTE
        }:
            forward = where[(Kind.F, stage, mb, step)]
            backward = where.get((Kind.B, stage, mb, step), where.get((Kind.I, stage, mb, step)))
            if forward != backward:
                raise PlanningError(
                    f"{generated.family}: the forward and backward of stage {stage}, micro-batch {mb} run on "
                    f"workers {forward} and {backward}; the runtime keeps activations where they were made"
                )
        self.generated = generated
        self.split_stages = split_stages
        self._where, self._base, self._period, self._known = where, base, period, generated.steps
        self._last = generated.stages - 1

    def worker(self, kind: Kind, stage: int, mb: int, step: int) -> int:
        """The worker of an action of program step ``step`` (steps since the last drain)."""
        if step >= self._known:
            step = self._base + (step - self._base) % self._period
        return self._where[(kind, stage, mb, step)]

    def consumers(self, action: Action) -> list[tuple[Key, Kind]]:
        """Messages ``action`` produces, with the kind of action that consumes each."""
        s, mb, t = action.stage, action.microbatch, action.step
        if action.kind is Kind.F and s < self._last:
            return [(("F", s + 1, mb, t), Kind.F)]
        if action.kind in (Kind.B, Kind.I) and s > 0:
            return [(("B", s - 1, mb, t), Kind.I if s - 1 in self.split_stages else Kind.B)]
        return []

    def message_pairs(self, schedule: Schedule, worker: int, lending: Lending) -> set[tuple[int, int]]:
        """The ``(sender, receiver)`` workers that exchange messages with ``worker``: activations and
        gradients of the generated schedule, lent weights and their gradients (``lending``:
        ``worker``'s), and :meth:`~lightning_pipe.runtime.executor.PipelineExecutor.evaluate`'s
        activations."""
        pairs = set()
        for sender, _, action in self.generated.actions():
            if action.kind in COMPUTE:
                for key, kind in self.consumers(action):
                    pairs.add((sender, self.worker(kind, key[1], key[2], key[3])))
        for lender in lending.lenders.values():  # weights one way, their gradients back
            pairs |= {(lender, worker), (worker, lender)}
        for borrower in {b for borrowers in lending.borrowers.values() for b in borrowers}:
            pairs |= {(worker, borrower), (borrower, worker)}
        first = schedule.first_owners
        pairs |= set(itertools.pairwise(first))
        for ring in schedule.rings:  # partial sums, then the whole sum
            pairs |= set(itertools.pairwise(ring.gather)) | set(itertools.pairwise((ring.reducer, *ring.spread)))
        return {(a, b) for a, b in pairs if a != b}


class Router:
    """This worker's messages: posted at the start of a call, sent by the actions that produce them,
    taken by those that consume them.

    Args:
        placement: where the actions run.
        worker, ranks: this worker and the global rank of each worker of its pipeline.
        transport: the pipeline's transport.
        borrowing, rings, relays: this worker's lent and borrowed stages, ring reductions and relayed
            stages, whose receives are posted with the rest.

    Attributes:
        origin: the step the programs count from (the executor's, moved on by each drain).
    """

    def __init__(
        self,
        placement: Placement,
        worker: int,
        ranks: list[int],
        transport: Transport,
        borrowing: Borrowing,
        rings: RingReducer,
        relays: Relays,
    ) -> None:
        self.placement = placement
        self.worker, self.ranks, self.transport = worker, ranks, transport
        self.borrowing, self.rings, self.relays = borrowing, rings, relays
        self.origin = 0
        self.local: dict[Key, Any] = {}
        self.expected: dict[Key, tuple[int, int]] = {}

    def worker_of(self, kind: Kind, stage: int, mb: int, step: int) -> int:
        """The worker of an action of ``step`` (counted from the first step ever)."""
        return self.placement.worker(kind, stage, mb, step - self.origin)

    def backward_worker(self, stage: int, mb: int, step: int) -> int:
        """The worker of the backward (or its ``I`` half) of ``stage`` on micro-batch ``mb`` of ``step``."""
        return self.worker_of(Kind.I if stage in self.placement.split_stages else Kind.B, stage, mb, step)

    def expect(self, actions_of: Callable[[int], list[Action]]) -> None:
        """Post the receives of every message other workers send this one during a call."""
        for peer in range(len(self.ranks)):
            if peer == self.worker:
                continue
            actions = actions_of(peer)
            returns = self.borrowing.returns(peer, actions)
            gathers = last_gradients(actions, self.rings.stages)
            sender = self.ranks[peer]
            for position, action in enumerate(actions):
                if action.kind in COMPUTE:
                    for key, kind in self.placement.consumers(action):
                        if self.worker_of(kind, key[1], key[2], key[3]) == self.worker:
                            self.expect_from(peer, key)
                if position in returns:  # after its last backward of a stage lent to it: the gradients
                    self.borrowing.expect_gradients(peer, *returns[position])
                self.rings.expect(peer, action, gathers.get(position))
                self.relays.expect(peer, action)
                if action.kind is Kind.SIGNAL and action.peer == self.worker:
                    self.expected[action.key] = (sender, self.transport.expect(sender, "cue"))

    def expect_from(self, peer: int, key: Key) -> None:
        """Post the receive of message ``key``, which worker ``peer`` sends this one."""
        sender = self.ranks[peer]
        self.expected[key] = (sender, self.transport.expect(sender, key[:3]))

    def deliver(self, action: Action, obj: Any) -> None:
        """Send ``obj``, the message ``action`` produced, to the worker of the action that takes it."""
        for key, kind in self.placement.consumers(action):
            self.send_to(self.worker_of(kind, key[1], key[2], key[3]), key, obj)

    def send_to(self, worker: int, key: Key, obj: Any) -> None:
        """Message ``key`` to ``worker``: kept for :meth:`incoming` when that is this worker, sent
        through the transport otherwise."""
        if worker == self.worker:
            self.local[key] = obj
        else:
            self.transport.send(self.ranks[worker], obj, key[:3])

    def incoming(self, key: Key) -> Any:
        """Message ``key``, from this worker or as received."""
        if key in self.local:
            return self.local.pop(key)
        peer, sequence = self.expected.pop(key)
        return self.transport.receive(peer, sequence)

    def signal(self, action: Action) -> None:
        """A cue: tell ``action.peer`` that this worker has come this far."""
        self.transport.send(self.ranks[action.peer], [], "cue")

    def wait(self, action: Action) -> None:
        """Wait for the cue of the ``SIGNAL`` that ``action`` (a ``WAIT``) pairs with."""
        self.transport.receive(*self.expected.pop(replace(action, kind=Kind.SIGNAL).key))
