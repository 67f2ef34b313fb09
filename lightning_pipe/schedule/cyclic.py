"""Cyclic Data Parallelism (Fournier & Oyallon 2024, §3.2 and §4, Fig. 1 and 2).

Micro-batch ``g`` (counted over all steps) starts two time steps after micro-batch ``g - 1``: its
forward on stage ``j`` runs at ``2g + j`` and its backward at ``2g + 2P - 1 - j``, so every stage
alternates one forward and one backward and activation memory stays flat instead of peaking.
The same timeline runs in five settings (``form``):

- ``"pipeline"``: one worker per stage (the PP form, Fig. 2c-iii), which is 1F1B without flush;
- ``"pyramid"``: model parallelism where a worker holds one micro-batch's activations at a time;
  stage ``j`` needs ``P - j`` workers shared round robin by the micro-batches, ``P(P+1)/2`` in all
  (Fig. 2c-ii); the workers of a stage all hold its weights and all-reduce its gradients;
- ``"single"``: one device runs every micro-batch of the timeline in its time order (§4.1, Fig.
  2a-ii): about ``(N+1)/2`` micro-batches' activations alive instead of ``N``;
- ``"dp"``: ``N`` workers, each a full replica computing its own micro-batch of every step, started
  two time steps after the previous one, or 1/N of a pass in time when the stages' durations are
  known (a cue: ``SIGNAL``/``WAIT``) (§4.2, Fig. 2b-ii). A stage's
  gradient is reduced point to point during the step (a :class:`Ring`): each worker adds its gradient
  to the partial sum of the previous one and passes it on as soon as its backward of the stage is
  done; the last one holds the sum and passes it to the others in the order they next compute the
  stage, each applying the update just before that;
- ``"zero"``: as ``"dp"``, but each stage's parameters, gradient and optimizer state live on one
  worker at a time (§4.4, Fig. 2d-ii): the stage is computed by one worker at each time step, which
  passes its whole state point to point to the worker computing it at the next (the schedule's
  relays), so the gradient sums itself on the way and the last micro-batch's worker updates it; no
  broadcast, no all-gather. Between runs stage ``j`` rests on worker ``j mod N``, its owner.

The update rules are CDP-v1 (``θ_{t-1}`` everywhere, = 2BW) and CDP-v2 (stage ``j`` of micro-batch
``i`` uses ``θ_t`` when ``i + j >= P - 1``, which the timeline has just produced).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.ir import Action, Kind, Ring, Schedule
from lightning_pipe.schedule.pipeline import check_sizes
from lightning_pipe.schedule.versions import formula_version

__all__ = ["CUE_TOLERANCE", "FORMS", "Durations", "cdp", "cue_after"]

Durations = tuple[Sequence[float], Sequence[float]]
"""Each stage's forward and backward seconds."""

CUE_TOLERANCE = 0.01
"""How far past ``1/N`` of a pass the dp form's cue may fall (:func:`cue_after`), as a fraction of it."""

FORMS: dict[str, str] = {
    "pipeline": "one worker per stage (Fig. 2c-iii)",
    "pyramid": "P - j workers for stage j, P(P+1)/2 in all (Fig. 2c-ii)",
    "single": "every micro-batch on one device (§4.1, Fig. 2a-ii)",
    "dp": "one full replica per micro-batch, gradients reduced along a ring (§4.2, Fig. 2b-ii)",
    "zero": "one replica per micro-batch, each stage's state on one worker at a time (§4.4, Fig. 2d-ii)",
}


def _timed(stages: int, microbatches: int, steps: int) -> list[tuple[float, Action]]:
    """Every action with its time step in the cyclic timeline, updates included (each stage's
    right after the step's last gradient of it)."""
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


def _in_time_order(timed: list[tuple[float, Action]]) -> list[Action]:
    """Actions by time step; at the same time step backwards first (they free activations)."""
    return [a for _, a in sorted(timed, key=lambda e: (e[0], e[1].kind is not Kind.B, e[1].stage))]


