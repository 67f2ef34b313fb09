"""Built-in torchvision models flattened into chains of layers (``nn.Sequential``) for pipelining.

:func:`torchvision_chain` builds a VGG or ResNet from :mod:`torchvision.models` with ``weights=None``
(never downloads anything) and flattens it with :func:`chain_from_model`, whose ``nn.Sequential``
computes exactly the model's ``forward``:

* VGG: every module of ``features``, ``avgpool``, ``nn.Flatten(1)``, every module of ``classifier``;
* ResNet: ``conv1``, ``bn1``, ``relu``, ``maxpool``, every BasicBlock/Bottleneck of ``layer1`` ..
  ``layer4`` (one layer each, their skip connection stays inside), ``avgpool``, ``nn.Flatten(1)``, ``fc``.

Layer names keep the module path with ``_`` for ``.`` (``nn.Module`` forbids dots in child names):
``features_0``, ``layer1_0``, ``fc``. ``nn.Identity`` modules are dropped: they compute nothing.

``cifar=True`` adapts the model to 32x32 images:

* ResNet: the usual CIFAR stem, ``conv1`` becomes a 3x3 convolution with stride 1 and padding 1 and
  the max pooling is removed;
* VGG: the 32x32 input leaves 512x1x1 features, so ``avgpool`` becomes ``AdaptiveAvgPool2d((1, 1))``
  and the first classifier ``Linear`` takes 512 inputs (the rest of the classifier is unchanged).

Replaced layers are initialised as torchvision initialises their kind.
"""

from __future__ import annotations

from collections import OrderedDict

import torchvision
from torch import nn
from torchvision.models import VGG, ResNet

from lightning_pipe.errors import PlanningError

__all__ = ["MODEL_NAMES", "chain_from_model", "torchvision_chain", "torchvision_model"]

MODEL_NAMES: tuple[str, ...] = (
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


def torchvision_chain(name: str, *, num_classes: int = 1000, cifar: bool = False) -> nn.Sequential:
    """A randomly initialised torchvision model as a chain of layers.

    Args:
        name: one of :data:`MODEL_NAMES`.
        num_classes: number of output logits.
        cifar: adapt the model to 32x32 inputs (see the module docstring).
    """
    return chain_from_model(torchvision_model(name, num_classes=num_classes, cifar=cifar))


def torchvision_model(name: str, *, num_classes: int = 1000, cifar: bool = False) -> VGG | ResNet:
    """The torchvision model ``name`` with ``weights=None``, adapted to 32x32 inputs when ``cifar``."""
    if name not in MODEL_NAMES:
        raise PlanningError(f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}")
    if num_classes < 1:
        raise PlanningError(f"num_classes must be >= 1, got {num_classes}")
    model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    if cifar:
        _adapt_to_cifar(model)
    return model


def chain_from_model(model: VGG | ResNet) -> nn.Sequential:
    """Flatten a torchvision VGG or ResNet into an ``nn.Sequential`` with the same forward.

    The chain shares its modules (and so its parameters) with ``model``.
    """
    if type(model) is VGG:
        layers = [
            *_children("features", model.features),
            ("avgpool", model.avgpool),
            ("flatten", nn.Flatten(1)),
            *_children("classifier", model.classifier),
        ]
    elif type(model) is ResNet:
        layers = [
            ("conv1", model.conv1),
            ("bn1", model.bn1),
            ("relu", model.relu),
            ("maxpool", model.maxpool),
        ]
        for stage in ("layer1", "layer2", "layer3", "layer4"):
            layers += _children(stage, getattr(model, stage))
        layers += [("avgpool", model.avgpool), ("flatten", nn.Flatten(1)), ("fc", model.fc)]
    else:
        raise PlanningError(
            f"cannot flatten a {type(model).__name__}: only torchvision VGG and ResNet are known. Write "
            "other models as an nn.Sequential of layers yourself"
        )
    return nn.Sequential(OrderedDict((key, layer) for key, layer in layers if not isinstance(layer, nn.Identity)))


def _children(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(f"{prefix}_{key}", child) for key, child in module.named_children()]


def _adapt_to_cifar(model: VGG | ResNet) -> None:
    """Apply the 32x32 changes described in the module docstring, in place."""
    if isinstance(model, ResNet):
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        model.maxpool = nn.Identity()
    else:
        model.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        first = nn.Linear(512, model.classifier[0].out_features)
        nn.init.normal_(first.weight, 0, 0.01)
        nn.init.constant_(first.bias, 0)
        model.classifier[0] = first
