"""Cyclic Data Parallelism (Fournier & Oyallon 2024, §3.2 and §4.3, Fig. 1).

Micro-batch ``g`` (counted over all steps) starts two time steps after micro-batch ``g - 1``: its
forward on stage ``j`` runs at ``2g + j`` and its backward at ``2g + 2P - 1 - j``, so every stage
alternates one forward and one backward and activation memory stays flat instead of peaking.

- ``form="pipeline"``: one worker per stage (the PP form of CDP, Fig. 2c-iii), which is 1F1B
  without flush;
- ``form="pyramid"``: model parallelism where a worker holds one micro-batch's activations at a time;
  stage ``j`` needs ``P - j`` workers shared round robin by the micro-batches, ``P(P+1)/2`` in all
  (Fig. 2c-ii); the workers of a stage all hold its weights and reduce its gradients.

The update rules are CDP-v1 (``θ_{t-1}`` everywhere, = 2BW) and CDP-v2 (stage ``j`` of micro-batch
``i`` uses ``θ_t`` when ``i + j >= P - 1``, which the timeline has just produced). Each worker
updates a stage right after the step's last gradient of it.
"""

from __future__ import annotations

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.ir import Action, Kind, Schedule
from lightning_pipe.schedule.pipeline import check_sizes

__all__ = ["cdp"]


def _timed(stages: int, microbatches: int, steps: int) -> list[tuple[float, Action]]:
    """Every action with its time step in the cyclic timeline, updates included."""
    timed = []
    for t in range(steps):
        for i in range(microbatches):
            g = t * microbatches + i
            for j in range(stages):
                timed.append((2 * g + j, Action(Kind.F, j, i, t)))
                timed.append((2 * g + 2 * stages - 1 - j, Action(Kind.B, j, i, t)))
        last = (t + 1) * microbatches - 1
        for j in range(stages):
            timed.append((2 * last + 2 * stages - j - 0.5, Action(Kind.UPDATE, j, None, t)))
    return timed


def cdp(stages: int, microbatches: int, steps: int = 2, *, form: str = "pipeline", rule: str = "cdp_v2") -> Schedule:
    """Cyclic Data Parallelism in its pipeline or pyramid form."""
    check_sizes("cdp", stages, microbatches, steps)
    if form not in ("pipeline", "pyramid"):
        raise PlanningError(f"cdp: form must be 'pipeline' or 'pyramid', got {form!r}")
    if rule not in ("cdp_v1", "cdp_v2"):
        raise PlanningError(f"cdp: rule must be 'cdp_v1' or 'cdp_v2', got {rule!r}")
    if microbatches < stages - 1:
        raise PlanningError(
            f"cdp: {microbatches} micro-batches per step cannot keep a delay of one step on {stages} stages: the "
            f"first stage would need θ_(t-1) before it exists; use m >= P - 1 = {stages - 1} (the paper uses m = P)"
        )
    first = [0] * stages
    for j in range(1, stages):
        first[j] = first[j - 1] + (1 if form == "pipeline" else stages - j + 1)
    width = [1 if form == "pipeline" else stages - j for j in range(stages)]
    workers = first[-1] + width[-1]
    orders: list[list[tuple[float, Action]]] = [[] for _ in range(workers)]
    for time, action in _timed(stages, microbatches, steps):
        if action.kind is Kind.UPDATE:
            for k in range(width[action.stage]):
                orders[first[action.stage] + k].append((time, action))
        else:
            g = action.step * microbatches + action.microbatch
            orders[first[action.stage] + g % width[action.stage]].append((time, action))
    return Schedule(
        family="cdp",
        stages=stages,
        microbatches=microbatches,
        steps=steps,
        orders=[[a for _, a in sorted(order, key=lambda e: e[0])] for order in orders],
        owners=[range(first[j], first[j] + width[j]) for j in range(stages)],
        rule=rule,
        flush=False,
        params={"form": form},
    )
