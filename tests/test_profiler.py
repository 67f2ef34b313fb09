"""Tests for lightning_pipe.cost.profiler: exact byte and FLOP counts, timings, nested outputs, bad inputs."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.cost.profiler import chain_seconds, profile_layers
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError


def quick(model, sample, **kwargs):
    """Profile with a single timed run: byte and FLOP counts do not depend on the repeats."""
    kwargs.setdefault("warmup", 0)
    kwargs.setdefault("repeats", 1)
    return profile_layers(model, sample, **kwargs)


class Split(nn.Module):
    """Returns a tuple: the input doubled and the input's row sums."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return 2 * x, x.sum(dim=1)


class Join(nn.Module):
    """Consumes Split's tuple and returns a dict."""

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        doubled, sums = pair
        return {"scaled": doubled * sums[:, None], "sums": sums}


class Scale(nn.Module):
    """Consumes Join's dict."""

    def forward(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return parts["scaled"] + parts["sums"][:, None]


class SquareHead(nn.Module):
    """Squares a slice of the input: autograd saves the same view twice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head = x[:, :2]
        return head * head


def test_linear_first_layer_without_grad_saves_its_input():
    torch.manual_seed(0)
    costs = quick(nn.Sequential(nn.Linear(7, 5)), torch.randn(3, 7))
    layer = costs.layers[0]
    assert layer.name == "0:Linear"
    assert layer.activation_bytes == 3 * 5 * 4
    assert layer.param_bytes == (7 * 5 + 5) * 4
    assert layer.saved_bytes == 3 * 7 * 4  # for the weight gradient; weight.t() is not counted
    assert layer.flops == 2 * (2 * 3 * 7 * 5)  # forward + weight gradient, no input gradient


@pytest.mark.parametrize("case", ["first-with-grad", "after-a-weight", "after-no-weight"])
def test_linear_takes_an_input_gradient_where_the_model_does(case):
    """A layer's input takes a gradient where the model computes one: a sample that asks for it, or an
    earlier layer with weights; not after layers without weights on a sample that does not (an MLP's
    Linear after its Flatten), as a pipeline's stage receives it."""
    torch.manual_seed(0)
    before = {"first-with-grad": [], "after-a-weight": [nn.Linear(7, 7)], "after-no-weight": [nn.Flatten()]}[case]
    sample = torch.randn(3, 7, requires_grad=case == "first-with-grad")
    layer = quick(nn.Sequential(*before, nn.Linear(7, 5)), sample).layers[-1]
    assert layer.activation_bytes == 3 * 5 * 4
    assert layer.param_bytes == (7 * 5 + 5) * 4
    assert layer.saved_bytes == 3 * 7 * 4
    products = 2 if case == "after-no-weight" else 3  # forward, weight gradient (and input gradient)
    assert layer.flops == products * (2 * 3 * 7 * 5)


def test_conv2d_bytes_and_flops():
    torch.manual_seed(0)
    sample = torch.randn(2, 3, 8, 8, requires_grad=True)
    costs = quick(nn.Sequential(nn.Identity(), nn.Conv2d(3, 4, 3, padding=1)), sample)
    conv = costs.layers[1]
    assert conv.activation_bytes == 2 * 4 * 8 * 8 * 4
    assert conv.param_bytes == (4 * 3 * 3 * 3 + 4) * 4
    assert conv.saved_bytes == 2 * 3 * 8 * 8 * 4
    forward = 2 * (2 * 4 * 8 * 8) * (3 * 3 * 3)  # FlopCounterMode ignores the bias
    assert conv.flops == 3 * forward  # forward, input gradient, weight gradient


LAYERS = {
    "linear": lambda: nn.Linear(6, 6),
    "frozen": lambda: nn.Linear(6, 6).requires_grad_(False),
    "relu": nn.ReLU,
    "identity": nn.Identity,
    "tanh": nn.Tanh,
}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(sorted(LAYERS)), min_size=1, max_size=6), st.booleans())
def test_the_layers_flops_sum_to_the_models(names: list[str], sample_grad: bool) -> None:
    """Oracle: the whole model's forward and backward counted at once (backward from its output, as the
    last stage's loss does) equals the sum of its layers' profiled FLOPs: no layer counts an input
    gradient the model does not compute (frozen layers, layers on a sample without grad)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(LAYERS[name]() for name in names))
    sample = torch.randn(4, 6, requires_grad=sample_grad)
    profiled = sum(layer.flops for layer in quick(model, sample).layers)
    counter = torch.utils.flop_counter.FlopCounterMode(display=False)
    with counter:
        output = model(sample.detach().requires_grad_(sample_grad))
        if output.requires_grad:
            output.backward(torch.randn_like(output))
    assert profiled == counter.get_total_flops()


def test_relu_saves_its_output_only_when_grad_flows():
    torch.manual_seed(0)
    costs = quick(nn.Sequential(nn.ReLU(), nn.Linear(7, 5), nn.ReLU()), torch.randn(3, 7))
    first, _, later = costs.layers
    assert first.saved_bytes == 0  # no params, input without grad: nothing to save
    assert first.backward_seconds == 0
    assert first.flops == 0
    assert later.saved_bytes == 3 * 5 * 4  # its output, for the mask of the gradient


def test_inplace_relu_is_profiled_on_a_copy():
    torch.manual_seed(0)
    sample = torch.randn(3, 7)
    before = sample.clone()
    costs = quick(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(7, 5), nn.ReLU(inplace=True)), sample)
    assert torch.equal(sample, before)
    assert costs.layers[2].saved_bytes == 3 * 5 * 4
    assert costs.layers[2].backward_seconds > 0


def test_batchnorm_saves_input_and_batch_statistics_not_model_state():
    torch.manual_seed(0)
    layer = quick(nn.Sequential(nn.Identity(), nn.BatchNorm2d(3)), torch.randn(2, 3, 8, 8)).layers[1]
    # input + save_mean + save_invstd; weight, running_mean and running_var are excluded
    assert layer.saved_bytes == 2 * 3 * 8 * 8 * 4 + 2 * 3 * 4
    assert layer.param_bytes == 2 * 3 * 4  # buffers are not parameters


def test_saved_tensors_are_deduplicated_by_storage():
    torch.manual_seed(0)
    sample = torch.randn(2, 3, 8, 8, requires_grad=True)
    layer = quick(nn.Sequential(nn.Identity(), SquareHead()), sample).layers[1]
    assert layer.activation_bytes == 2 * 2 * 8 * 8 * 4
    # the slice is saved twice but kept once; it keeps the whole input storage alive
    assert layer.saved_bytes == 2 * 3 * 8 * 8 * 4


@pytest.mark.parametrize(("dtype", "size"), [(torch.float64, 8), (torch.bfloat16, 2)])
def test_element_sizes(dtype, size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), nn.Linear(7, 5)).to(dtype)
    layer = quick(model, torch.randn(3, 7, dtype=dtype)).layers[1]
    assert layer.activation_bytes == 3 * 5 * size
    assert layer.param_bytes == (7 * 5 + 5) * size
    assert layer.saved_bytes == 3 * 7 * size


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 4),
    features_in=st.integers(1, 9),
    features_out=st.integers(1, 9),
    bias=st.booleans(),
)
def test_linear_counts_match_formulas(batch, features_in, features_out, bias):
    model = nn.Sequential(nn.Identity(), nn.Linear(features_in, features_out, bias=bias))
    layer = quick(model, torch.randn(batch, features_in, requires_grad=True)).layers[1]  # an input gradient
    assert layer.activation_bytes == batch * features_out * 4
    assert layer.param_bytes == (features_in * features_out + bias * features_out) * 4
    assert layer.saved_bytes == batch * features_in * 4
    assert layer.flops == 3 * 2 * batch * features_in * features_out


def test_times_are_positive_and_finite_for_layers_with_work():
    torch.manual_seed(0)
    costs = profile_layers(
        nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU()),
        torch.randn(4, 3, 8, 8),
        warmup=1,
        repeats=3,
    )
    flatten, linear, relu = costs.layers
    for layer in (linear, relu):
        assert 0 < layer.forward_seconds < math.inf
        assert 0 < layer.backward_seconds < math.inf
    assert flatten.forward_seconds > 0
    assert flatten.backward_seconds == 0


def test_count_flops_off_gives_none():
    costs = quick(nn.Sequential(nn.Linear(7, 5)), torch.randn(3, 7), count_flops=False)
    assert costs.layers[0].flops is None


def test_tuple_and_dict_outputs_flow_between_layers():
    torch.manual_seed(0)
    costs = quick([nn.Linear(7, 5), Split(), Join(), Scale()], torch.randn(3, 7))
    assert [layer.name for layer in costs.layers] == ["0:Linear", "1:Split", "2:Join", "3:Scale"]
    _, split, join, scale = costs.layers
    assert split.activation_bytes == (3 * 5 + 3) * 4
    assert join.activation_bytes == (3 * 5 + 3) * 4
    assert scale.activation_bytes == 3 * 5 * 4
    assert costs.boundary_bytes == (3 * 5 * 4, (3 * 5 + 3) * 4, (3 * 5 + 3) * 4)
    assert all(layer.backward_seconds > 0 for layer in (split, join, scale))
    assert costs.name == "layers"


def test_dict_sample_and_meta():
    class Pick(nn.Module):
        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return batch["x"]

    costs = quick(nn.Sequential(Pick(), nn.Linear(7, 5)), {"x": torch.randn(6, 7)}, device="cpu", name="net")
    assert costs.name == "net"
    assert costs.meta["batch_size"] == 6
    assert costs.meta["device"] == "cpu"
    assert costs.meta["repeats"] == 1
    assert costs.meta["torch"] == torch.__version__


def test_model_state_is_restored():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.BatchNorm1d(5), nn.Dropout(0.5), nn.Linear(5, 2))
    model.eval()
    model[1].train()
    old_grad = torch.ones(5, 7)
    model[0].weight.grad = old_grad
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    sample = torch.randn(3, 7)
    rng = torch.get_rng_state()

    quick(model, sample)

    assert [m.training for m in model.modules()] == [False, False, True, False, False]
    assert model[0].weight.grad is old_grad
    assert torch.equal(old_grad, torch.ones(5, 7))
    assert all(p.grad is None for name, p in model.named_parameters() if name != "0.weight")
    assert all(torch.equal(b, buffers[name]) for name, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.is_grad_enabled()


def test_profiles_under_no_grad():
    with torch.no_grad():
        layer = quick(nn.Sequential(nn.Linear(7, 5)), torch.randn(3, 7)).layers[0]
        assert not torch.is_grad_enabled()
    assert layer.backward_seconds > 0
    assert layer.saved_bytes == 3 * 7 * 4


@pytest.mark.parametrize("model", [nn.Sequential(), [], ()], ids=["Sequential", "list", "tuple"])
def test_empty_model_is_rejected(model):
    with pytest.raises(PlanningError, match="no layers"):
        profile_layers(model, torch.randn(3, 7))


def test_plain_module_is_rejected_with_a_way_out():
    with pytest.raises(PlanningError) as info:
        profile_layers(nn.Linear(7, 5), torch.randn(3, 7))
    message = str(info.value)
    assert "Linear" in message
    assert "nn.Sequential" in message
    assert "list" in message
    assert "lightning_pipe.zoo.models.torchvision_chain" in message


def test_non_module_layer_is_rejected():
    with pytest.raises(PlanningError, match=r"layer 1 is a builtin_function_or_method, not an nn\.Module: wrap"):
        profile_layers([nn.Linear(7, 5), torch.relu], torch.randn(3, 7))


def test_sample_without_tensor_is_rejected():
    with pytest.raises(PlanningError, match="holding no tensor"):
        profile_layers(nn.Sequential(nn.Linear(7, 5)), [1.0, 2.0])


@pytest.mark.parametrize(("warmup", "repeats"), [(-1, 5), (1, 0)])
def test_bad_run_counts_are_rejected(warmup, repeats):
    with pytest.raises(PlanningError, match="repeats >= 1"):
        profile_layers(nn.Sequential(nn.Linear(7, 5)), torch.randn(3, 7), warmup=warmup, repeats=repeats)


def test_unknown_device_is_rejected():
    with pytest.raises(PlanningError, match="unknown device 'gpu0'"):
        profile_layers(nn.Sequential(nn.Linear(7, 5)), torch.randn(3, 7), device="gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_unavailable_device_is_rejected():
    with pytest.raises(PlanningError, match="not available here: profile on 'cpu'"):
        profile_layers(nn.Sequential(nn.Linear(7, 5)), torch.randn(3, 7), device="cuda")


def test_failing_layer_is_named():
    with pytest.raises(PlanningError, match=r"layer 1:Linear failed on its input \(tensor shapes \[\(3, 5\)\]\)"):
        profile_layers(nn.Sequential(nn.Linear(7, 5), nn.Linear(4, 2)), torch.randn(3, 7))


class _Slow(torch.autograd.Function):
    """Identity whose forward sleeps ``forward`` seconds and backward ``backward`` seconds."""

    @staticmethod
    def forward(ctx, x, forward: float, backward: float):
        ctx.backward = backward
        time.sleep(forward)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward)
        return grad, None, None


class _Timed(nn.Module):
    def __init__(self, forward: float, backward: float) -> None:
        super().__init__()
        self.times = (forward, backward)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Slow.apply(x * self.scale, *self.times)


def test_forward_and_backward_times_are_each_layers_own() -> None:
    """Layers that sleep known times in their forward and backward: each measured time is at least
    its sleep, and the longer half is measured longer, per layer. Guards against forward and backward times
    swapped, or attributed to the neighbouring layer (only positivity was checked)."""
    costs = profile_layers(
        nn.Sequential(_Timed(0.002, 0.030), _Timed(0.030, 0.002)), torch.randn(4, 3), warmup=1, repeats=2
    )
    first, second = costs.layers
    assert first.forward_seconds >= 0.002 and first.backward_seconds >= 0.030
    assert second.backward_seconds >= 0.002 and second.forward_seconds >= 0.030
    assert first.backward_seconds > first.forward_seconds + 0.02  # a 28 ms difference, measured
    assert second.forward_seconds > second.backward_seconds + 0.02


def test_profiling_holds_one_layer_gradients_at_a_time():
    """Each layer's parameter gradients are freed once it is profiled (on a model of several GB, the
    profile must not hold the whole model's gradients at once), and ``.grad`` is as before afterwards."""
    layers = [nn.Linear(8, 8) for _ in range(4)]
    seen: list[int] = []
    for layer in layers:
        layer.register_forward_pre_hook(
            lambda module, args: seen.append(
                sum(p.grad is not None for other in layers if other is not module for p in other.parameters())
            )
        )
    profile_layers(layers, torch.randn(2, 8), repeats=1, warmup=0)
    assert seen and max(seen) == 0
    assert all(p.grad is None for layer in layers for p in layer.parameters())


