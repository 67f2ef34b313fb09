"""The capture's rules, one module each: split points, submodules that run whole and why, what is
refused in ``forward``'s own code (with the line), and what a layer carries across a device."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from lightning_pipe import PlanningError, pipe_split
from lightning_pipe.capture import capture


class _Blocks(nn.Module):
    def __init__(self, count: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(3, 3) for _ in range(count))


class _SplitPoints(_Blocks):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            x = torch.relu(block(x))
            if index == 0:
                pipe_split()
        return x


class _Router(nn.Module):
    """Decides on tensor values: cannot be a graph, runs whole."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left(x) if x.mean() > 0 else self.right(x)


class _WithRouter(_Blocks):
    def __init__(self) -> None:
        super().__init__(2)
        self.router = _Router()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.router(self.blocks[0](x)))


class _RowsInForward(_Blocks):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.reshape(len(x), -1)  # the number of rows as a Python int


class _TrainingOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:  # extra operations in train mode only
            x = x + 0.1 * torch.tanh(x)
        return self.scale(x)


class _WithTrainingOnly(_Blocks):
    def __init__(self) -> None:
        super().__init__(2)
        self.extra = _TrainingOnly()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.extra(self.blocks[0](x)))


class _Broken(_Blocks):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x).view(7, 7)


class _CarriesDevice(_Blocks):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device
        x = x + torch.zeros(3, device=device)  # the device read in the first layer...
        for block in self.blocks:
            x = block(x)
        return x + torch.arange(3, device=device)  # ...and used again in the last


def test_split_points_make_the_layers() -> None:
    """Two segments around the one pipe_split() call, whatever the stages asked."""
    captured = capture(_SplitPoints(), (torch.randn(4, 3),), stages=3)
    assert len(captured.layers) == 2
    assert [spec.name for spec in captured.specs] == ["blocks.0", "blocks.1+blocks.2+blocks.3"]
    pipe_split()  # outside tracing: nothing


def test_a_submodule_deciding_on_values_runs_whole() -> None:
    """The router's forward decides on x.mean(): it becomes one node, the rest is still split, and
    the reason (with its line) is kept for the plan."""
    module = _WithRouter()
    captured = capture(module, (torch.randn(4, 3),), stages=2)
    assert list(captured.graph.leaves) == ["router"]
    assert "decision on tensor values (a condition)" in captured.graph.leaves["router"]
    assert "x.mean() > 0" in captured.graph.leaves["router"]
    assert [spec.name for spec in captured.specs] == ["blocks.0", "router", "blocks.1"]


def test_the_number_of_rows_in_forward_itself_is_refused_with_the_line() -> None:
    with pytest.raises(
        PlanningError, match=r"with 2 rows instead of 4 .*x.reshape\(len\(x\), -1\).*configure_pipeline"
    ):
        capture(_RowsInForward(), (torch.randn(4, 3),), stages=2)


def test_a_submodule_with_train_only_operations_runs_whole() -> None:
    """_TrainingOnly records more operations in train mode than in eval mode: it runs whole, so both
    modes run its own code."""
    captured = capture(_WithTrainingOnly(), (torch.randn(4, 3),), stages=2)
    assert list(captured.graph.leaves) == ["extra"]
    assert "other operations in eval mode" in captured.graph.leaves["extra"]


def test_forward_failing_on_its_input_is_said_as_such() -> None:
    with pytest.raises(PlanningError, match=r"forward fails on the first micro-batch at .*view\(7, 7\): RuntimeError"):
        capture(_Broken(), (torch.randn(4, 3),), stages=2)


def test_a_device_read_upstream_arrives_as_the_receiving_stage_device() -> None:
    """x.device is read in the first layer and used in the last: the carried device is replaced by
    the device of the tensors the layer receives."""
    captured = capture(_CarriesDevice(), (torch.randn(4, 3),), stages=2)
    last = captured.layers[-1]
    assert last._device_slots  # the device crosses into the last layer
    carried = [torch.device("meta") if i in last._device_slots else torch.randn(4, 3) for i in range(2)]
    assert last(tuple(carried)).device.type == "cpu"


