"""What a layer's backward holds at its peak beyond its saved activations and its parameters'
gradients (``LayerCost.backward_bytes``, :mod:`lightning_pipe.cost.backward_bytes`), and a stage's
memory with it (``MemoryModel.transient_bytes``).

The oracles: a ``Linear``'s backward holds its output's gradient and its input's, nothing else;
autograd functions written here allocate, save and free known sizes; and a stage run whole holds at
its peak more than its saved activations (what a plan counted before), and no more than those and
its largest layer's ``backward_bytes`` (what it counts now)."""

from __future__ import annotations

import torch
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.cost.backward_bytes import BackwardPeak, backward_peak, backward_roots
from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.profile_file import profile_from_dict, profile_to_dict
from lightning_pipe.cost.profiler import profile_layers
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.partition import PlanRequest, evaluate, partition

FLOAT = 4


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 9), widths=st.lists(st.integers(1, 40), min_size=3, max_size=3), bias=st.booleans())
def test_a_linear_layers_backward_holds_its_output_and_input_gradients(
    rows: int, widths: list[int], bias: bool
) -> None:
    """The first layer's input takes no gradient: its backward holds its output's gradient only (its
    weight's gradient is the plan's gradient copy); the second's holds its output's and its input's."""
    a, b, c = widths
    layers = [nn.Linear(a, b, bias=bias), nn.Linear(b, c, bias=bias)]
    costs = profile_layers(layers, torch.randn(rows, a), repeats=1, count_flops=False)
    assert costs.layers[0].backward_bytes == rows * b * FLOAT
    assert costs.layers[1].backward_bytes == rows * (b + c) * FLOAT
    assert profile_from_dict(profile_to_dict(costs)) == costs  # kept in the profile file


class _Scratch(torch.autograd.Function):
    """Its backward makes a scratch tensor of ``size`` floats and drops it before making the input's gradient."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, size: int) -> torch.Tensor:
        ctx.size = size  # type: ignore[attr-defined]
        return x * 1.0

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        scratch = torch.ones(ctx.size)  # type: ignore[attr-defined]
        del scratch
        return grad * 2.0, None


class _SavesBig(torch.autograd.Function):
    """Its forward saves a tensor of ``size`` floats of its own, which autograd frees after the backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, size: int) -> torch.Tensor:
        ctx.save_for_backward(torch.ones(size))
        return x * 1.0

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (big,) = ctx.saved_tensors  # unpacked, as a backward reads what it saved
        del big
        return grad * 3.0, None


class _ScratchThenBig(nn.Module):
    """``_Scratch`` then ``_SavesBig``: the backward frees the big saved tensor before the scratch is made."""

    def __init__(self, scratch: int, big: int) -> None:
        super().__init__()
        self.scratch, self.big = scratch, big

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SavesBig.apply(_Scratch.apply(x, self.scratch), self.big)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 6), scratch=st.integers(0, 4000), big=st.integers(0, 4000))
def test_scratch_counts_and_freed_saved_tensors_give_their_bytes_back(rows: int, scratch: int, big: int) -> None:
    """Running sums of the layer's backward, in floats, with ``r`` = the input's size: the big saved
    tensor's backward makes its input's gradient (r) and frees the tensor (-big); the scratch's makes the
    scratch (+scratch) and drops it, then its input's gradient (+r), then frees its output's gradient (-r).
    The peak, plus the output gradient the backward was given (r)."""
    width = 5
    r = rows * width
    costs = profile_layers(
        [nn.Linear(width, width), _ScratchThenBig(scratch, big)], torch.randn(rows, width), repeats=1, count_flops=False
    )
    running = [r, r - big, r - big + scratch, r - big, 2 * r - big]
    assert costs.layers[1].backward_bytes == (r + max(running)) * FLOAT


def _stage_peak(layers: list[nn.Module], sample: torch.Tensor) -> tuple[int, int]:
    """The stage's layers run whole on a received input (made inside the count) and a gradient of
    its output: the peak of the bytes allocated and not yet freed, less the parameters' gradients and
    the output's gradient (a pipeline receives it into its shared-memory rings, which a plan counts
    apart); and that gradient's bytes."""
    stage = nn.Sequential(*layers)
    tracker = BackwardPeak()
    with tracker:
        x = sample.clone().requires_grad_()
        output = stage(x)
        received = torch.randn_like(output)
        torch.autograd.backward([output], [received])
        del output, x
    tracker.close()
    peak = tracker.peak([received, *(p.grad for p in stage.parameters() if p.grad is not None)])
    for p in stage.parameters():
        p.grad = None
    return peak, received.untyped_storage().nbytes()


KINDS = {
    "conv": lambda: nn.Conv2d(4, 4, 3, padding=1),
    "conv_bn_relu": lambda: nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "pool": lambda: nn.AvgPool2d(3, stride=1, padding=1),
    "block": lambda: torchvision.models.resnet.BasicBlock(4, 4),
}