def _model_parallel_orders(
    stages: int, microbatches: int, steps: int, form: str
) -> tuple[list[list[Action]], list[range]]:
    """The pipeline, pyramid and single forms: stage ``j`` on ``width[j]`` workers from ``first[j]``,
    its micro-batches dealt round robin, each worker updating its stages right after the step's last
    gradient."""
    width = [stages - j if form == "pyramid" else 1 for j in range(stages)]
    first = [0] * stages
    if form != "single":
        for j in range(1, stages):
            first[j] = first[j - 1] + width[j - 1]
    timed: list[list[tuple[float, Action]]] = [[] for _ in range(first[-1] + width[-1])]
    for time, action in _timed(stages, microbatches, steps):
        if action.kind is Kind.UPDATE:
            for k in range(width[action.stage]):
                timed[first[action.stage] + k].append((time, action))
        else:
            g = action.step * microbatches + action.microbatch
            timed[first[action.stage] + g % width[action.stage]].append((time, action))
    return [_in_time_order(order) for order in timed], [range(first[j], first[j] + width[j]) for j in range(stages)]


def _need_time(stages: int, microbatches: int, rule: str, worker: int, stage: int) -> float:
    """When, in the steady state, ``worker`` (micro-batch ``worker`` of every step) first computes
    ``stage`` with the weights of step ``t``'s update, ``t`` a step far from the start."""
    t = 4
    for later in range(t + 1, t + 4):
        forward = Action(Kind.F, stage, worker, later)
        if formula_version(rule, forward, stages) >= t + 1:
            return 2 * (later * microbatches + worker) + stage
    raise AssertionError("every rule uses a step's weights within two steps")  # pragma: no cover


def cue_after(stages: int, microbatches: int, durations: Durations | None = None) -> int:
    """Which action of a pass (``F_0 .. F_(P-1)``, then ``B_(P-1) .. B_0``) the previous worker's cue
    follows in the dp form: the last one ending by ``1/N`` of the pass (or at most 1% after it), the
    uniform delay of §3.2 as nearly as whole actions allow. A later one would idle the replicas: N
    delays would outlast the pass (by up to 1% of it here, so that durations a hair apart do not
    flip the choice). ``durations`` are each stage's forward and backward seconds; without them
    every action takes one time step and the cue follows the second action: the paper's two time
    steps. Real backwards outlast forwards, so two actions fall short of ``1/N`` of a pass and would
    bring the replicas' activation peaks closer together than the paper's. A first forward longer
    than ``1/N`` of the pass is followed all the same, and the replicas then wait for each other:
    split the model finer at its start."""
    forward, backward = durations if durations is not None else ([1.0] * stages, [1.0] * stages)
    if len(forward) != stages or len(backward) != stages:
        raise PlanningError(f"cdp: {len(forward)} forward and {len(backward)} backward durations for {stages} stages")
    if min(*forward, *backward) < 0:
        raise PlanningError(f"cdp: durations cannot be negative; got {list(forward)}, {list(backward)}")
    ends = list(itertools.accumulate([*forward, *reversed(backward)]))
    target = ends[-1] / microbatches * (1 + CUE_TOLERANCE)
    return max([a for a, end in enumerate(ends) if end <= target], default=0)


def _cues(stages: int, microbatches: int, steps: int, after: int) -> list[tuple[int, float, Action]]:
    """The uniform delay of the dp form as cues ``(worker, time, action)``: micro-batch ``g`` starts
    once the worker of micro-batch ``g - 1`` has done action ``after`` of it (:func:`cue_after`),
    which the timeline puts at time step ``2(g - 1) + after``."""
    cues = []
    for g in range(1, steps * microbatches):
        step, worker = divmod(g, microbatches)
        previous = (worker - 1) % microbatches
        key = (0, worker, step)
        cues.append((previous, 2 * (g - 1) + after + 0.9, Action(Kind.SIGNAL, *key, peer=worker)))
        cues.append((worker, 2 * g - 0.05, Action(Kind.WAIT, *key, peer=previous)))
    return cues


def _data_parallel_orders(stages: int, microbatches: int, steps: int, rule: str, after: int) -> list[list[Action]]:
    """The dp form: worker ``k`` computes micro-batch ``k`` of every step in the timeline's order,
    waiting for the previous worker's cue before each of its micro-batches (:func:`_cues`), and
    updates stage ``j`` of step ``t`` just before its first action using the new weights (after its
    last use of the weights it replaces: one version held at a time), or at its end."""
    orders = []
    cues = _cues(stages, microbatches, steps, after)
    for worker in range(microbatches):
        timed = [(time, a) for time, a in _timed(stages, microbatches, steps) if a.microbatch == worker]
        timed += [(time, a) for w, time, a in cues if w == worker]
        actions = _in_time_order(timed)
        placed: list[Action] = []
        updates = [0] * stages  # per stage, the next step whose update is still to place
        for action in actions:
            if action.kind in (Kind.F, Kind.B):
                version = formula_version(rule, action, stages)
                while updates[action.stage] < version:
                    placed.append(Action(Kind.UPDATE, action.stage, None, updates[action.stage]))
                    updates[action.stage] += 1
            placed.append(action)
        rest = [Action(Kind.UPDATE, j, None, t) for t in range(steps) for j in range(stages) if t >= updates[j]]
        orders.append(placed + rest)
    return orders


