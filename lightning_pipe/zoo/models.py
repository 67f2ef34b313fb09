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

:func:`mlp_chain` is a small multi-layer perceptron for the 8x8 handwritten digits, and
:func:`build_chain` builds any of these models by name. :func:`load_torchvision_state_dict` and
:func:`torchvision_state_dict` translate weights between a chain and its torchvision model
(``layer1.0.conv1.weight`` there, ``layer1_0.conv1.weight`` here).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping

import torchvision
from torch import Tensor, nn
from torchvision.models import VGG, ResNet

from lightning_pipe.errors import PlanningError, check_whole

__all__ = [
    "MODEL_NAMES",
    "build_chain",
    "chain_from_model",
    "load_torchvision_state_dict",
    "mlp_chain",
    "torchvision_chain",
    "torchvision_model",
    "torchvision_state_dict",
]

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


def mlp_chain(input_shape: tuple[int, ...], num_classes: int, width: int = 128, depth: int = 2) -> nn.Sequential:
    """A multi-layer perceptron as a chain: ``flatten``, then ``depth`` times ``hidden<i>`` (``Linear``) and
    ``relu<i>``, then the ``head`` (``Linear`` to ``num_classes`` logits). Sized for the 8x8 handwritten
    digits (``input_shape=(1, 8, 8)``, 10 classes); ``depth=0`` is a linear classifier.

    Args:
        input_shape: the shape of one sample (without the batch dimension).
        num_classes: number of output logits.
        width: features of every hidden layer.
        depth: number of hidden layers.
    """
    features = _product(_checked_shape(input_shape))
    check_whole("num_classes", num_classes, 1)
    check_whole("width", width, 1)
    check_whole("depth", depth, 0)
    layers: list[tuple[str, nn.Module]] = [("flatten", nn.Flatten(1))]
    for index in range(1, depth + 1):
        layers += [(f"hidden{index}", nn.Linear(features, width)), (f"relu{index}", nn.ReLU())]
        features = width
    layers.append(("head", nn.Linear(features, num_classes)))
    return nn.Sequential(OrderedDict(layers))


def build_chain(
    name: str,
    *,
    num_classes: int,
    input_shape: tuple[int, ...],
    cifar: bool | None = None,
    width: int = 128,
    depth: int = 2,
) -> nn.Sequential:
    """The chain of model ``name``: ``"mlp"`` (:func:`mlp_chain`, with ``width`` and ``depth``) or one of
    :data:`MODEL_NAMES` (:func:`torchvision_chain`; ``width`` and ``depth`` do not apply).

    Args:
        name: ``"mlp"`` or a torchvision model name.
        num_classes: number of output logits.
        input_shape: the shape of one sample; ``(3, height, width)`` for the torchvision models.
        cifar: use the 32x32 variant of a torchvision model (module docstring); ``None`` chooses it
            when the images are 32x32 or smaller. Must stay ``None`` for ``"mlp"``.
        width: hidden features of the MLP.
        depth: hidden layers of the MLP.
    """
    shape = _checked_shape(input_shape)
    if cifar is not None and not isinstance(cifar, bool):
        raise PlanningError(f"cifar must be True, False or None (choose by image size); got {cifar!r}")
    if name == "mlp":
        if cifar is not None:
            raise PlanningError(f"cifar={cifar} applies to the torchvision models only: leave it None for 'mlp'")
        return mlp_chain(shape, num_classes, width=width, depth=depth)
    if name not in MODEL_NAMES:
        raise PlanningError(f"unknown model {name!r}: choose 'mlp' or one of {', '.join(MODEL_NAMES)}")
    if len(shape) != 3 or shape[0] != 3:
        raise PlanningError(
            f"{name} takes RGB images, input_shape (3, height, width); got {shape}: give the image shape, or use "
            "'mlp' for other inputs"
        )
    height, width_pixels = shape[1:]
    if name.startswith("vgg") and min(height, width_pixels) < 32:
        raise PlanningError(
            f"{name} halves its feature maps five times and needs images of at least 32x32; got "
            f"{height}x{width_pixels}: resize the images, or use a ResNet or 'mlp'"
        )
    small = max(height, width_pixels) <= 32
    return torchvision_chain(name, num_classes=num_classes, cifar=small if cifar is None else cifar)


