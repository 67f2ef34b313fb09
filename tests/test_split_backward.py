"""Input gradients now, weight gradients later: the same numbers as one backward, nothing computed twice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.runtime.split_backward import SplitBackward


class Shared(nn.Module):
    """A weight used twice, a branch that depends on the weights only, and a skip connection."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.a(h) * self.scale + x + self.scale**2


MODULES = {
    "mlp": lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)),
    "conv-bn": lambda: nn.Sequential(
        nn.Unflatten(1, (1, 6)),
        nn.Conv1d(1, 3, 3, padding=1),
        nn.BatchNorm1d(3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(18, 6),
    ),
    "shared": Shared,
}


@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("first_stage", [False, True])
def test_halves_equal_one_backward(name: str, first_stage: bool) -> None:
    torch.manual_seed(0)
    module = MODULES[name]()
    params = list(module.parameters())
    x = torch.randn(4, 6, requires_grad=not first_stage)
    out = module(x)
    grad = torch.randn_like(out)
    expected = torch.autograd.grad([out], ([x] if not first_stage else []) + params, [grad], retain_graph=True)

    split = SplitBackward([out], [grad], [] if first_stage else [x], params)
    input_grads = split.input_gradients()
    weight_grads: list[torch.Tensor | None] = [None] * len(params)

    def add(index: int, grad: torch.Tensor) -> None:
        weight_grads[index] = grad if weight_grads[index] is None else weight_grads[index] + grad

    split.weight_gradients(add)
    got = input_grads + weight_grads
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_weight_half_does_not_redo_the_input_half() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])
    x = torch.randn(32, 64, requires_grad=True)
    out = module(x)
    runs = {"tanh": 0}
    stack, seen = [out.grad_fn], set()
    while stack:  # count how often autograd differentiates each tanh, over both halves
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__.startswith("TanhBackward"):
            node.register_prehook(lambda grads: runs.__setitem__("tanh", runs["tanh"] + 1))
        stack += [child for child, _ in node.next_functions]
    split = SplitBackward([out], [torch.ones_like(out)], [x], list(module.parameters()))
    split.input_gradients()
    assert runs["tanh"] == 6
    split.weight_gradients(lambda index, grad: None)
    assert runs["tanh"] == 6
