"""Stages whose whole state moves from worker to worker (Cyclic Data Parallelism's ZeRO form,
Fournier & Oyallon 2024, §4.4, Fig. 2d-ii).

A relayed stage is held by one worker at a time: its live weights and buffers, the versions it
keeps, the gradients it has summed so far and its optimizer state. Before computing an action of
the stage a worker takes that state from the worker of the stage's previous action (from the
stage's owner for the first action of a run); after it, it passes the state to the worker of the
next action and frees its own copy. The gradient therefore accumulates on the way, and the worker
holding the stage after a step's last backward updates it: no broadcast of the weights, no
reduction of the gradients. A worker holds the stage it computes and the one it is receiving.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_pipe.runtime.transport import Transport
from lightning_pipe.runtime.weights import StageWeights
from lightning_pipe.schedule.ir import COMPUTE, Action, Kind, Schedule

__all__ = ["Relays", "state_bytes"]

_Key = tuple[Any, int, int | None, int]


def state_bytes(weights: StageWeights) -> int:
    """Bytes of a stage's state on this worker: weights, buffers, kept versions, gradients and
    optimizer state (each storage once)."""
    storages: dict[int, int] = {}

    def count(tensor: torch.Tensor | None) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()

    for tensor in [*weights.params, *weights.module.buffers()]:
        count(tensor)
    for leaves in weights.versions.values():
        for tensor in leaves.values():
            count(tensor)
    for grads in weights.gradients.values():
        for tensor in grads:
            count(tensor)
    if weights.optimizer is not None:
        for state in weights.optimizer.state.values():
            for tensor in state.values():
                count(tensor)
    return sum(storages.values())


class Relays:
    """This worker's part in passing relayed stages on.

    Args:
        schedule: the schedule generated for ``span`` steps (its relays cover them).
        worker, ranks: this worker and the global rank of each worker of its pipeline.
        base, period: where the programs' steady state starts and its period (steps beyond the
            generated ones repeat those of the steady state).
        transport: the pipeline's transport.

    Attributes:
        held: the relayed stages this worker holds.
        peak_bytes: the most bytes of relayed stages' state this worker held at once, each time it
            took one (its own and the one taken), measured on every relayed stage: a copy left behind
            counts.
        taken_bytes: per stage, the most bytes of its state this worker took.
        received: states this worker took from the worker of the stage's previous action (the
            simulator's relay transfers; not counting a run's start from the owner).
    """

    def __init__(
        self,
        schedule: Schedule,
        worker: int,
        ranks: list[int],
        base: int,
        period: int,
        transport: Transport,
    ) -> None:
        self.relays = schedule.relays
        self.stages = frozenset(range(len(self.relays)))  # the relayed stages
        self.worker, self.ranks, self.transport = worker, ranks, transport
        self.base, self.period = base, period
        self.origin = 0  # the step the programs count from (the executor's, moved on by each drain)
        self.homes = schedule.first_owners
        self.where = {a.key: w for w, _, a in schedule.actions() if a.kind in COMPUTE or a.kind is Kind.UPDATE}
        self.versions = {a.key: a.version for _, _, a in schedule.actions() if a.kind in COMPUTE}
        self.index = {a.key: (stage, i) for stage, relay in enumerate(self.relays) for i, a in enumerate(relay)}
        self.held = {stage for stage, home in enumerate(self.homes) if home == worker} if self.relays else set()
        self.expected: dict[_Key, tuple[int, int]] = {}
        self.peak_bytes = 0
        self.taken_bytes: dict[int, int] = {}
        self.received = 0
        self.draining: dict[int, list[Action]] | None = None  # per stage, the drain's actions in relay order
        self._per_period = 0  # relay actions of a stage per period of steps, in the steady state
        if self.relays:
            middle = base + period
            first = next(a for a in self.relays[0] if a.step == middle)
            later = (first.kind, first.stage, first.microbatch, middle + period)
            self._per_period = self.index[later][1] - self.index[first.key][1]

    def _neighbour(self, action: Action, offset: int) -> tuple[Action | None, int]:
        """The relay's action ``offset`` places from ``action`` (``None`` before the first), shifted
        back to ``action``'s steps, and that shift."""
        step = action.step - self.origin
        mapped = step
        if step >= self.base + self.period:  # into the middle of the generated steps: neighbours exist
            mapped = self.base + self.period + (step - self.base) % self.period
        shift = action.step - mapped
        stage, position = self.index[(action.kind, action.stage, action.microbatch, mapped)]
        if not 0 <= position + offset < len(self.relays[stage]):
            return None, shift
        return self.relays[stage][position + offset], shift

    def _order(self, action: Action) -> int:
        """``action``'s place in its stage's relay, counted from the start of the run."""
        _, shift = self._neighbour(action, 0)
        position = self.index[(action.kind, action.stage, action.microbatch, action.step - shift)][1]
        return position + (shift // self.period) * self._per_period

    def destination(self, action: Action) -> int:
        """The worker the stage's state goes to after ``action`` (the owner, after the last one; in a
        drain, the worker of the drain's next action of the stage)."""
        if self.draining is not None:
            order = self.draining[action.stage]
            position = self._drain_place[action.key]
            return self.homes[action.stage] if position + 1 == len(order) else self.where_of(order[position + 1])
        following, _ = self._neighbour(action, +1)
        return self.homes[action.stage] if following is None else self.where[following.key]

    def where_of(self, action: Action) -> int:
        """The worker of ``action`` (any step)."""
        _, shift = self._neighbour(action, 0)
        return self.where[(action.kind, action.stage, action.microbatch, action.step - shift)]

    def begin_drain(self, actions_of: Callable[[int], list[Action]], workers: int, end: int) -> None:
        """Before a drain (steps ``>= end`` will not run): each relayed stage goes from the worker it
        was passed to, after the last action that ran, to the worker of the drain's first action of
        it (to its owner when the drain has none), and the drain's actions pass it on among themselves."""
        self.draining = {stage: [] for stage in self.stages}
        self._drain_place: dict[_Key, int] = {}  # an action's place in its stage's drain order
        for worker in range(workers):
            for action in actions_of(worker):
                if action.stage in self.stages and (action.kind in COMPUTE or action.kind is Kind.UPDATE):
                    self.draining[action.stage].append(action)
        for stage, order in self.draining.items():
            order.sort(key=self._order)
            self._drain_place.update((a.key, i) for i, a in enumerate(order))
            last_run = self._last_run(stage, order, end)
            holder = self.homes[stage] if last_run is None else self._steady_destination(last_run)
            target = self.where_of(order[0]) if order else self.homes[stage]
            if holder == self.worker:
                if stage not in self.held:
                    self._take_over(self._weights[stage], last_run.key)
                if target != self.worker:
                    self._pass(stage, target)
            elif target == self.worker:
                self._expect_state(holder, ("drain", stage))

    def begin_run(self) -> None:
        """Before the first call of a run (the first ever, or the first after a drain): each stage
        goes from its owner, where it rests between runs, to the worker of its first action.

        The relays are the generated schedule's, their steps counted from the run's start, while a
        call's actions are shifted by :attr:`origin` (the steps of the runs before, moved on by every
        drain). So the first action's worker is read off the schedule (:attr:`where`): looked for
        among the call's actions it is found in the first run only, and after a drain the search
        raises ``StopIteration``, which Lightning's training loop takes for the end of the epoch's
        data: every epoch after the first would end at its first step, having trained nothing."""
        for stage in sorted(self.stages):
            worker, home = self.where[self.relays[stage][0].key], self.homes[stage]
            if home == worker:
                continue
            if self.worker == home:
                self._pass(stage, worker)
            elif self.worker == worker:
                self._expect_state(home, ("home", stage))

    def end_drain(self) -> None:
        """After a drain: every stage comes back to its owner here, from the worker of the drain's last
        action of it (or from the worker holding it, when the drain did not compute it)."""
        if self.draining is None:
            return
        for stage, order in self.draining.items():
            key = order[-1].key if order else ("drain", stage)
            if key in self.expected:
                self._take_over(self._weights[stage], key)
        self.draining = None

    def _last_run(self, stage: int, remaining: list[Action], end: int) -> Action | None:
        """The stage's last action that ran before the drain: walking back the relay from the drain's
        first action (or from the end of the steps run), past the actions of steps never run."""
        if remaining:
            anchor, offset = remaining[0], -1
        else:  # every action of the steps run has run: the last one is the last step's update
            anchor, offset = Action(Kind.UPDATE, stage, None, end - 1), 0
        while True:
            previous, shift = self._neighbour(anchor, offset)
            if previous is None:
                return None
            candidate = Action(previous.kind, stage, previous.microbatch, previous.step + shift)
            if candidate.step < end:
                return candidate
            offset -= 1

    def _steady_destination(self, action: Action) -> int:
        following, _ = self._neighbour(action, +1)
        return self.homes[action.stage] if following is None else self.where[following.key]

    def upcoming_versions(self, action: Action, count: int) -> set[int]:
        """Versions the stage's next ``count`` actions after ``action`` compute with."""
        versions = set()
        for offset in range(1, count + 1):
            following, shift = self._neighbour(action, offset)
            if following is None:
                break
            if following.kind is not Kind.UPDATE:
                versions.add(self.versions[following.key] + shift)
        return versions

    def expect(self, peer: int, action: Action) -> None:
        """Announce the state ``peer`` passes this worker after ``action``."""
        relayed = (action.kind in COMPUTE or action.kind is Kind.UPDATE) and action.stage in self.stages
        relayed = relayed and peer != self.worker
        if relayed and self.destination(action) == self.worker:
            self._expect_state(peer, action.key)

    def _expect_state(self, peer: int, key: _Key) -> None:
        """Post the receive of the stage state ``peer`` passes this worker, taken under ``key``."""
        rank = self.ranks[peer]
        self.expected[key] = (rank, self.transport.expect(rank, ("state", key[1])))

    def take(self, weights: StageWeights, action: Action) -> None:
        """Before ``action``: take its stage's state from the worker that has it, unless held."""
        if action.stage in self.held:
            return
        if self.draining is not None:
            order = self.draining[action.stage]
            position = self._drain_place[action.key]
            key = ("drain", action.stage) if position == 0 else order[position - 1].key
        else:
            previous, shift = self._neighbour(action, -1)
            if previous is None:  # the first action of a run: from the owner (.executor's first call)
                key = ("home", action.stage)
            else:
                key = (previous.kind, previous.stage, previous.microbatch, previous.step + shift)
        self.received += key[0] != "home"
        self._take_over(weights, key)

    def _take_over(self, weights: StageWeights, key: _Key) -> None:
        weights.take_over(self.transport.receive(*self.expected.pop(key)))
        stage = key[1]
        self.held.add(stage)
        self.taken_bytes[stage] = max(self.taken_bytes.get(stage, 0), state_bytes(weights))
        self.peak_bytes = max(self.peak_bytes, self._bytes_here())

    def give(self, action: Action) -> None:
        """After ``action``: pass its stage's state on, unless the next action is this worker's."""
        destination = self.destination(action)
        if destination != self.worker:
            self._pass(action.stage, destination)

    def _pass(self, stage: int, worker: int) -> None:
        """Send ``stage``'s whole state to ``worker`` and free this worker's copy."""
        self.transport.send(self.ranks[worker], self._weights[stage].hand_over(), ("state", stage))
        self._weights[stage].release()
        self.held.discard(stage)

    def _bytes_here(self) -> int:
        """Bytes of every relayed stage's state on this worker (those passed on have none)."""
        return sum(state_bytes(self._weights[stage]) for stage in self.stages)

    def attach(self, weights: dict[int, StageWeights]) -> None:
        """The stages' weights on this worker; those it does not hold are freed."""
        self._weights = weights
        for stage in self.stages - self.held:
            weights[stage].release()
        self.peak_bytes = self._bytes_here()