def load_torchvision_state_dict(chain: nn.Sequential, state_dict: Mapping[str, Tensor]) -> None:
    """Load the state dict of a torchvision VGG or ResNet (``layer1.0.conv1.weight``, ``fc.weight``,
    ``features.0.weight``, ...) into ``chain``, a chain made by :func:`chain_from_model` of the same model.

    Strict, as ``nn.Module.load_state_dict``: every key of the chain must be given, with its shape, and
    nothing else.

    Raises:
        PlanningError: missing, unexpected or misshaped entries (the message names a few, and which model
            the state dict seems to come from), or a chain that is not a flattened VGG or ResNet.
    """
    names = _torchvision_names(chain)
    own = chain.state_dict()
    chain_state = {key: own[chain_key] for key, chain_key in names.items()}
    missing = [key for key in names if key not in state_dict]
    unexpected = [key for key in state_dict if key not in names]
    if missing or unexpected:
        counts = [
            f"{len(keys)} {what} ({_few(keys)})"
            for what, keys in (("missing", missing), ("unexpected", unexpected))
            if keys
        ]
        advice = _prefix_hint(list(state_dict), names) or _origin(state_dict, chain_state)
        raise PlanningError(f"the state dict does not fit the chain: keys {' and '.join(counts)}; {advice}")
    not_tensors = [key for key in names if not isinstance(state_dict[key], Tensor)]
    if not_tensors:
        raise PlanningError(f"state dict entries must be tensors; {_few(not_tensors)} are not")
    misshaped = [
        f"{key} {tuple(state_dict[key].shape)} for {tuple(chain_state[key].shape)}"
        for key in names
        if state_dict[key].shape != chain_state[key].shape
    ]
    if misshaped:
        raise PlanningError(
            f"the state dict's shapes do not fit the chain (given for expected): {_few(misshaped)}; "
            + _origin(state_dict, chain_state)
        )
    chain.load_state_dict({names[key]: value for key, value in state_dict.items()}, strict=True)


def torchvision_state_dict(chain: nn.Sequential) -> dict[str, Tensor]:
    """The state dict of ``chain`` (made by :func:`chain_from_model`) with torchvision's keys, which
    loads strictly into the torchvision model it was flattened from (e.g. ``torchvision.models.resnet18()``,
    or :func:`torchvision_model` with ``cifar=True`` for a CIFAR variant). Its tensors share storage with
    the chain, as ``nn.Module.state_dict``'s do."""
    own = chain.state_dict()
    return OrderedDict((key, own[chain_key]) for key, chain_key in _torchvision_names(chain).items())


# -- helpers --------------------------------------------------------------------------------------

_NUMBERED = re.compile(r"(layer[1-4]|features|classifier)_(\d+)")
_UNNUMBERED = frozenset({"conv1", "bn1", "fc"})
_RESNETS = {
    ("BasicBlock", (2, 2, 2, 2)): "resnet18",
    ("BasicBlock", (3, 4, 6, 3)): "resnet34",
    ("Bottleneck", (3, 4, 6, 3)): "resnet50",
    ("Bottleneck", (3, 4, 23, 3)): "resnet101",
    ("Bottleneck", (3, 8, 36, 3)): "resnet152",
}
_VGGS = {8: "vgg11", 10: "vgg13", 13: "vgg16", 16: "vgg19"}  # convolutions in ``features``


def _checked_shape(input_shape: tuple[int, ...]) -> tuple[int, ...]:
    shape = tuple(input_shape) if isinstance(input_shape, tuple | list) else None
    if not shape or not all(isinstance(size, int) and not isinstance(size, bool) and size >= 1 for size in shape):
        raise PlanningError(
            f"input_shape must be the shape of one sample, a tuple of positive whole numbers such as (3, 32, 32) "
            f"or (1, 8, 8); got {input_shape!r}"
        )
    return shape


