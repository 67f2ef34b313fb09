"""Every ``torch.optim`` optimizer (and a user's subclass) as the template of the stages' optimizers:
a stage's optimizer over part of the parameters steps them exactly as the template steps them in
the unsplit model, with the template's parameter groups; LBFGS is refused with the reason. Also: the
strategy's names are registered with the standalone ``pytorch_lightning`` too."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

import lightning_pipe  # noqa: F401 - registers the names
from lightning_pipe import PlanningError
from lightning_pipe.strategy.optimizers import stage_optimizers

_OPTIONS = {"SparseAdam": {"lr": 0.01}, "Muon": {"lr": 0.02}}
_NAMES = sorted(
    name
    for name in dir(torch.optim)
    if isinstance(getattr(torch.optim, name), type)
    and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
    and name not in ("Optimizer", "LBFGS")
)


class _Scaled(torch.optim.SGD):
    """A user's subclass whose constructor takes an argument of its own before the defaults."""

    def __init__(self, params: object, scale: float, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr * scale, momentum=0.5)
        self.scale = scale


def _parameters() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(4, 3)) for _ in range(3)]


def _gradients(step: int, sparse: bool) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    grads = [torch.randn(4, 3, generator=generator) for _ in range(3)]
    return [g.to_sparse() for g in grads] if sparse else grads


@pytest.mark.parametrize("name", [*_NAMES, "subclass"])
def test_a_stage_steps_its_parameters_as_the_template_would(name: str) -> None:
    """Two parameter groups (the second with its own learning rate); the stage holds the first and
    third parameters. Three steps of the template over all three parameters and of the stage's
    optimizer over its two give the same values, bitwise."""
    sparse = name == "SparseAdam"

    def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.003}]
        if name == "subclass":
            return _Scaled(groups, scale=0.5)
        return getattr(torch.optim, name)(groups, **_OPTIONS.get(name, {"lr": 0.01}))

    whole, split = _parameters(), _parameters()
    template = build(whole)
    stage = stage_optimizers(build(split))([split[0], split[2]])
    assert type(stage) is type(template)
    for step in range(3):
        grads = _gradients(step, sparse)
        for param, grad in zip(whole, grads, strict=True):
            param.grad = grad.clone()
        template.step()
        for param, grad in zip((split[0], split[2]), (grads[0], grads[2]), strict=True):
            param.grad = grad.clone()
        stage.step()
    assert torch.equal(whole[0], split[0]) and torch.equal(whole[2], split[2])
    assert torch.equal(split[1], _parameters()[1])  # a parameter of another stage is never touched


def test_lbfgs_is_refused_with_the_reason() -> None:
    params = _parameters()
    with pytest.raises(PlanningError, match="LBFGS re-evaluates the loss several times per step"):
        stage_optimizers(torch.optim.LBFGS(params))(params)


def test_the_names_are_registered_with_pytorch_lightning_too() -> None:
    from lightning_pipe.pytorch_lightning import PipelineStrategy

    for name in ("pipe", "pipe_2bw", "pipe_cdp_spawn"):
        assert name in pl.strategies.StrategyRegistry
    assert issubclass(PipelineStrategy, pl.strategies.Strategy)
    assert pl.strategies.StrategyRegistry["pipe_2bw"]["strategy"] is PipelineStrategy
