"""Tests for lightning_pipe.zoo.classifier: ImageClassifier trains under plain Lightning, logs what it says,
configures the optimizer it is asked for, refuses bad arguments and fits the strategy's model contract."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe.errors import PlanningError
from lightning_pipe.strategy.contract import Entry, pipeline_model
from lightning_pipe.zoo.classifier import ImageClassifier, top_k_accuracy


def tiny_trainer(root, **options) -> L.Trainer:
    settings = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 3,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": root,
    }
    return L.Trainer(**{**settings, **options})


def digits_like(rows: int = 16, classes: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random data of the shape of the 8x8 digits."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 1, 8, 8, generator=generator), torch.randint(0, classes, (rows,), generator=generator)


def test_mlp_learns_a_fixed_batch_and_logs(tmp_path):
    """20 steps on one fixed batch (one batch per epoch, so 20 epochs) drive the loss down; the logged
    keys reach the trainer; the learning rate after the milestone is lr * gamma; test and predict work."""
    x, y = digits_like()
    loader = DataLoader(TensorDataset(x, y), batch_size=len(y))
    torch.manual_seed(0)
    model = ImageClassifier("mlp", input_shape=(1, 8, 8), width=32, lr=0.1, milestones=(10,), gamma=0.5)
    with torch.no_grad():
        before = nn.functional.cross_entropy(model(x), y)
    trainer = tiny_trainer(tmp_path, max_steps=20)
    trainer.fit(model, loader, loader)
    with torch.no_grad():
        after = nn.functional.cross_entropy(model(x), y)
    assert trainer.global_step == 20
    assert after < 0.25 * before, (before, after)
    metrics = trainer.callback_metrics
    assert {"train_loss_step", "train_loss_epoch", "train_acc", "val_loss", "val_acc"} <= set(metrics)
    assert metrics["val_loss"] == pytest.approx(float(after), rel=1e-5)  # validation ran after the last step
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05)

    (tested,) = trainer.test(model, loader, verbose=False)
    assert set(tested) == {"test_loss", "test_acc", "test_acc5"}
    assert tested["test_loss"] == pytest.approx(float(after), rel=1e-5)
    (probabilities,) = trainer.predict(model, loader)
    assert probabilities.shape == (16, 10)
    torch.testing.assert_close(probabilities.sum(1), torch.ones(16))
    torch.testing.assert_close(probabilities, torch.softmax(model(x), 1))


def test_cifar_resnet_trains_three_steps(tmp_path):
    """The torchvision path under Lightning: a CIFAR ResNet-18 (chosen for 16x16 images) takes 3 steps;
    4 classes log no top-5 accuracy."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 16, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator))
    torch.manual_seed(0)
    model = ImageClassifier("resnet18", num_classes=4, input_shape=(3, 16, 16), lr=0.01)
    assert model.net.conv1.kernel_size == (3, 3)
    first = model.net.conv1.weight.detach().clone()
    trainer = tiny_trainer(tmp_path, limit_val_batches=1)
    trainer.fit(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    assert trainer.global_step == 3
    assert not torch.equal(model.net.conv1.weight, first)
    assert {"train_loss_step", "train_acc", "val_loss", "val_acc"} <= set(trainer.callback_metrics)
    (tested,) = trainer.test(model, DataLoader(data, batch_size=4), verbose=False)
    assert set(tested) == {"test_loss", "test_acc"}


def test_sgd_and_the_cdp_cifar_recipe():
    """SGD with the arguments given, and the CDP paper's CIFAR schedule: 0.05, x0.2 after epochs 30, 60, 90."""
    model = ImageClassifier(
        "mlp", input_shape=(1, 8, 8), lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-4,
        milestones=(30, 60, 90), gamma=0.2,
    )  # fmt: skip
    configured = model.configure_optimizers()
    optimizer = configured["optimizer"]
    assert type(optimizer) is torch.optim.SGD
    (group,) = optimizer.param_groups
    assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"]) == (0.05, 0.8, True, 1e-4)
    assert {id(p) for p in group["params"]} == {id(p) for p in model.net.parameters()}
    scheduler = configured["lr_scheduler"]
    assert scheduler["interval"] == "epoch"
    assert type(scheduler["scheduler"]) is torch.optim.lr_scheduler.MultiStepLR
    rates = []
    for _ in range(100):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler["scheduler"].step()
    assert rates[29] == pytest.approx(0.05)
    assert rates[30] == pytest.approx(0.05 * 0.2)
    assert rates[59:61] == pytest.approx([0.01, 0.05 * 0.2**2])
    assert rates[90] == pytest.approx(0.05 * 0.2**3)


def test_adamw_without_milestones_keeps_its_rate():
    model = ImageClassifier("mlp", input_shape=(1, 8, 8), optimizer="adamw", lr=1e-3, weight_decay=0.05)
    configured = model.configure_optimizers()
    assert set(configured) == {"optimizer"}
    optimizer = configured["optimizer"]
    assert type(optimizer) is torch.optim.AdamW
    assert (optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["weight_decay"]) == (1e-3, 0.05)
    assert model.hparams.optimizer == "adamw"
    assert model.hparams.milestones == ()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"optimizer": "adam"}, "unknown optimizer 'adam': choose one of sgd, adamw"),
        ({"milestones": (60, 30)}, "milestones must be increasing positive epochs"),
        ({"milestones": (30, 30)}, "milestones must be increasing positive epochs"),
        ({"milestones": (0, 10)}, "milestones must be increasing positive epochs"),
        ({"milestones": (1.5,)}, "milestones must be increasing positive epochs"),
        ({"milestones": "30"}, "milestones must be increasing positive epochs"),
        ({"milestones": 30}, "milestones must be increasing positive epochs"),
        ({"gamma": 0}, "gamma must be a positive factor"),
        ({"lr": 0}, "lr must be positive"),
        ({"lr": -0.1}, "lr must be a number >= 0"),
        ({"momentum": 0, "nesterov": True}, "nesterov needs SGD with momentum > 0"),
        ({"optimizer": "adamw", "nesterov": True}, "nesterov needs SGD with momentum > 0"),
        ({"label_smoothing": 1.0}, r"label_smoothing must be in \[0, 1\)"),
        ({"model": "resnet20"}, "unknown model 'resnet20'"),
        ({"model": "vgg11", "input_shape": (3, 16, 16)}, "at least 32x32"),
    ],
)
def test_bad_arguments_are_refused(arguments: dict, message: str):
    with pytest.raises(PlanningError, match=message):
        ImageClassifier(**{"model": "mlp", "input_shape": (1, 8, 8), **arguments})


