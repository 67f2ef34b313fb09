"""An image classifier of the shape :class:`lightning_pipe.PipelineStrategy` takes unchanged.

:class:`ImageClassifier` keeps its network in one ``nn.Sequential`` attribute, ``self.net``, made by
:func:`lightning_pipe.zoo.models.build_chain` (the MLP for the 8x8 digits, or a torchvision VGG or ResNet),
and ``forward`` calls it: the strategy's model contract (:mod:`lightning_pipe.strategy.contract`).
Every step is ordinary Lightning code; accuracies are computed with tensors (no torchmetrics), as
per-sample means, so the strategy's mean over micro-batches weighted by rows is exact.

The optimizer is SGD (momentum, optionally Nesterov, weight decay on every parameter) or AdamW, with a
step-wise learning rate (``MultiStepLR``, stepped once per epoch) when ``milestones`` are given. The
CDP paper's recipes (Fournier & Oyallon 2024, §5) are, with SGD and momentum 0.9:

* CIFAR-10: ``lr=0.05, milestones=(30, 60, 90), gamma=0.2``;
* ImageNet: ``lr=0.1, milestones=(30, 60, 90), gamma=0.1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.nn import functional

from lightning_pipe.errors import PlanningError
from lightning_pipe.zoo.models import build_chain

__all__ = ["OPTIMIZERS", "ImageClassifier"]

OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw")


class ImageClassifier(L.LightningModule):
    """Cross-entropy classification with a chain of layers in ``self.net``.

    Args:
        model: ``"mlp"`` or a torchvision name of :data:`lightning_pipe.zoo.models.MODEL_NAMES`.
        num_classes: number of classes (logits).
        input_shape: the shape of one sample, e.g. ``(3, 32, 32)`` or ``(1, 8, 8)`` for the digits.
        cifar: the 32x32 variant of a torchvision model; ``None`` chooses it for images of 32x32 or smaller.
        width: hidden features of the MLP.
        depth: hidden layers of the MLP.
        optimizer: ``"sgd"`` or ``"adamw"``.
        lr: learning rate (at the start, before any milestone).
        momentum: SGD's momentum.
        nesterov: Nesterov momentum for SGD (needs ``momentum > 0``).
        weight_decay: weight decay (SGD's L2 term, AdamW's decoupled decay).
        milestones: epochs after which the learning rate is multiplied by ``gamma``; increasing and positive.
        gamma: the factor at each milestone.
        label_smoothing: label smoothing of the training loss (validation and test report the plain
            cross-entropy, comparable across settings).

    Batches are ``(images, labels)``; ``predict_step`` also takes the images alone.
    """

    def __init__(
        self,
        model: str = "resnet18",
        num_classes: int = 10,
        input_shape: tuple[int, ...] = (3, 32, 32),
        cifar: bool | None = None,
        width: int = 128,
        depth: int = 2,
        optimizer: str = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 5e-4,
        milestones: Sequence[int] = (),
        gamma: float = 0.1,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        _check_optimizer(optimizer, lr, momentum, nesterov, weight_decay)
        _check_schedule(milestones, gamma)
        if not (isinstance(label_smoothing, int | float) and 0 <= label_smoothing < 1):
            raise PlanningError(f"label_smoothing must be in [0, 1) (0 turns it off); got {label_smoothing!r}")
        self.net = build_chain(
            model, num_classes=num_classes, input_shape=input_shape, cifar=cifar, width=width, depth=depth
        )
        input_shape = tuple(input_shape)  # saved as the data modules save it: Lightning refuses a list beside a tuple
        self.save_hyperparameters()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = functional.cross_entropy(logits, y, label_smoothing=self.hparams.label_smoothing)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train_acc", top_k_accuracy(logits, y), on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Class probabilities (softmax of the logits) of the images of ``batch``."""
        x = batch[0] if isinstance(batch, tuple | list) else batch
        return torch.softmax(self(x), dim=1)

    def configure_optimizers(self) -> dict[str, Any]:
        hparams = self.hparams
        if hparams.optimizer == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(
                self.parameters(),
                lr=hparams.lr,
                momentum=hparams.momentum,
                nesterov=hparams.nesterov,
                weight_decay=hparams.weight_decay,
            )
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=hparams.lr, weight_decay=hparams.weight_decay)
        if not hparams.milestones:
            return {"optimizer": optimizer}
        scheduler = torch.optim.lr_scheduler.MultiStepLR(
            optimizer, milestones=list(hparams.milestones), gamma=hparams.gamma
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{stage}_loss", functional.cross_entropy(logits, y), sync_dist=True)
        self.log(f"{stage}_acc", top_k_accuracy(logits, y), sync_dist=True)
        if stage == "test" and self.hparams.num_classes > 5:
            self.log("test_acc5", top_k_accuracy(logits, y, k=5), sync_dist=True)


def top_k_accuracy(logits: Tensor, labels: Tensor, k: int = 1) -> Tensor:
    """The fraction of rows whose label is among the ``k`` largest logits (ties broken by ``topk``)."""
    top = logits.topk(k, dim=1).indices
    return (top == labels.unsqueeze(1)).any(dim=1).float().mean()


def _check_optimizer(name: str, lr: float, momentum: float, nesterov: bool, weight_decay: float) -> None:
    if name not in OPTIMIZERS:
        raise PlanningError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    for what, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise PlanningError(f"{what} must be a number >= 0; got {value!r}")
    if lr == 0:
        raise PlanningError("lr must be positive; got 0 (freeze parameters with requires_grad=False instead)")
    if nesterov and (name != "sgd" or momentum == 0):
        raise PlanningError(
            f"nesterov needs SGD with momentum > 0; got optimizer {name!r} with momentum {momentum}: set momentum "
            "(e.g. 0.9) or nesterov=False"
        )


def _check_schedule(milestones: Sequence[int], gamma: float) -> None:
    epochs = list(milestones) if isinstance(milestones, Sequence) and not isinstance(milestones, str) else None
    whole = epochs is not None and all(isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in epochs)
    if not whole or any(b <= a for a, b in pairwise(epochs)):
        raise PlanningError(
            f"milestones must be increasing positive epochs, e.g. (30, 60, 90), or () for a constant learning "
            f"rate; got {milestones!r}"
        )
    if isinstance(gamma, bool) or not isinstance(gamma, int | float) or gamma <= 0:
        raise PlanningError(f"gamma must be a positive factor, e.g. 0.1 or 0.2; got {gamma!r}")
