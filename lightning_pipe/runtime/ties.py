"""Parameters shared by several stages: tied weights.

A parameter used by layers of two stages (a GPT's token embedding and its LM head, ``wte.weight =
lm_head.weight``) is kept by every stage that uses it, as DeepSpeed's ``TiedLayerSpec`` does. Each
copy receives only its own stage's part of the gradient, so before a step is applied the parts are
summed over the stages that share the parameter (one all-reduce per group of sharing stages), and
every copy takes the same update from the same sum: the copies stay equal, bitwise, and the
parameter follows the update rule of the unsplit model.

- **Flushing schedules** (GPipe, 1F1B, ZB, ...): every update of a call waits for the call's end, the
  tied sums run there in one order on every worker, then the updates (``deferring`` in the executor).
- **Non-flushing schedules** (PipeDream, 2BW, CDP): a stage's update of step ``t`` sums its part with
  the other stages' parts of step ``t``; the update waits for the last of them (its holder's last
  backward of step ``t``). Each part is computed with the version the schedule's rule gives its own
  stage, so under 2BW every part of step ``t`` is taken at ``θ_{t−1}`` (the rule of the unsplit model);
  under PipeDream's stashing or CDP-v2 the stages use different versions for one micro-batch, and so
  do the parts of the sum.
- A stage with replicas contributes ``1/r`` of its replicas' sum from each replica.
- A worker holding several sharing stages (every stage on one device, ``form="single"``) sums their
  parts at the first of their updates of a step (:func:`sum_ties`). Under a flushing schedule it holds
  the parameter once: the first of those stages updates it, the others compute through views of it
  of their own (:func:`updated_elsewhere_here`), so each stage's part of the gradient stays apart until
  the sum, and the parameter takes one update from it, as in the unsplit model. Under a non-flushing
  one each stage keeps its own copy and versions, as on workers of their own; its program runs every
  sharing stage's update of a step after all their backwards of the step
  (:func:`~lightning_pipe.schedule.tied_updates.with_tied_updates`: on workers of their own the
  collective waits for them). A non-flushing pipeline of several workers with two sharing stages on
  one worker is refused (:func:`tie_groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.errors import PlanningError
from lightning_pipe.runtime.borrowing import Lending
from lightning_pipe.runtime.weights import StageWeights
from lightning_pipe.schedule.ir import Action, Schedule
from lightning_pipe.schedule.tied_updates import with_tied_updates

__all__ = ["Tie", "find_ties", "sum_ties", "tie_groups", "tied_maker", "updated_elsewhere_here"]


@dataclass
class Tie:
    """Parameters shared by the same stages.

    Attributes:
        stages: the stages sharing them.
        names: their names in the first sharing stage (for messages).
        parameters: the shared parameters (the same objects in every sharing stage).
        positions: stage -> their indices among that stage's parameters (this worker's stages).
        group: the process group of this pipeline's workers holding a sharing stage (``None`` when
            this worker holds none).
    """

    stages: tuple[int, ...]
    names: list[str]
    parameters: list[nn.Parameter]
    positions: dict[int, list[int]] = field(default_factory=dict)
    group: dist.ProcessGroup | None = None
    pending: dict[int, int] = field(default_factory=dict)  # step -> local updates still to come after its sum

    def sum(self, parts: Mapping[int, tuple[list[torch.Tensor | None], float]]) -> None:
        """Replace each local stage's gradients of the tied parameters by their sum over the sharing
        stages. ``parts``: this worker's sharing stages -> (their gradients, their share: ``1/r`` for
        a stage with ``r`` replicas)."""
        local = None
        for stage, (grads, share) in parts.items():
            indices = zip(self.positions[stage], self.parameters, strict=True)
            flat = torch.cat([_gradient(grads, i, p).reshape(-1) for i, p in indices])
            local = flat * share if local is None else local + flat * share
        assert local is not None
        dist.all_reduce(local, group=self.group)
        pieces = local.split([p.numel() for p in self.parameters])
        for stage, (grads, _) in parts.items():
            for index, param, summed in zip(self.positions[stage], self.parameters, pieces, strict=True):
                value = summed.view_as(param).to(param.dtype)
                grads[index] = value.clone() if len(parts) > 1 else value  # each local stage its own tensor


def _gradient(grads: list[torch.Tensor | None], index: int, param: nn.Parameter) -> torch.Tensor:
    grad = grads[index]
    return torch.zeros_like(param) if grad is None else grad


def find_ties(modules: Mapping[int, nn.Module]) -> list[Tie]:
    """The trainable parameters found in more than one of ``modules`` (stage -> module), grouped by
    the stages sharing them, in the order of those stages."""
    holders: dict[int, list[int]] = {}
    named: dict[int, tuple[str, nn.Parameter]] = {}
    for stage in sorted(modules):
        for name, param in modules[stage].named_parameters():
            if param.requires_grad:
                holders.setdefault(id(param), []).append(stage)
                named.setdefault(id(param), (name, param))
    ties: dict[tuple[int, ...], Tie] = {}
    for key, stages in holders.items():
        if len(stages) > 1:
            name, param = named[key]
            tie = ties.setdefault(tuple(stages), Tie(tuple(stages), [], []))
            tie.names.append(name)
            tie.parameters.append(param)
    return [ties[key] for key in sorted(ties)]


def updated_elsewhere_here(ties: list[Tie], stages: Collection[int]) -> dict[int, set[int]]:
    """Stage -> the shared parameters (by ``id``) another of ``stages`` (this worker's) updates: of
    each tie, every local sharing stage but the first."""
    shared: dict[int, set[int]] = {}
    for tie in ties:
        for stage in [s for s in tie.stages if s in stages][1:]:
            shared.setdefault(stage, set()).update(id(p) for p in tie.parameters)
    return shared


def tied_maker(make: Callable[[int], Schedule], ties: list[Tie]) -> Callable[[int], Schedule]:
    """``make`` (steps -> schedule), its programs reordered so that every sharing stage's update of a
    step follows all their backwards of the step where one worker runs a non-flushing schedule
    (:func:`~lightning_pipe.schedule.tied_updates.with_tied_updates`); ``make`` itself without ties."""
    groups = [tie.stages for tie in ties]
    if not groups:
        return make

    def tied(steps: int) -> Schedule:
        schedule = make(steps)
        return schedule if schedule.flush or schedule.workers != 1 else with_tied_updates(schedule, groups)

    return tied


def tie_groups(
    ties: list[Tie],
    schedule: Schedule,
    pipelines: Sequence[Sequence[int]],
    rank: int,
    lending: Lending,
    weights: Mapping[int, StageWeights],
) -> list[Tie]:
    """Each tie with the process group of the workers of this pipeline holding its stages (every
    rank, ``rank`` among them, creates every group, in the same order), and the positions of its
    parameters in this worker's stages (``weights``; ``lending``: this worker's)."""
    for tie in ties:
        if any(s in lending.lenders or s in lending.borrowers for s in tie.stages):
            raise PlanningError(
                f"parameters {tie.names} are shared by stages {list(tie.stages)}, one of which lends its weights "
                "(FSDP, FSLPP): shared parameters need every sharing stage to own them"
            )
        for ranks in pipelines:
            holders = sorted({ranks[w] for s in tie.stages for w in schedule.owners[s]})
            group = dist.new_group(holders)
            if rank in holders:
                tie.group = group
        for s in tie.stages:
            if s in weights:
                positions = weights[s]._position
                tie.positions[s] = [positions[id(p)] for p in tie.parameters]
    if not schedule.flush and schedule.workers > 1:
        for worker, orders in enumerate(schedule.orders):
            held = {a.stage for a in orders} & {s for tie in ties for s in tie.stages}
            if len(held) > 1:
                raise PlanningError(
                    f"worker {worker} holds stages {sorted(held)} whose parameters are shared with other stages; "
                    f"a non-flushing schedule ({schedule.family}) sums shared gradients at each stage's own "
                    "update, which needs one sharing stage per worker: use one stage per worker, every stage on one "
                    "device (form='single'), or a flushing schedule"
                )
    return ties


def sum_ties(
    ties: list[Tie], actions: Sequence[Action], weights: Mapping[int, StageWeights], owners: Sequence[Sequence[int]]
) -> None:
    """Sum the tied parameters' gradients of the updates ``actions`` over the stages sharing them,
    tie after tie in one order on every worker (a stage with ``owners`` counting ``1/r`` from each of
    its ``r``). A worker holding several sharing stages sums all their parts of a step at the first
    of their updates of it, once: the later ones find their gradients summed."""
    for tie in ties:
        steps = sorted({a.step for a in actions if a.stage in tie.positions})
        for step in steps:
            arrived = sum(1 for a in actions if a.stage in tie.positions and a.step == step)
            if step in tie.pending:
                tie.pending[step] -= arrived
                if tie.pending[step] <= 0:
                    del tie.pending[step]
                continue
            parts = {
                stage: (weights[stage].summed_gradients(step), 1.0 / len(owners[stage])) for stage in tie.positions
            }
            tie.sum(parts)
            if len(parts) > arrived:
                tie.pending[step] = len(parts) - arrived