def _zero_orders(stages: int, microbatches: int, steps: int) -> tuple[list[list[Action]], list[tuple[Action, ...]]]:
    """The ZeRO form: worker ``k`` computes micro-batch ``k`` of every step in the timeline's order; a
    stage's state goes from action to action in the timeline's order (its relay), the step's update
    included: the worker of the step's last micro-batch, which holds it after the step's last
    backward, updates it before passing it on."""
    timed = _timed(stages, microbatches, steps)
    orders = []
    for worker in range(microbatches):
        mine = [(time, a) for time, a in timed if a.microbatch == worker]
        if worker == microbatches - 1:
            mine += [(time, a) for time, a in timed if a.kind is Kind.UPDATE]
        orders.append(_in_time_order(mine))
    by_time = sorted(timed, key=lambda e: e[0])
    relays = [tuple(a for _, a in by_time if a.stage == j) for j in range(stages)]
    return orders, relays


def _rings(stages: int, microbatches: int, rule: str) -> list[Ring]:
    """Each stage's ring in the dp form: gathered in micro-batch order (the reducer is the worker of
    the step's last micro-batch), spread in the order the workers next compute the stage."""
    reducer = microbatches - 1
    rings = []
    for stage in range(stages):
        others = sorted(range(reducer), key=lambda k: _need_time(stages, microbatches, rule, k, stage))
        rings.append(Ring(gather=tuple(range(microbatches)), spread=tuple(others)))
    return rings


def cdp(
    stages: int,
    microbatches: int,
    steps: int = 2,
    *,
    form: str = "pipeline",
    rule: str = "cdp_v2",
    durations: Durations | None = None,
) -> Schedule:
    """Cyclic Data Parallelism in one of its :data:`FORMS`; ``durations`` (each stage's forward and
    backward seconds) place the dp form's cues 1/N of a pass apart (:func:`cue_after`)."""
    check_sizes("cdp", stages, microbatches, steps)
    if form not in FORMS:
        raise PlanningError(f"cdp: form must be one of {', '.join(map(repr, FORMS))}; got {form!r}")
    if rule not in ("cdp_v1", "cdp_v2"):
        raise PlanningError(f"cdp: rule must be 'cdp_v1' or 'cdp_v2', got {rule!r}")
    if microbatches < stages - 1:
        raise PlanningError(
            f"cdp: {microbatches} micro-batches per step cannot keep a delay of one step on {stages} stages: the "
            f"first stage would need θ_(t-1) before it exists; use m >= P - 1 = {stages - 1} (the paper uses m = P)"
        )
    if form in ("dp", "zero") and microbatches < stages:
        raise PlanningError(
            f"cdp: the {form} form computes micro-batch k of every step on worker k; with {stages} stages and "
            f"{microbatches} micro-batches a worker's consecutive micro-batches would overlap: use microbatches >= "
            f"stages (the paper: N = P), or fewer stages"
        )
    rings: list[Ring] = []
    relays: list[tuple[Action, ...]] = []
    params: dict[str, object] = {"form": form}
    if form == "zero":
        orders, relays = _zero_orders(stages, microbatches, steps)
        owners = [(stage % microbatches,) for stage in range(stages)]  # at rest, the stages spread over the workers
    elif form == "dp":
        params["cue_after"] = after = cue_after(stages, microbatches, durations)
        orders = _data_parallel_orders(stages, microbatches, steps, rule, after)
        owners = [range(microbatches)] * stages
        rings = _rings(stages, microbatches, rule)
    else:
        orders, owners = _model_parallel_orders(stages, microbatches, steps, form)
    return Schedule(
        family="cdp",
        stages=stages,
        microbatches=microbatches,
        steps=steps,
        orders=orders,
        owners=owners,
        rule=rule,
        flush=False,
        rings=rings,
        relays=relays,
        params=params,
    )