@pytest.mark.parametrize(("model", "shape"), [("mlp", (1, 8, 8)), ("resnet18", (3, 32, 32))])
def test_the_strategy_contract_accepts_it(model: str, shape: tuple[int, ...]):
    """The training step calls forward with the batch's images (what the first stage of a pipeline
    takes), and forward is captured as layers holding every parameter of the module."""
    classifier = ImageClassifier(model, input_shape=shape)
    x, y = torch.randn(2, *shape), torch.tensor([0, 1])
    call = Entry(classifier).capture(classifier.training_step, (x, y), 0)
    assert call.args[0] is x and not call.kwargs
    captured = pipeline_model(classifier, call, stages=2)
    inside = {id(p) for layer in captured.layers for p in layer.parameters()}
    assert inside == {id(p) for p in classifier.parameters()} and len(captured.layers) >= 2
    assert captured.inputs(call) == (x,)


def test_top_k_accuracy():
    logits = torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0], [0.0, 5.0, 1.0]])
    labels = torch.tensor([1, 2, 0])
    assert top_k_accuracy(logits, labels).item() == pytest.approx(1 / 3)
    assert top_k_accuracy(logits, labels, k=2).item() == pytest.approx(2 / 3)
    assert top_k_accuracy(logits, labels, k=3).item() == 1.0