def test_kept_gradient_bytes_are_what_flows_into_the_weighted_nodes():
    """A split backward keeps, between its halves, the gradient flowing into each node that owns a
    weight: a Linear's output gradient (rows x out floats), a Conv2d's, BatchNorm's; an activation
    function keeps nothing; the first layer (input without gradient) is never split."""
    model = nn.Sequential(
        nn.Linear(6, 16),
        nn.Unflatten(1, (1, 4, 4)),
        nn.Conv2d(1, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(48, 5),
    )
    layers = quick(model, torch.randn(2, 6)).layers
    assert [layer.kept_gradient_bytes for layer in layers] == [0, 0, 2 * 3 * 16 * 4, 2 * 3 * 16 * 4, 0, 0, 2 * 5 * 4]


def test_profiled_graphs_are_freed_without_the_garbage_collector():
    """Counting saved tensors must not tie a saved output to its own autograd history: after a
    backward that retains the graph (the split backward's halves), such a cycle runs through
    autograd's C++ graph, which Python's garbage collector never frees (Tanh saves its output:
    profiling a stack of them leaked every layer's activations)."""
    import gc
    import weakref

    layer = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    gc.collect()
    gc.disable()
    try:
        from lightning_pipe.cost.profiler import _forward_saving, _split_backward

        x = torch.randn(4, 8, requires_grad=True)
        _, output, _, _ = _forward_saving("tanh", layer, x)
        _split_backward(layer, x, output)
        alive = weakref.ref(output)
        del output
        assert alive() is None
    finally:
        gc.enable()


class _Burst(nn.Module):
    """A cheap layer that sleeps on the forwards a shared counter marks: load from elsewhere."""

    def __init__(self, clock: dict) -> None:
        super().__init__()
        self.clock = clock
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock["calls"] += 1
        if self.clock["calls"] in self.clock["slow"]:
            time.sleep(0.05)
        return x * self.scale


@pytest.mark.parametrize("start", range(1, 19))
def test_a_burst_of_load_moves_no_layers_median(start: int) -> None:
    """Three consecutive forwards slowed by 50 ms, wherever they fall among the profile's 20 forwards
    of a 4-layer chain (warmup 1, repeats 3): each layer's median stays far below the burst. Timing a
    layer's runs one after the other instead gave a layer two or three slow runs of its three."""
    clock: dict = {"calls": 0, "slow": set(range(start, start + 3))}
    layers = [_Burst(clock) for _ in range(4)]
    costs = profile_layers(layers, torch.randn(4, 8), warmup=1, repeats=3, count_flops=False)
    assert clock["calls"] == 20
    assert max(layer.forward_seconds for layer in costs.layers) < 0.025


def test_the_chain_timed_whole_and_a_profile_rescaled_to_it() -> None:
    """``chain_seconds`` runs the layers as one module (a tuple passed on as one argument, as the
    profiler does); ``rescaled`` keeps each layer's share of the forward and of the backward."""
    torch.manual_seed(0)
    layers = [nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)]
    forward, backward = chain_seconds(layers, torch.randn(8, 16), device=torch.device("cpu"))
    assert 0 < forward < 1 and 0 < backward < 1
    assert all(p.grad is None for layer in layers for p in layer.parameters())  # no gradient left behind
    with pytest.raises(PlanningError, match="meta device has no time"):
        chain_seconds(layers, torch.randn(8, 16), device=torch.device("meta"))
    costs = ChainCosts.from_lists([1.0, 3.0], [2.0, 6.0])
    scaled = costs.rescaled(2.0, 4.0)
    assert scaled.column("forward_seconds") == [0.5, 1.5] and scaled.column("backward_seconds") == [1.0, 3.0]
    assert scaled.column("param_bytes") == costs.column("param_bytes")
    with pytest.raises(PlanningError, match="cannot rescale forward"):
        costs.rescaled(0.0, 1.0)


