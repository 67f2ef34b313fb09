"""Module attributes that user code changes during training (a gate's scale set in ``training_step``
or in a hook) are read by the pipeline's layers when they run, as plain Lightning's ``forward``
reads them; one the captured graph holds as a constant (a flag ``forward`` takes a decision on) is
refused the step it changes, on every rank, naming it — never silently ignored. One ``forward``
sets itself before reading it is ``forward``'s own, not a change.

The oracle: once the gate's scale is 0, the logits are all 0 and the loss is ln 4 at every step,
whatever the weights (a delayed-weight schedule included); before that, 1F1B equals plain Lightning
fed the same micro-batches.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineStrategy
from lightning_pipe.capture import capture
from lightning_pipe.runtime import LocalRunError, run_local
from tests.lightning_cases import step_losses, trainer

ROWS, MICROBATCHES, BATCHES, CLASSES, SWITCH = 8, 2, 6, 4, 3


class Gate(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, CLASSES)
        self.scale = 1.0
        self.shift = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x) * self.scale
        if self.shift:  # a decision: the graph holds its outcome
            y = y + 0.0
        return y


class Gated(L.LightningModule):
    """Six Linear+ReLU blocks and the gate; ``where`` says where the user's code changes it."""

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.where = where
        self.net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(8, 8), nn.ReLU())])
        self.gate = Gate(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.net(x))

    def _switch(self) -> None:
        if self.global_step == SWITCH:
            if self.where.endswith("flag"):
                self.gate.shift = False
            else:
                self.gate.scale = 0.0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.where.startswith("hook"):
            self._switch()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.where.startswith("step"):
            self._switch()
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses = [*getattr(self, "losses", []), float(outputs["loss"])]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(rows: int) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCHES * ROWS, 8, generator=generator)
    return DataLoader(TensorDataset(x, torch.randint(0, CLASSES, (BATCHES * ROWS,), generator=generator)), rows)


def _fit(where: str, root: str, strategy: Any, devices: int, accumulate: int = 1) -> dict[str, Any]:
    module = Gated(where)
    trainer(root, strategy, devices, accumulate_grad_batches=accumulate).fit(module, _loader(ROWS // accumulate))
    losses = step_losses(module.losses, accumulate) if accumulate > 1 else module.losses
    return {"losses": losses, "scale": module.gate.scale}


def _worker(rank: int, root: str, cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    os.environ["LOCAL_RANK"] = str(rank)
    return [
        _fit(where, f"{root}/{where}_{schedule}", PipelineStrategy(schedule, microbatches=MICROBATCHES), 2)
        for where, schedule in cases
    ]


def test_a_changed_float_is_read_when_the_layers_run_and_a_decided_flag_is_caught() -> None:
    """The gate's scale is a live operand of the captured graph; its flag is decided on, so recorded."""
    module = Gated("step")
    x = torch.randn(4, 8)
    captured = capture(module, (x,), {}, stages=2)

    def chained() -> torch.Tensor:
        value: Any = (x,)
        for layer in captured.layers:
            value = layer(value)
        return value

    module.gate.scale = 0.25
    assert torch.equal(chained(), module(x))
    assert captured.graph.changed_attributes() == []
    module.gate.shift = False
    (changed,) = captured.graph.changed_attributes()
    assert (changed.path, changed.name, changed.value) == ("gate", "shift", True)
    assert "if self.shift" in changed.line


class Windowed(nn.Module):
    """Sets its shift from the input's width in ``forward``, then decides on it, as ``transformers``'
    Swin sets its windows' shift from the input's resolution."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.window = window
        self.shift = window // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] <= self.window:
            self.shift = 0
        y = self.linear(x)
        if self.shift > 0:
            y = y.roll(self.shift, -1)
        return y


def test_an_attribute_forward_sets_itself_is_not_taken_for_a_change() -> None:
    """What ``forward`` reads of an attribute it set itself is its own value, set again on every call:
    the capture leaves the module as it was (the shift back at 4), and that is no change the graph
    misses. One ``forward`` only reads (the other window's shift) is still held and checked."""
    module = nn.Sequential(Windowed(8), nn.ReLU(), Windowed(4), nn.ReLU())
    x = torch.randn(4, 8)
    captured = capture(module, (x,), {}, stages=2)
    assert (module[0].shift, module[2].shift) == (4, 2)  # the capture changed nothing
    assert captured.graph.changed_attributes() == []
    value: Any = (x,)
    for layer in captured.layers:
        value = layer(value)
    assert torch.equal(value, module(x))
    module[2].shift = 0
    (changed,) = captured.graph.changed_attributes()
    assert (changed.path, changed.name, changed.value) == ("2", "shift", 2)


@pytest.mark.timeout(300)
def test_a_gate_changed_in_the_step_or_a_hook_acts_on_every_stage(tmp_path: Path) -> None:
    cases = [("step", "1f1b"), ("hook", "1f1b"), ("step", "2bw"), ("hook", "2bw")]
    per_rank = run_local(_worker, 2, str(tmp_path), cases, timeout=280)
    plain = _fit("step", str(tmp_path / "plain"), "auto", 1, accumulate=MICROBATCHES)
    assert plain["losses"][SWITCH:] == pytest.approx([math.log(CLASSES)] * (BATCHES - SWITCH), abs=1e-6)
    for i, (where, schedule) in enumerate(cases):
        for rank in per_rank:
            result = rank[i]
            assert result["scale"] == 0.0
            assert result["losses"][SWITCH:] == pytest.approx(plain["losses"][SWITCH:], abs=1e-6), (where, schedule)
            if schedule == "1f1b":  # synchronous: equal to plain Lightning before the switch too
                assert result["losses"] == pytest.approx(plain["losses"], abs=1e-6), (where, schedule)


def _refused(rank: int, root: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    _fit("hook-flag", root, PipelineStrategy("1f1b", microbatches=MICROBATCHES), 2)


@pytest.mark.timeout(200)
def test_a_changed_decision_is_refused_on_every_rank(tmp_path: Path) -> None:
    with pytest.raises(LocalRunError) as raised:
        run_local(_refused, 2, str(tmp_path), timeout=180)
    message = str(raised.value)
    assert message.count("gate.shift changed from True to False") >= 2, message  # every rank, no hang
    assert "if self.shift" in message and "torch.where" in message
