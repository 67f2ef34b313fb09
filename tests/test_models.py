"""Tests for lightning_pipe.models: flattened torchvision models compute what the originals compute."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from lightning_pipe.errors import PlanningError
from lightning_pipe.models import MODEL_NAMES, chain_from_model, torchvision_chain, torchvision_model
from lightning_pipe.profiler import profile_layers

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
