"""Tests for lightning_pipe.zoo.models: flattened torchvision models compute what the originals compute."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.cost.profiler import profile_layers
from lightning_pipe.errors import PlanningError
from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.schedule import make_schedule
from lightning_pipe.zoo.models import (
    MODEL_NAMES,
    build_chain,
    chain_from_model,
    load_torchvision_state_dict,
    mlp_chain,
    torchvision_chain,
    torchvision_model,
    torchvision_state_dict,
)

RESNET18_NAMES = [
    "conv1",
    "bn1",
    "relu",
    "maxpool",
    *(f"layer{stage}_{block}" for stage in range(1, 5) for block in range(2)),
    "avgpool",
    "flatten",
    "fc",
]


def assert_same_forward(model: nn.Module, chain: nn.Sequential, sample: torch.Tensor) -> None:
    model.eval()
    chain.eval()
    with torch.no_grad():
        torch.testing.assert_close(chain(sample), model(sample), rtol=0, atol=0)


def test_resnet18_chain_equals_model():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None)
    chain = chain_from_model(model)
    assert [name for name, _ in chain.named_children()] == RESNET18_NAMES
    assert {id(p) for p in chain.parameters()} == {id(p) for p in model.parameters()}
    assert_same_forward(model, chain, torch.randn(1, 3, 64, 64))


def test_cifar_vgg11_chain_equals_model():
    torch.manual_seed(0)
    model = torchvision_model("vgg11", num_classes=10, cifar=True)
    chain = chain_from_model(model)
    names = [name for name, _ in chain.named_children()]
    assert names[0] == "features_0"
    assert names[-9:] == ["avgpool", "flatten", *(f"classifier_{i}" for i in range(7))]
    assert chain.classifier_0.in_features == 512
    assert_same_forward(model, chain, torch.randn(1, 3, 32, 32))


def test_cifar_resnet18_stem_and_logits():
    torch.manual_seed(0)
    chain = torchvision_chain("resnet18", num_classes=10, cifar=True)
    assert [name for name, _ in chain.named_children()] == [n for n in RESNET18_NAMES if n != "maxpool"]
    assert chain.conv1.kernel_size == (3, 3)
    assert chain.conv1.stride == (1, 1)
    assert chain.conv1.padding == (1, 1)
    chain.eval()
    with torch.no_grad():
        assert chain(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_bottleneck_resnet_builds_as_cifar_chain():
    torch.manual_seed(0)
    chain = torchvision_chain("resnet50", num_classes=7, cifar=True).eval()
    assert len(chain) == 3 + (3 + 4 + 6 + 3) + 3
    with torch.no_grad():
        assert chain(torch.randn(1, 3, 32, 32)).shape == (1, 7)


def test_model_names():
    assert MODEL_NAMES == (
        "vgg11",
        "vgg13",
        "vgg16",
        "vgg19",
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "resnet152",
    )
    assert all(callable(getattr(torchvision.models, name)) for name in MODEL_NAMES)


def test_profile_cifar_resnet18_chain():
    torch.manual_seed(0)
    chain = torchvision_chain("resnet18", num_classes=10, cifar=True)
    costs = profile_layers(chain, torch.randn(2, 3, 16, 16), warmup=0, repeats=1, name="resnet18")
    assert [layer.name.split(":")[0] for layer in costs.layers] == [n for n in RESNET18_NAMES if n != "maxpool"]
    assert costs.layers[2].name == "relu:ReLU"
    assert costs.layers[-1].activation_bytes == 2 * 10 * 4
    assert sum(layer.param_bytes for layer in costs.layers) == 4 * sum(p.numel() for p in chain.parameters())
    assert all(layer.backward_seconds > 0 for layer in costs.layers)
    # pooling to 1x1 and flattening need only shapes for backward
    assert [layer.name for layer in costs.layers if layer.saved_bytes == 0] == [
        "avgpool:AdaptiveAvgPool2d",
        "flatten:Flatten",
    ]


def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(PlanningError) as info:
        torchvision_chain("resnet20")
    message = str(info.value)
    assert "'resnet20'" in message
    assert all(name in message for name in MODEL_NAMES)


def test_bad_num_classes():
    with pytest.raises(PlanningError, match="num_classes must be >= 1, got 0"):
        torchvision_chain("resnet18", num_classes=0)


def test_unknown_model_type_cannot_be_flattened():
    with pytest.raises(PlanningError, match="cannot flatten a Linear: only torchvision VGG and ResNet"):
        chain_from_model(nn.Linear(2, 2))


# -- the chain computes torchvision's forward, for every kind of block --------------------------------

# layers of the chain: stem (conv1, bn1, relu, maxpool unless CIFAR), the blocks, avgpool, flatten, fc;
# VGG: features, avgpool, flatten, the 7 classifier modules
RESNET_BLOCKS = {"resnet18": 8, "resnet34": 16, "resnet50": 16, "resnet101": 33, "resnet152": 50}
VGG_FEATURES = {"vgg11": 21, "vgg13": 25, "vgg16": 31, "vgg19": 37}  # convolutions, ReLUs and max-pools


def expected_length(name: str, cifar: bool) -> int:
    if name.startswith("vgg"):
        return VGG_FEATURES[name] + 2 + 7
    return (3 if cifar else 4) + RESNET_BLOCKS[name] + 3


@pytest.mark.parametrize("cifar", [False, True], ids=["imagenet", "cifar"])
@pytest.mark.parametrize("name", ["resnet18", "resnet50", "vgg11"])
def test_chain_forward_equals_torchvision(name: str, cifar: bool):
    """Bit for bit in eval mode (the chain runs the model's own modules in the model's order)."""
    torch.manual_seed(0)
    model = torchvision_model(name, num_classes=10, cifar=cifar)
    chain = chain_from_model(model)
    assert len(chain) == expected_length(name, cifar)
    size = 32 if name.startswith("vgg") else 16 if cifar else 64  # VGGs need 32x32, CIFAR stems keep the size
    assert_same_forward(model, chain, torch.randn(2, 3, size, size))


@pytest.mark.parametrize(("name", "cifar"), [("resnet152", False), ("vgg19", True)])
def test_deepest_chains_equal_torchvision(name: str, cifar: bool):
    torch.manual_seed(0)
    model = torchvision_model(name, num_classes=10, cifar=cifar)
    chain = chain_from_model(model)
    assert len(chain) == expected_length(name, cifar)
    assert_same_forward(model, chain, torch.randn(1, 3, 32, 32))


# -- build_chain and the MLP --------------------------------------------------------------------------


def test_mlp_chain_layers_and_logits():
    chain = mlp_chain((1, 8, 8), 10, width=16, depth=3)
    assert [name for name, _ in chain.named_children()] == [
        "flatten",
        *(f"{kind}{i}" for i in (1, 2, 3) for kind in ("hidden", "relu")),
        "head",
    ]
    assert (chain.hidden1.in_features, chain.hidden3.out_features, chain.head.out_features) == (64, 16, 10)
    assert chain(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    linear = mlp_chain((64,), 3, depth=0)
    assert [name for name, _ in linear.named_children()] == ["flatten", "head"]


def test_build_chain_mlp_equals_mlp_chain():
    torch.manual_seed(0)
    built = build_chain("mlp", num_classes=10, input_shape=(1, 8, 8), width=32, depth=1)
    torch.manual_seed(0)
    direct = mlp_chain((1, 8, 8), 10, width=32, depth=1)
    assert built.state_dict().keys() == direct.state_dict().keys()
    assert all(torch.equal(built.state_dict()[k], v) for k, v in direct.state_dict().items())


@pytest.mark.parametrize(
    ("shape", "cifar", "kernel"),
    [((3, 32, 32), None, 3), ((3, 28, 20), None, 3), ((3, 33, 32), None, 7), ((3, 64, 64), None, 7),
     ((3, 32, 32), False, 7), ((3, 64, 64), True, 3)],
)  # fmt: skip
def test_build_chain_chooses_the_cifar_variant_for_small_images(
    shape: tuple[int, ...], cifar: bool | None, kernel: int
):
    chain = build_chain("resnet18", num_classes=10, input_shape=shape, cifar=cifar)
    assert chain.conv1.kernel_size == (kernel, kernel)
    assert ("maxpool" in dict(chain.named_children())) == (kernel == 7)
    assert chain.fc.out_features == 10


def test_build_chain_covers_every_torchvision_name():
    # the CIFAR choice of a VGG shows in its first classifier layer: 512 inputs (1x1 maps) or 512*7*7
    chain = build_chain("vgg11", num_classes=4, input_shape=(3, 32, 32))
    assert (chain.classifier_0.in_features, chain.classifier_6.out_features) == (512, 4)
    for name in MODEL_NAMES:
        if name.startswith("resnet"):  # cheap to build; the VGGs differ only in their features
            assert len(build_chain(name, num_classes=3, input_shape=(3, 16, 16))) == expected_length(name, True)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: build_chain("resnet20", num_classes=10, input_shape=(3, 32, 32)), "choose 'mlp' or one of vgg11"),
        (lambda: build_chain("mlp", num_classes=10, input_shape=(1, 8, 8), cifar=True), "leave it None for 'mlp'"),
        (lambda: build_chain("resnet18", num_classes=10, input_shape=(1, 8, 8)), "takes RGB images"),
        (lambda: build_chain("resnet18", num_classes=10, input_shape=(3, 0, 8)), "positive whole numbers"),
        (lambda: build_chain("resnet18", num_classes=10, input_shape=(3, 32, 32), cifar="yes"), "True, False or"),
        (lambda: build_chain("vgg16", num_classes=10, input_shape=(3, 16, 16)), "at least 32x32; got 16x16"),
        (lambda: build_chain("mlp", num_classes=0, input_shape=(64,)), "num_classes must be a whole number >= 1"),
        (lambda: mlp_chain((1, 8, 8), 10, width=0), "width must be a whole number >= 1"),
        (lambda: mlp_chain((1, 8, 8), 10, depth=-1), "depth must be a whole number >= 0"),
        (lambda: mlp_chain((), 10), "input_shape must be the shape of one sample"),
    ],
)
def test_build_chain_refuses_bad_requests(call, message: str):
    with pytest.raises(PlanningError, match=message):
        call()


# -- torchvision state dicts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "make", "size", "cifar"),
    [
        ("resnet18", lambda: torchvision.models.resnet18(num_classes=10), 64, False),
        ("resnet18", lambda: torchvision_model("resnet18", num_classes=10, cifar=True), 16, True),
        ("resnet50", lambda: torchvision.models.resnet50(num_classes=10), 64, False),
        ("vgg16", lambda: torchvision.models.vgg16(num_classes=10), 32, False),
    ],
    ids=["resnet18", "resnet18-cifar", "resnet50", "vgg16"],
)
def test_torchvision_state_dict_round_trip(name: str, make, size: int, cifar: bool):
    """A torchvision model's weights (random, not the chain's own init) load into a separately built chain,
    which then computes the model's forward exactly; the chain's weights, changed and given back in
    torchvision's naming, load strictly into the torchvision model, which then computes the chain's
    forward exactly."""
    torch.manual_seed(0)
    model = make()
    for module in model.modules():  # running statistics other than the initial ones, so loading them shows
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2)
    torch.manual_seed(1)
    chain = build_chain(name, num_classes=10, input_shape=(3, size, size), cifar=cifar)
    load_torchvision_state_dict(chain, model.state_dict())
    sample = torch.randn(2, 3, size, size)
    assert_same_forward(model, chain, sample)

    with torch.no_grad():
        for value in chain.state_dict().values():
            if value.is_floating_point():
                value.mul_(0.9)
    model.load_state_dict(torchvision_state_dict(chain))  # strict
    assert_same_forward(model, chain, sample)


def test_torchvision_state_dict_keys_and_storage():
    chain = torchvision_chain("resnet18", num_classes=10, cifar=True)
    converted = torchvision_state_dict(chain)
    assert list(converted) == list(torchvision_model("resnet18", num_classes=10, cifar=True).state_dict())
    assert converted["layer1.0.conv1.weight"].data_ptr() == chain.layer1_0.conv1.weight.data_ptr()
    assert "layer2.0.downsample.0.weight" in converted


def test_state_dict_of_another_model_is_refused_with_its_origin():
    chain = torchvision_chain("resnet18", num_classes=10, cifar=True)
    with pytest.raises(PlanningError) as info:
        load_torchvision_state_dict(chain, torchvision_model("resnet34", num_classes=10, cifar=True).state_dict())
    message = str(info.value)
    assert "unexpected (layer1.2.conv1.weight," in message
    assert "come from resnet34 (10 classes, CIFAR stem) and the chain is resnet18 (10 classes, CIFAR stem)" in message

    with pytest.raises(PlanningError) as info:
        load_torchvision_state_dict(chain, torchvision.models.resnet18().state_dict())
    message = str(info.value)
    assert "conv1.weight (64, 3, 7, 7) for (64, 3, 3, 3)" in message
    assert "fc.weight (1000, 512) for (10, 512)" in message
    assert "come from resnet18 (1000 classes, ImageNet stem)" in message


def test_wrong_keys_are_named():
    chain = torchvision_chain("resnet18", num_classes=10, cifar=True)
    state = dict(torchvision_state_dict(chain))
    state["extra.weight"] = state.pop("fc.weight")
    with pytest.raises(PlanningError, match=r"keys 1 missing \(fc\.weight\) and 1 unexpected \(extra\.weight\)"):
        load_torchvision_state_dict(chain, state)
    with pytest.raises(PlanningError, match=r"torchvision's under the prefix 'module\.': strip it"):
        load_torchvision_state_dict(chain, {f"module.{k}": v for k, v in torchvision_state_dict(chain).items()})
    with pytest.raises(PlanningError, match=r"the chain's own: use chain\.load_state_dict"):
        load_torchvision_state_dict(chain, chain.state_dict())
    with pytest.raises(
        PlanningError, match=r"does not look like a torchvision VGG or ResNet state dict \(the chain is resnet18"
    ):
        load_torchvision_state_dict(chain, {"weight": torch.zeros(1)})
    with pytest.raises(PlanningError, match="layer 'hidden1' of the chain has no torchvision counterpart"):
        torchvision_state_dict(mlp_chain((1, 8, 8), 10))


def test_vgg_state_dict_origin():
    chain = torchvision_chain("vgg11", num_classes=10, cifar=True)
    assert list(torchvision_state_dict(chain))[:2] == ["features.0.weight", "features.0.bias"]
    assert list(torchvision_state_dict(chain))[-2:] == ["classifier.6.weight", "classifier.6.bias"]
    with pytest.raises(PlanningError, match=r"come from vgg13 \(10 classes, CIFAR classifier\) and the chain is vgg11"):
        load_torchvision_state_dict(chain, torchvision_model("vgg13", num_classes=10, cifar=True).state_dict())


# -- cutting a ResNet into stages ---------------------------------------------------------------------

RESNET18_LAYERS = expected_length("resnet18", True)


def run_pieces(
    chain: nn.Sequential, cuts: list[int], sample: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run ``chain`` as consecutive stages ending at ``cuts``; each stage after the first takes the
    previous one's output as a new leaf that requires grad, as a pipeline stage receives it. The leaf
    is cloned before the stage uses it: the chain's ``relu`` is in place, and a stage starting with it
    would otherwise write into its own input leaf, which autograd forbids (PipelineExecutor hands its
    stages the leaf itself, so such a cut fails there). Returns the stages' outputs and inputs."""
    bounds = [0, *cuts, len(chain)]
    inputs, outputs = [], []
    value = sample
    for start, end in pairwise(bounds):
        leaf = value.detach().requires_grad_(start > 0)
        inputs.append(leaf)
        value = chain[start:end](leaf.clone())
        outputs.append(value)
    return outputs, inputs


