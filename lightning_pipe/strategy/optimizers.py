"""The user's optimizer as the template of every stage's optimizer.

``configure_optimizers`` returns one optimizer over the whole module. Each stage gets an optimizer of
the same class over its own parameters, with the same parameter groups (a group's hyper-parameters
apply to its parameters in whichever stage they are). The user's optimizer itself never steps: it
carries the hyper-parameters, which Lightning's LR schedulers change in place, and before a stage
applies step ``t`` it takes the values the template had when step ``t`` began — what the unsplit run
would use at that step, even when a non-flushing schedule applies the step a call later.
"""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_pipe.errors import PlanningError

__all__ = ["GROUP_KEY", "HyperParameters", "stage_optimizers"]

GROUP_KEY = "template_group"  # index of the template's parameter group a stage group copies


def stage_optimizers(template: torch.optim.Optimizer) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer | None]:
    """``build(params)``: an optimizer like ``template`` over ``params`` (``None`` if the template
    optimizes none of them: frozen layers). A parameter the template has state for (momentum, Adam's
    moments: restored from a checkpoint of an unsplit run, by Lightning on one device or DDP) starts
    with a copy of that state, so such a run resumes as a pipeline without losing it."""
    group_of = {id(p): index for index, group in enumerate(template.param_groups) for p in group["params"]}

    def build(params: list[nn.Parameter]) -> torch.optim.Optimizer | None:
        groups = []
        for index, group in enumerate(template.param_groups):
            mine = [p for p in params if group_of.get(id(p)) == index]
            if mine:
                options = {key: value for key, value in group.items() if key != "params"}
                groups.append({**options, "params": mine, GROUP_KEY: index})
        if not groups:
            return None
        optimizer = _construct(template, groups)
        for param in params:
            if param in template.state:
                optimizer.state[param] = copy.deepcopy(template.state[param])
        return optimizer

    return build


def _construct(template: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """An optimizer of ``template``'s class over ``groups`` (each group carries every option): built by
    its constructor with the defaults it accepts (``AdamW.defaults`` holds a key its constructor does
    not take, for instance), or, for a constructor that needs more (a subclass's own arguments), as a
    copy of ``template`` whose parameters and state are replaced."""
    cls = type(template)
    if issubclass(cls, torch.optim.LBFGS):
        raise PlanningError(
            "LBFGS re-evaluates the loss several times per step (its closure), which a pipeline cannot: every "
            "micro-batch runs forward and backward once per step; use a first-order optimizer"
        )
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        defaults = dict(template.defaults)
    else:
        defaults = {key: value for key, value in template.defaults.items() if key in parameters}
    try:
        return cls(groups, **defaults)
    except TypeError:
        pass
    optimizer = copy.copy(template)
    optimizer.__dict__ = {key: value for key, value in vars(template).items() if key not in ("state", "param_groups")}
    optimizer.state = defaultdict(dict)
    optimizer.param_groups = []
    for group in groups:
        optimizer.add_param_group(group)
    return optimizer


class HyperParameters:
    """The template's hyper-parameters per step, for the stage optimizers to follow."""

    def __init__(self, template: torch.optim.Optimizer) -> None:
        self.template = template
        self.steps: dict[int, list[dict[str, Any]]] = {}

    def record(self, step: int) -> None:
        """Remember the template's values as step ``step`` begins."""
        self.steps[step] = [
            {key: (value.clone() if isinstance(value, torch.Tensor) else value) for key, value in group.items()}
            for group in ({k: v for k, v in g.items() if k != "params"} for g in self.template.param_groups)
        ]

    def apply(self, step: int, optimizer: torch.optim.Optimizer | None) -> None:
        """Give ``optimizer`` (a stage's) the values of step ``step``; steps before it are forgotten."""
        if optimizer is not None:
            values = self.steps[step]
            for group in optimizer.param_groups:
                group.update(values[group[GROUP_KEY]])
        for old in [s for s in self.steps if s < step - 2]:
            del self.steps[old]
