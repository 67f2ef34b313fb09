"""Input gradients now, weight gradients later: the same numbers as one backward, nothing computed twice."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.runtime.split_backward import SplitBackward, _executed, _nodes


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


def _fired(roots: list[torch.Tensor]) -> tuple[list, set]:
    """Pre-hooks on every node of the graph: which ones autograd runs."""
    fired: set = set()
    hooks = [node.register_prehook(lambda grads, node=node: fired.add(node)) for node in _nodes(roots)]
    return hooks, fired


@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("input_used", [True, False])
def test_the_input_half_knows_beforehand_which_nodes_autograd_runs(name: str, input_used: bool) -> None:
    """``I`` plans which nodes keep their gradient before autograd runs: the nodes it predicts are
    exactly those autograd runs (a node predicted but not run would leave its weights to the slower
    path from the outputs; one run but not predicted would keep its gradient for nothing)."""
    torch.manual_seed(0)
    module = MODULES[name]()
    x = torch.randn(4, 6, requires_grad=True)
    out = module(x if input_used else x.detach() + 0 * x.sum())
    hooks, fired = _fired([out])
    torch.autograd.grad([out], [x], [torch.ones_like(out)], retain_graph=True)
    for hook in hooks:
        hook.remove()
    assert _executed(_nodes([out]), [x]) == fired
    split = SplitBackward([out], [torch.ones_like(out)], [x], list(module.parameters()))
    split.input_gradients()
    assert set(split.captured) == set(split.resume) <= fired


def test_only_the_gradients_the_weight_half_resumes_from_are_kept() -> None:
    """Between the halves a chain of Linear + Tanh keeps one gradient per Linear (what flows into its
    addmm node), not the Tanh's: 6 x (32 x 64) floats; ``W`` frees them as it goes."""
    module = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])
    x = torch.randn(32, 64, requires_grad=True)
    out = module(x)
    split = SplitBackward([out], [torch.ones_like(out)], [x], list(module.parameters()))
    split.input_gradients()
    assert split.kept_bytes == 6 * 32 * 64 * 4
    left: list[int] = []
    split.weight_gradients(lambda index, grad: left.append(split.kept_bytes))
    assert left[0] < 6 * 32 * 64 * 4 and split.kept_bytes == 0


class Program(nn.Module):
    """A random graph over a few shared weights: linear maps (a weight used once or several times),
    tanh, scaling by a shared scalar, skip connections to any earlier value, several outputs summed."""

    def __init__(self, ops: list[tuple[str, int]], outputs: list[int]) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(5, 5) for _ in range(3))
        self.scale = nn.Parameter(torch.tensor(0.7))
        self.ops, self.outputs = ops, outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = [x]
        for op, arg in self.ops:
            last = values[-1]
            if op == "linear":
                values.append(self.linears[arg % 3](last))
            elif op == "tanh":
                values.append(torch.tanh(last))
            elif op == "scale":
                values.append(last * self.scale)
            else:  # skip
                values.append(last + values[arg % len(values)])
        return sum(values[i % len(values)] for i in self.outputs) + self.scale


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["linear", "tanh", "scale", "skip"]), st.integers(0, 20)), max_size=10),
    outputs=st.lists(st.integers(0, 20), min_size=1, max_size=3),
    input_used=st.booleans(),
)
def test_halves_equal_one_backward_on_random_graphs(
    ops: list[tuple[str, int]], outputs: list[int], input_used: bool
) -> None:
    """Oracle: one ``torch.autograd.grad`` over inputs and weights. Graphs include weights reached only
    off the input path, weights used on several paths, and inputs the output does not depend on."""
    torch.manual_seed(0)
    module = Program(ops, outputs)
    params = list(module.parameters())
    x = torch.randn(3, 5, requires_grad=True)
    out = module(x if input_used else x.detach())
    grad = torch.randn_like(out)
    expected = torch.autograd.grad([out], [x, *params], [grad], retain_graph=True, allow_unused=True)
    split = SplitBackward([out], [grad], [x], params)
    hooks, fired = _fired([out])
    got: list[torch.Tensor | None] = split.input_gradients()
    for hook in hooks:
        hook.remove()
    assert set(split.resume) <= fired == _executed(_nodes([out]), [x])
    weights: list[torch.Tensor | None] = [None] * len(params)

    def add(index: int, g: torch.Tensor) -> None:
        weights[index] = g if weights[index] is None else weights[index] + g

    split.weight_gradients(add)
    for a, b in zip([*got, *weights], expected, strict=True):
        assert (a is None or not a.abs().sum()) if b is None else torch.allclose(a, b, atol=1e-5)


def test_a_stages_kept_gradients_are_the_sum_of_its_layers_profiled_ones() -> None:
    """The memory model adds the profiled layers' ``kept_gradient_bytes`` over a stage: that sum is
    what the stage's split backward keeps (oracle: the runtime's own :class:`SplitBackward`)."""
    from lightning_pipe.cost.profiler import profile_layers

    torch.manual_seed(0)
    layers = [nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Unflatten(1, (3, 4)), nn.BatchNorm1d(3)]
    layers += [nn.Flatten(), nn.ReLU(), nn.Linear(12, 5)]
    costs = profile_layers(layers, torch.randn(8, 6), repeats=1, warmup=0)
    stage = nn.Sequential(*layers[1:])
    x = torch.randn(8, 12, requires_grad=True)
    out = stage(x)
    split = SplitBackward([out], [torch.ones_like(out)], [x], list(stage.parameters()))
    split.input_gradients()
    assert split.kept_bytes == sum(layer.kept_gradient_bytes for layer in costs.layers[1:]) > 0