def _product(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _torchvision_names(chain: nn.Sequential) -> dict[str, str]:
    """``{torchvision key: chain key}`` for every entry of ``chain.state_dict()`` (``layer1_0.conv1.weight``
    is torchvision's ``layer1.0.conv1.weight``)."""
    names: dict[str, str] = {}
    for key in chain.state_dict():
        layer, _, rest = key.partition(".")
        numbered = _NUMBERED.fullmatch(layer)
        if numbered is None and layer not in _UNNUMBERED:
            raise PlanningError(
                f"layer {layer!r} of the chain has no torchvision counterpart: only chains that chain_from_model or "
                "torchvision_chain made of a VGG or ResNet (layers conv1, bn1, layer<s>_<i>, fc, features_<i>, "
                "classifier_<i>) translate to torchvision's keys; use chain.load_state_dict for other chains"
            )
        names[f"{numbered[1]}.{numbered[2]}.{rest}" if numbered else key] = key
    return names


def _few(items: list[str], count: int = 4) -> str:
    return ", ".join(items[:count]) + (f", ... ({len(items) - count} more)" if len(items) > count else "")


def _origin(state_dict: Mapping[str, object], chain_state: Mapping[str, Tensor]) -> str:
    """Which models the state dict and the chain seem to be, and what would work."""
    theirs = _describe(state_dict)
    ours = _describe(chain_state) or "no whole VGG or ResNet"
    if theirs is None:
        return f"it does not look like a torchvision VGG or ResNet state dict (the chain is {ours})"
    return (
        f"it seems to come from {theirs} and the chain is {ours}: load the state dict of the model the chain "
        "was built as, or build the chain as that model (build_chain or torchvision_chain with its name, "
        "num_classes and cifar)"
    )


def _shape(state_dict: Mapping[str, object], key: str) -> tuple[int, ...] | None:
    value = state_dict.get(key)
    return tuple(value.shape) if isinstance(value, Tensor) else None


def _describe(state_dict: Mapping[str, object]) -> str | None:
    """``"resnet50 (1000 classes, ImageNet stem)"``: the torchvision model whose keys and shapes
    ``state_dict`` has, or ``None`` when it looks like neither a ResNet nor a VGG."""
    stem, head = _shape(state_dict, "conv1.weight"), _shape(state_dict, "fc.weight")
    if stem and head and len(stem) == 4:
        blocks = tuple(
            len({key.split(".")[1] for key in state_dict if key.startswith(f"layer{s}.")}) for s in range(1, 5)
        )
        block = "Bottleneck" if any(key.endswith(".conv3.weight") for key in state_dict) else "BasicBlock"
        name = _RESNETS.get((block, blocks), f"a ResNet of {block}s {list(blocks)}")
        return f"{name} ({head[0]} classes, {'CIFAR' if stem[-1] == 3 else 'ImageNet'} stem)"
    weights = [key for key in state_dict if re.fullmatch(r"features\.\d+\.weight", key)]
    shapes = [shape for key in weights if (shape := _shape(state_dict, key)) is not None]
    first = _shape(state_dict, "classifier.0.weight")
    heads = sorted(
        (int(match[1]), key)
        for key in state_dict
        if (match := re.fullmatch(r"classifier\.(\d+)\.weight", key)) and _shape(state_dict, key)
    )
    if not shapes or not first or not heads:
        return None
    convolutions = sum(len(shape) == 4 for shape in shapes)
    name = _VGGS.get(convolutions, f"a VGG of {convolutions} convolutions")
    if convolutions < len(shapes):
        name += "_bn"
    classes = _shape(state_dict, heads[-1][1])[0]
    return f"{name} ({classes} classes, {'CIFAR' if first[1] == 512 else 'ImageNet'} classifier)"


def _prefix_hint(given: list[str], names: Mapping[str, str]) -> str:
    """What to do when the keys are torchvision's under a prefix (``module.``, ``model.``), or the chain's own;
    ``""`` otherwise."""
    firsts = {key.split(".", 1)[0] for key in given}
    prefix = f"{firsts.pop()}." if len(firsts) == 1 else None
    stripped = {key.removeprefix(prefix) for key in given} if prefix else set()
    if prefix and stripped == set(names):
        return f"its keys are torchvision's under the prefix {prefix!r}: strip it"
    if set(given) == set(names.values()):
        return "its keys are the chain's own: use chain.load_state_dict"
    if prefix and stripped == set(names.values()):
        return f"its keys are the chain's own under the prefix {prefix!r}: strip it and use chain.load_state_dict"
    return ""