def test_capture_keeps_shapes_not_the_micro_batch_activations() -> None:
    """The captured graph keeps each traced value's shape and type on the meta device, and no
    activation of the traced micro-batch stays allocated once ``capture`` returns, even with the
    garbage collector off (the tracer sits in torch.fx's reference cycles, which would keep every
    layer's activation of the first micro-batch for the whole run)."""
    width = 37  # a shape no other tensor of the test has
    model = nn.Sequential(nn.Linear(5, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))
    gc.collect()
    gc.disable()
    try:
        captured = capture(model, (torch.randn(11, 5),), {}, stages=2)
        alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == (11, width)]
        assert [t for t in alive if not t.is_meta] == []
    finally:
        gc.enable()
    values = [s.value for s in captured.graph.shadows.values() if isinstance(s.value, torch.Tensor)]
    assert values and all(v.is_meta for v in values)
    assert (11, width) in {tuple(v.shape) for v in values}


def test_tracing_holds_the_values_forward_holds_not_every_one() -> None:
    """While ``forward`` is traced on the real micro-batch, a node's value is released (to its meta
    shape) once no proxy of it is left: at the last layer of a chain of 12, at most the few values
    an untraced forward would hold are alive, not the 12 (the capture's peak would be every layer's
    activation of the micro-batch at once)."""
    width, blocks = 41, 12  # a shape no other tensor of the test has
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(blocks)])
    alive: list[int] = []

    def count(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == (7, width)]
        alive.append(sum(not t.is_meta for t in found))

    model[-1].register_forward_pre_hook(count)
    capture(model, (torch.randn(7, width),), {}, stages=2)
    assert alive and max(alive) <= 3


class _Heads(nn.Module):
    """Attention-style code: a projection split in three, a shape built by unpacking one part's."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(4, 12), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(4, dim=-1)
        shape = (*k.shape[:-1], 2, 2)
        return self.out((q.view(shape) * k.view(shape) + v.view(shape)).flatten(-2))


class _WithHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.heads, self.last = nn.Linear(4, 4), _Heads(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.heads(self.first(x)))


def test_tensors_split_apart_are_still_tensors_not_values() -> None:
    """``q, k, v = proj(x).split(n)`` then ``(*k.shape[:-1], ...)`` (GPT-2's attention in
    ``transformers``): the parts of a split are tensors, not values read from one, so the module is
    traced through (no leaf, no retrace) and its layers chain to ``forward``."""
    torch.manual_seed(0)
    module, x = _WithHeads(), torch.randn(3, 5, 4)
    captured = capture(module, (x,), stages=2)
    assert captured.graph.leaves == {}
    assert {"heads.qkv", "heads.out"} <= {str(n.target) for n in captured.graph.graph.nodes if n.op == "call_module"}
    carried: object = (x,)
    for layer in captured.layers:
        carried = layer(carried)
    with torch.no_grad():
        assert torch.equal(carried, module(x))


class _UnpacksValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        low, high = torch.stack([h.min(), h.max()]).tolist()  # values read out of a tensor, unpacked by count
        weight, bias = self.last.weight, self.last.bias
        return nn.functional.linear((h - low) / (high - low), weight, bias)


def test_values_read_out_of_a_tensor_unpack_by_the_count_in_the_code() -> None:
    """``low, high = t.tolist()``: the two values are nodes taken apart by the unpacking's count (their
    number is not read from the tensor); the chain recomputes them from each batch, as ``forward``."""
    torch.manual_seed(0)
    module = _UnpacksValues()
    captured = capture(module, (torch.randn(4, 3),), stages=1, layers_per_stage=1)
    assert captured.graph.leaves == {}
    x = torch.randn(6, 3) * 5
    carried: object = (x,)
    for layer in captured.layers:
        carried = layer(carried)
    with torch.no_grad():
        assert torch.allclose(carried, module(x))