@settings(max_examples=30, deadline=None)
@given(kinds=st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=5))
def test_a_stage_holds_its_saved_activations_and_at_most_its_largest_backward(kinds: list[str]) -> None:
    """A stage holds, at the peak of its backward, at least its saved activations and its last
    layer's ``backward_bytes`` (whose backward runs first, with every saved tensor still held), and at
    most its saved activations and its largest layer's ``backward_bytes`` (what the plan counts: the
    saved tensors of the layers after the one running its backward are gone by then), with its input
    and output beside them where no layer saves them."""
    torch.manual_seed(0)
    layers = [KINDS[kind]() for kind in kinds]
    sample = torch.randn(2, 4, 6, 6).requires_grad_()
    costs = profile_layers(layers, sample, repeats=1, count_flops=False)
    saved = costs.saved_between(0, len(layers) - 1)
    largest = max(layer.backward_bytes for layer in costs.layers)
    measured, received = _stage_peak(layers, sample)
    boundary = sample.untyped_storage().nbytes() + costs.layers[-1].activation_bytes
    assert saved + costs.layers[-1].backward_bytes - received <= measured, kinds
    assert measured <= saved + largest + boundary, kinds
    assert costs.layers[-1].backward_bytes > received  # the input's gradient, at least


def test_every_partitioner_counts_the_largest_backward_of_each_stage() -> None:
    """The plan's stage memory adds its largest layer's ``backward_bytes`` (with accumulation, that
    layer's new gradient beside it: ``transient_bytes``), and a memory limit that leaves no room for
    it moves the split, whichever partitioner makes it."""
    costs = ChainCosts.from_lists(
        [1.0] * 4, [1.0] * 4, activation=[8.0] * 4, params=[10.0] * 4, transient=[0.0, 0.0, 30.0, 0.0]
    )
    memory = MemoryModel("1f1b", microbatches=4, extra_copies=2)
    plan = evaluate(costs, [[0, 1], [2, 3]], partitioner="hand", devices=2, memory=memory)
    # (1 weight + 2 copies) x 20 bytes of parameters, 2 and 1 micro-batches in flight x 16 saved (the
    # last stage also holds the model's 8-byte output per micro-batch in flight)
    assert [stage.memory_bytes for stage in plan.stages] == [60 + 32, 60 + 16 + 8 + 30]
    accumulating = MemoryModel("1f1b", microbatches=4, extra_copies=2, accumulation=True)
    assert accumulating.transient_bytes(10.0, 30.0) == 40.0
    plan = evaluate(costs, [[0, 1], [2, 3]], partitioner="hand", devices=2, memory=accumulating)
    assert [stage.memory_bytes for stage in plan.stages] == [60 + 32 + 10, 60 + 16 + 8 + 40]

    # no parameters, one micro-batch: the even split holds 16 and 16 + 8 + 30; 3 + 1 layers 24 and 8 + 8 + 30
    light = ChainCosts.from_lists([1.0] * 4, [1.0] * 4, activation=[8.0] * 4, transient=[0.0, 0.0, 0.0, 30.0])
    one = MemoryModel("1f1b", microbatches=1, extra_copies=2)
    for name in ("pipedream", "memory", "exact", "noncontiguous"):
        if name != "memory":  # the memory partitioner needs a limit
            found = partition(PlanRequest(light, devices=2, memory=one, straight=True), name)
            assert [list(stage.layers) for stage in found.stages] == [[0, 1], [2, 3]], name
        found = partition(PlanRequest(light, devices=2, memory=one, memory_limit=48.0, straight=True), name)
        assert [list(stage.layers) for stage in found.stages] == [[0, 1, 2], [3]], name
        assert found.peak_memory_bytes == 46.0, name


class _ModelLoss(nn.Module):
    """A last layer as ``transformers`` models given labels end: the loss beside the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 512, bias=False)
        self.frozen = nn.Parameter(torch.zeros(4096), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(x)
        return logits.log_softmax(-1)[:, 0].mean().neg(), logits


def test_the_last_layer_differentiates_its_loss_alone_and_accumulates_its_largest_parameter() -> None:
    """Of the model's last layer returning its loss beside its logits, the backward starts from the
    loss, as the runtime's does: the logits take no random gradient of their own. A backward adding
    into a gradient holds the largest parameter that takes one, not every parameter's bytes, nor
    more than its peak with the new gradients counted allows."""
    layer = _ModelLoss()
    x = torch.randn(8, 16, requires_grad=True)
    loss, logits = layer(x)
    assert backward_roots((loss, logits), last=True) == [loss]
    assert backward_roots((loss, logits)) == [loss, logits]  # any other layer: every output taking one
    costs = profile_layers([nn.Linear(16, 16), layer], torch.randn(8, 16), repeats=1, count_flops=False)
    assert costs.layers[-1].largest_param_bytes == 512 * 16 * 4  # the frozen 4096 floats take no gradient
    last = costs.layers[-1]
    # a backward adding into a gradient holds at most its largest new gradient, and no more than its
    # peak with the new gradients counted as made allows: here the log-softmax's saved output is
    # freed before the weight's gradient is made
    assert last.first_backward_bytes is not None and last.first_backward_bytes < last.backward_bytes
    bound = last.first_backward_bytes + last.param_bytes - last.backward_bytes
    assert last.accumulated_bytes == min(512 * 16 * 4, bound) < last.param_bytes
    assert costs.layers[0].largest_param_bytes == 16 * 16 * 4  # the weight, not weight and bias
    every = backward_peak(layer, x.detach().requires_grad_(), list(layer.head.parameters()))
    alone = backward_peak(layer, x.detach().requires_grad_(), list(layer.head.parameters()), last=True)
    assert alone[0] < every[0]  # the logits' random gradient (8 x 512 floats) and its sum left out
    assert profile_from_dict(profile_to_dict(costs)) == costs