def _resnet_layers() -> list[nn.Module]:
    from torchvision.models.resnet import BasicBlock, ResNet

    net = ResNet(BasicBlock, [2, 2, 1, 1], num_classes=10)
    return [net.conv1, net.bn1, net.relu, net.layer1, net.layer2, net.layer3, net.layer4, net.avgpool]


def test_a_model_on_the_meta_device_saves_what_it_saves_built_for_real() -> None:
    """The bytes each layer saves, keeps between backward halves, shares with the layer before and
    outputs are the same for torchvision's ResNet built on the meta device (no addresses: a storage
    is told by its tensor, held for the count) as built on the CPU, on every profile: tensors made
    during a layer once took a freed one's identity and were counted as one (a block's saved bytes
    varied from run to run)."""
    sample = torch.randn(8, 3, 32, 32)
    keys = ("saved_bytes", "kept_gradient_bytes", "shared_saved_bytes", "activation_bytes", "param_bytes")
    real = quick(_resnet_layers(), sample, count_flops=False)
    for _ in range(3):
        with torch.device("meta"):
            layers = _resnet_layers()
        estimated = quick(layers, sample.to("meta"), count_flops=False, device=torch.device("meta"))
        for mine, theirs in zip(estimated.layers, real.layers, strict=True):
            assert {k: getattr(mine, k) for k in keys} == {k: getattr(theirs, k) for k in keys}, mine.name
