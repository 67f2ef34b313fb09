"""Which weight version each compute action uses, by update rule (docs/design.md, "Update rules").

Version ``v`` is a stage's weights after ``v`` updates; step ``t``'s update makes version ``t + 1``.

- ``sync`` (GPipe, 1F1B-flush, zero bubble): step ``t`` uses ``θ_t``: version ``t``.
- ``stash`` (PipeDream weight stashing, Narayanan et al. 2019 §3.3): a forward uses the newest
  version its worker has at that point of its order; the backward of the same micro-batch and stage
  uses the same (stashed) version.
- ``vertical`` (PipeDream vertical sync): every stage of a micro-batch uses the version its first
  stage used.
- ``2bw`` = ``cdp_v1`` (Narayanan et al. 2021; Fournier & Oyallon 2024, Eq. CDP-v1): step ``t`` uses
  ``θ_{t-1}``.
- ``cdp_v2`` (Eq. CDP-v2): micro-batch ``i`` uses ``θ^j_t`` on stage ``j`` (0-based) when
  ``i + j >= P - 1``, else ``θ^j_{t-1}`` — exactly the versions the cyclic timeline has already
  produced when the forward runs.

Step 0 has no older version: ``θ_{-1} = θ_0``.
"""

from __future__ import annotations

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.ir import COMPUTE, Action, Kind, Schedule

__all__ = ["RULES", "assign_versions", "formula_version"]

RULES = ("sync", "stash", "vertical", "2bw", "cdp_v1", "cdp_v2")


def formula_version(rule: str, action: Action, stages: int) -> int:
    """The version a compute action uses under a rule given by a formula (``sync``, ``2bw``,
    ``cdp_v1``, ``cdp_v2``), wherever it runs."""
    t = action.step
    if rule == "sync":
        return t
    if rule in ("2bw", "cdp_v1"):
        return max(t - 1, 0)
    # cdp_v2
    return t if action.microbatch + action.stage >= stages - 1 else max(t - 1, 0)


def _stashed(schedule: Schedule) -> dict[tuple[int, int, int], int]:
    """Version each forward finds on its worker, keyed by (stage, microbatch, step)."""
    seen: dict[tuple[int, int, int], int] = {}
    for worker, order in enumerate(schedule.orders):
        updates: dict[int, int] = {}
        for action in order:
            if action.kind is Kind.UPDATE:
                updates[action.stage] = updates.get(action.stage, 0) + 1
            elif action.kind is Kind.F:
                if worker not in schedule.owners[action.stage]:
                    raise PlanningError(
                        f"{schedule.family}: weight stashing needs each stage's forwards on a worker that owns "
                        f"its weights; {action} runs on worker {worker}"
                    )
                seen[(action.stage, action.microbatch, action.step)] = updates.get(action.stage, 0)
    return seen


def assign_versions(schedule: Schedule, rule: str) -> Schedule:
    """A copy of ``schedule`` whose compute actions carry the versions ``rule`` prescribes."""
    if rule not in RULES:
        raise PlanningError(f"unknown update rule {rule!r}; choose one of {', '.join(RULES)}")
    stashed = _stashed(schedule) if rule in ("stash", "vertical") else {}

    def version(action: Action) -> int:
        if rule == "stash":
            return stashed[(action.stage, action.microbatch, action.step)]
        if rule == "vertical":
            return stashed[(0, action.microbatch, action.step)]
        return formula_version(rule, action, schedule.stages)

    orders = [
        [Action(a.kind, a.stage, a.microbatch, a.step, version(a), a.peer) if a.kind in COMPUTE else a for a in order]
        for order in schedule.orders
    ]
    return schedule.with_orders(orders, rule=rule)