@pytest.fixture(scope="module")
def resnet_gradients() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A CIFAR ResNet-18 chain in train mode, a sample, the chain's output and its parameter gradients
    for the loss ``sum(output²)``."""
    torch.manual_seed(0)
    chain = torchvision_chain("resnet18", num_classes=10, cifar=True).train()
    sample = torch.randn(2, 3, 8, 8)
    output = chain(sample)
    output.square().sum().backward()
    gradients = [p.grad.clone() for p in chain.parameters()]
    chain.zero_grad(set_to_none=True)
    return chain, sample, output.detach(), gradients


def test_every_single_cut_of_a_resnet_computes_the_whole():
    """Each BasicBlock is one layer of the chain, its skip connection inside it: no cut separates a
    residual from the sum it joins, so every cut gives the same output (eval mode, exactly)."""
    torch.manual_seed(0)
    chain = torchvision_chain("resnet18", num_classes=10, cifar=True).eval()
    assert len(chain) == RESNET18_LAYERS
    sample = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        whole = chain(sample)
        for cut in range(1, len(chain)):
            torch.testing.assert_close(chain[cut:](chain[:cut](sample.clone())), whole, rtol=0, atol=0)


@settings(max_examples=6, deadline=None)
@given(st.sets(st.integers(1, RESNET18_LAYERS - 1), min_size=1, max_size=6))
def test_any_cuts_of_a_resnet_give_its_gradients(resnet_gradients, cuts: set[int]):
    """Forward and backward stage by stage (activations forward, their gradients back, between stages)
    give exactly the whole chain's output and parameter gradients, in train mode (batch statistics of
    the whole batch in both)."""
    chain, sample, whole, expected = resnet_gradients
    outputs, inputs = run_pieces(chain, sorted(cuts), sample)
    torch.testing.assert_close(outputs[-1], whole, rtol=0, atol=0)
    grad = 2 * outputs[-1].detach()
    for output, leaf in zip(reversed(outputs), reversed(inputs), strict=True):
        output.backward(grad)
        grad = leaf.grad
    got = [p.grad for p in chain.parameters()]
    chain.zero_grad(set_to_none=True)
    for name, have, want in zip([n for n, _ in chain.named_parameters()], got, expected, strict=True):
        torch.testing.assert_close(have, want, rtol=0, atol=0, msg=name)


# -- the pipeline runtime trains a split ResNet as one process does ----------------------------------

SPLIT = 7  # stage 0: the stem, layer1 and layer2; stage 1: layer3 (a downsampling skip), layer4 and head
STEPS = 2


def small_resnet() -> nn.Sequential:
    torch.manual_seed(0)
    return torchvision_chain("resnet18", num_classes=10, cifar=True)


def resnet_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.randn(4, 3, 16, 16, generator=generator), torch.randint(0, 10, (4,), generator=generator))
        for _ in range(STEPS)
    ]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)


def train_split_resnet(rank: int) -> dict[int, dict[str, torch.Tensor]]:
    """Worker of run_local: 1F1B on two stages, one micro-batch per step; each stage's state afterwards."""
    chain = small_resnet()
    executor = PipelineExecutor(
        lambda steps: make_schedule("1f1b", 2, 1, steps),
        [chain[:SPLIT], chain[SPLIT:]],
        nn.functional.cross_entropy,
        sgd,
    )
    for inputs, targets in resnet_batches():
        executor.step(inputs, targets)
    executor.drain()
    executor.close()
    return {stage: {k: v.clone() for k, v in w.module.state_dict().items()} for stage, w in executor.weights.items()}


