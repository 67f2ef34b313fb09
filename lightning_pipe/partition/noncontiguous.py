"""Non-contiguous allocations: a device may own layers that are not adjacent (Beaumont et al. §6).

Without memory limits the best contiguous allocation is at most twice as slow as the best
non-contiguous one (Theorem 5, proven with :func:`next_fit`), and the chain costs ``(1, 2, 1)`` on two
devices show the gap (period 3 contiguous, 2 not). Under memory limits a non-contiguous allocation
may be the only one that fits (Lemma 2: weights ``(1, 2, 1)``, limit 2).

The period of an allocation is the largest device load ``Σ u_F + u_B`` (or cut transfer ``2·C``
where consecutive layers sit on different devices). Each maximal run of consecutive layers on a
device is a pipeline stage for the schedule's memory model (:func:`~lightning_pipe.partition.plan.evaluate`).

:func:`noncontiguous` starts from the best of two heuristics (the optimal contiguous split, which
is no worse than Next-Fit's 2-approximation, and longest-processing-time-first list scheduling),
then runs a branch and bound over device assignments, which proves the result optimal when it
finishes within its node budget (small instances); the plan's notes say which it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pipe.errors import PlanningError
from lightning_pipe.partition.plan import Plan
from lightning_pipe.partition.request import PlanRequest
from lightning_pipe.util.units import format_bytes

__all__ = ["EXACT_LAYERS", "NODE_BUDGET", "next_fit", "noncontiguous"]

NODE_BUDGET = 200_000
EXACT_LAYERS = 40


def next_fit(seconds: Sequence[float], devices: int, capacity: float) -> list[list[int]] | None:
    """Beaumont Thm 5's Next Fit: fill a device up to ``capacity``, then move to the next one.

    With ``capacity = 2·T*`` (``T*`` the best non-contiguous period, or any ``T >= max(Σ/P, max_l)``)
    it always succeeds, which bounds the contiguous optimum by twice the non-contiguous one.
    Returns contiguous groups, or ``None`` when ``devices`` do not suffice.
    """
    groups: list[list[int]] = [[]]
    load = 0.0
    for layer, cost in enumerate(seconds):
        if cost > capacity:
            return None
        if groups[-1] and load + cost > capacity:
            groups.append([])
            load = 0.0
        groups[-1].append(layer)
        load += cost
    return groups if len(groups) <= devices else None


def _key(plan: Plan) -> tuple[float, float]:
    return plan.bottleneck_seconds, plan.peak_memory_bytes


def _fits(request: PlanRequest, plan: Plan) -> bool:
    return request.memory_limit is None or plan.peak_memory_bytes <= request.memory_limit * (1 + 1e-9)


def _as_plan(request: PlanRequest, owner: Sequence[int], notes: list[str]) -> Plan:
    used = sorted(set(owner))
    groups = sorted(([layer for layer, device in enumerate(owner) if device == d] for d in used), key=min)
    return request.plan_unchecked("noncontiguous", groups, [1] * len(groups), notes)


def _contiguous(request: PlanRequest) -> list[int] | None:
    try:
        spans = request.problem(replicate=False).solve()
    except PlanningError:
        return None
    return [stage for stage, (first, last, _) in enumerate(spans) for _ in range(first, last + 1)]


def _list_scheduling(request: PlanRequest) -> list[int]:
    """Longest processing time first onto the least loaded device. (Moving a layer off the most loaded
    device never helps afterwards: its last layer went to it when it was the least loaded, and every
    layer on it is at least as long as that one.)"""
    seconds = request.costs.column("seconds")
    loads = [0.0] * request.devices
    owner = [0] * len(seconds)
    for layer in sorted(range(len(seconds)), key=lambda i: -seconds[i]):
        device = min(range(request.devices), key=loads.__getitem__)
        owner[layer] = device
        loads[device] += seconds[layer]
    return owner


@dataclass
class _Search:
    """Branch and bound over device assignments in chain order, devices labelled in order of first use."""

    request: PlanRequest
    best: Plan | None
    nodes: int = 0

    def __post_init__(self) -> None:
        costs = self.request.costs
        self.seconds = costs.column("seconds")
        self.cuts = [self.request.network.cut_seconds(b) for b in costs.boundary_bytes]
        per_param, per_saved = self.request.memory.least_coefficients()  # fewest copies any stage needs
        # a lower bound whatever the layer's neighbours: a storage it shares with the previous one may count there
        self.floor_bytes = [
            per_param * layer.param_bytes + per_saved * (layer.saved_bytes - layer.shared_saved_bytes)
            for layer in costs.layers
        ]
        self.remaining = [sum(self.seconds[i:]) for i in range(len(self.seconds) + 1)]
        limit = self.request.memory_limit
        self.limit = float("inf") if limit is None else limit * (1 + 1e-9)

    def run(self) -> bool:
        """Search; True when the whole tree was explored (the result is optimal)."""
        devices = self.request.devices
        self._visit([], [0.0] * devices, [0.0] * devices, 0.0, 0)
        return self.nodes <= NODE_BUDGET

    def _bound(self) -> float:
        return float("inf") if self.best is None else self.best.bottleneck_seconds

    def _visit(self, owner: list[int], loads: list[float], floors: list[float], period: float, opened: int) -> None:
        self.nodes += 1
        if self.nodes > NODE_BUDGET:
            return
        layer = len(owner)
        if layer == len(self.seconds):
            plan = _as_plan(self.request, owner, [])
            if _fits(self.request, plan) and (self.best is None or _key(plan) < _key(self.best)):
                self.best = plan
            return
        devices = self.request.devices
        if (sum(loads) + self.remaining[layer]) / devices >= self._bound():
            return
        for device in sorted(range(min(opened + 1, devices)), key=loads.__getitem__):
            cut = self.cuts[layer - 1] if layer and owner[-1] != device else 0.0
            load = loads[device] + self.seconds[layer]
            new_period = max(period, cut, load)
            floor = floors[device] + self.floor_bytes[layer]
            if new_period >= self._bound() or floor > self.limit:
                continue
            loads[device], floors[device] = load, floor
            owner.append(device)
            self._visit(owner, loads, floors, new_period, max(opened, device + 1))
            owner.pop()
            loads[device] -= self.seconds[layer]
            floors[device] -= self.floor_bytes[layer]


def noncontiguous(request: PlanRequest) -> Plan:
    """Best allocation where devices may own any set of layers (exact on small instances)."""
    request.require_layers_per_device("noncontiguous")
    candidates = [owner for owner in (_contiguous(request), _list_scheduling(request)) if owner is not None]
    plans = [plan for plan in (_as_plan(request, owner, []) for owner in candidates) if _fits(request, plan)]
    search = _Search(request, min(plans, key=_key) if plans else None)
    optimal = len(request.costs) <= EXACT_LAYERS and search.run()
    if search.best is None:
        raise PlanningError(
            f"noncontiguous: no allocation of {len(request.costs)} layers on {request.devices} device(s) "
            f"fits {format_bytes(request.memory_limit)} per device"
            + (", even with any layer on any device" if optimal else " (search not exhaustive at this size)")
            + ": raise the memory limit or add devices"
        )
    if optimal:
        note = "noncontiguous: proven optimal by exhaustive branch and bound"
    elif len(request.costs) > EXACT_LAYERS:
        note = (
            f"noncontiguous: best of the optimal contiguous split and list scheduling; {len(request.costs)} "
            f"layers is too many for the exact search (at most {EXACT_LAYERS}). Within 2x of the optimum "
            "with free communication and no memory limit (Beaumont Thm 5)"
        )
    else:
        note = f"noncontiguous: best found within {NODE_BUDGET} search nodes (not proven optimal)"
    groups = [list(stage.layers) for stage in search.best.stages]
    return request.plan_unchecked("noncontiguous", groups, [1] * len(groups), [note])
