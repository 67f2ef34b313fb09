"""The weight versions a stage keeps at an update: those still in use, found by looking ahead.

Under a non-flushing update rule a backward differentiates the weights its forward used (weight
stashing, Narayanan et al. 2019 §3.3; PipeDream-2BW's double buffering, Narayanan et al. 2021 §3.1),
so an update keeps every version a micro-batch in flight computed with, and every version an action
still to come on this worker computes with: the rest of this call and the next ``period + 1`` calls.
Reading those off every action to come is a scan at each update; but in a call of the program's
steady state they depend only on the program's entry the call runs
(:meth:`~lightning_pipe.runtime.program.Program.entry_of`) and the position in it, up to a shift of
every version, so they are worked out once per stage, entry and position and shifted after that. A
relayed stage (Cyclic Data Parallelism's ZeRO form, Fournier & Oyallon 2024, §4.4) keeps those its
next actions use, on whichever worker (:meth:`~lightning_pipe.runtime.stage_relays.Relays.upcoming_versions`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from lightning_pipe.runtime.forward_backward import InFlight
from lightning_pipe.runtime.program import Program
from lightning_pipe.runtime.stage_relays import Relays
from lightning_pipe.schedule.ir import COMPUTE, Action

__all__ = ["VersionsKept"]


class VersionsKept:
    """The versions of this worker's stages still in use.

    Args:
        program, worker: this worker's program, and this worker.
        in_flight: the micro-batches in flight, by (stage, micro-batch, step).
        relays: the relayed stages.
        window: how many of a relayed stage's next actions are looked at.

    Attributes:
        last_relayed: relayed stage -> this worker's last action on it.
    """

    def __init__(
        self,
        program: Program,
        worker: int,
        in_flight: Mapping[tuple[int, int, int], InFlight],
        relays: Relays,
        window: int,
    ) -> None:
        self.program, self.worker, self.in_flight = program, worker, in_flight
        self.relays, self.window = relays, window
        self.last_relayed: dict[int, Action] = {}
        # (stage, entry of the program, position) -> versions used after it, less the call's shift
        self._upcoming: dict[tuple[int, int, int], frozenset[int]] = {}

    def relayed(self, stage: int) -> set[int]:
        """Versions a relayed ``stage``'s next actions anywhere use."""
        return self.relays.upcoming_versions(self.last_relayed[stage], self.window)

    def flying(self, stage: int) -> set[int]:
        """Versions of ``stage`` the micro-batches in flight computed with."""
        return {state.version for (s, _, _), state in self.in_flight.items() if s == stage}

    def upcoming(
        self,
        stage: int,
        running: list[Action],
        position: int,
        calls: int,
        origin: int,
        actions: Callable[[int, int], list[Action]],
    ) -> set[int]:
        """Versions of ``stage`` the actions after ``running[position]`` in call ``calls`` of the
        program (since the drain at step ``origin``), and in the next ``period + 1`` calls, compute
        with: :meth:`scanned` once per entry of the program and position, shifted."""
        entry, steps = self.program.entry_of(calls)
        offset = origin + steps
        key = (stage, entry, position)
        relative = self._upcoming.get(key)
        if relative is None:
            scanned = self.scanned(stage, running, position, calls, actions)
            relative = self._upcoming[key] = frozenset(v - offset for v in scanned)
        return {version + offset for version in relative}

    def scanned(
        self, stage: int, running: list[Action], position: int, calls: int, actions: Callable[[int, int], list[Action]]
    ) -> set[int]:
        """:meth:`upcoming`, read off every action still to come: ``running``'s after ``position``, and
        ``actions(worker, call)``'s of the next calls (the executor's, given with each call and not
        kept, so that no part of the executor refers back to it)."""
        later = range(calls + 1, calls + self.program.period + 2)
        ahead = running[position + 1 :] + [a for c in later for a in actions(self.worker, c)]
        return {a.version for a in ahead if a.stage == stage and a.kind in COMPUTE}