@pytest.mark.timeout(120)
def test_pipelined_resnet_trains_as_one_process():
    """Two processes running a CIFAR ResNet-18 cut in two (the cut between layer2 and layer3, whose first
    block has a downsampling skip) end with the parameters and batch-norm statistics of the same chain
    trained in one process. Train mode with one micro-batch per step: both runs normalise with the
    statistics of the whole batch (more micro-batches would normalise each with its own)."""
    results = run_local(train_split_resnet, 2, timeout=110)
    chain = small_resnet().train()
    assert [name for name, _ in chain.named_children()][SPLIT] == "layer3_0"
    optimizer = sgd(list(chain.parameters()))
    for inputs, targets in resnet_batches():
        optimizer.zero_grad()
        nn.functional.cross_entropy(chain(inputs), targets).backward()
        optimizer.step()
    expected = {0: chain[:SPLIT].state_dict(), 1: chain[SPLIT:].state_dict()}
    assert [sorted(result) for result in results] == [[0], [1]]
    for result in results:
        for stage, state in result.items():
            assert state.keys() == expected[stage].keys()
            for key, value in state.items():
                torch.testing.assert_close(value, expected[stage][key], rtol=1e-5, atol=1e-6, msg=key)
    assert not torch.equal(results[0][0]["conv1.weight"], small_resnet().conv1.weight)  # it did train
