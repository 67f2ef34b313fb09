"""``on_after_backward`` and ``on_before_optimizer_step`` under a pipeline, as users write them: the
module clamps its gradients after the backward and logs ``grad_norm`` before the step; a callback
reads the gradients too. On 2 processes, under 1F1B, GPipe with global-norm clipping (which follows
the hooks, as in Lightning), interleaved 1F1B (two stages per rank), ``schedule="auto"`` with every
family allowed (it keeps to the flushing ones), gradient accumulation and float16 loss scaling, the
hooks see each rank's gradients, what they change is what the updates apply, and every rank logs
the whole model's norms: the final weights and every step's logged norms equal plain Lightning's on
one device (the whole batch: no batch norm, a mean loss) to 1e-5. Where several ranks log
``grad_norm``'s total, the ranks' totals combine into the whole model's (:func:`merged`, checked
against ``grad_norm`` over every parameter by hypothesis)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import grad_norm
from torch import nn

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime import run_local
from lightning_pipe.strategy.gradient_hooks import merged
from lightning_pipe.strategy.logs import Record
from tests.lightning_cases import Chain, final_state, loader, state, trainer

BATCHES = 4


class GradientReader(Chain):
    """Clamps its gradients after the backward (a user's own rule, applied by the update) when
    ``clamp``, and logs their norms before the step, as Lightning's documentation shows."""

    def __init__(self, clamp: bool) -> None:
        super().__init__()
        self.clamp = clamp
        self.after_backward = 0

    def on_after_backward(self) -> None:
        self.after_backward += 1
        if self.clamp:
            for param in self.parameters():
                if param.grad is not None:
                    param.grad.clamp_(-0.02, 0.02)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log_dict(grad_norm(self, norm_type=2))


class NormsSeen(L.Callback):
    """Each step's logged gradient norms, and the squared norm of the gradients this rank's callback
    hook sees (each rank's part of the whole)."""

    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []
        self.seen: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        self.seen.append(sum(float(p.grad.pow(2).sum()) for p in module.parameters() if p.grad is not None))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        metrics = trainer.callback_metrics
        self.logged.append({name: float(value) for name, value in metrics.items() if name.startswith("grad_")})


def _float16() -> dict[str, Any]:
    """float16 autocast and loss scaling on the CPU, as on a GPU (``tests/lightning_cases.py``), at a
    scale that never overflows here."""
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))]}


CASES = {  # name: the strategy's options, the Trainer's, whether the module clamps its gradients
    "1f1b": ({"schedule": "1f1b", "microbatches": 2}, dict, True),
    "gpipe_clipped": ({"schedule": "gpipe", "microbatches": 2}, lambda: {"gradient_clip_val": 0.05}, True),
    "interleaved": ({"schedule": "interleaved", "microbatches": 2, "balance": [2, 2, 2, 1]}, dict, True),
    # every family may be chosen, but only the flushing ones hold a step's gradients: the search keeps to them
    "auto": ({"schedule": "auto", "rule": "delayed"}, dict, True),
    # a batch that only accumulates holds no update: its on_after_backward sees no gradient, so nothing is clamped
    "accumulated": ({"schedule": "1f1b", "microbatches": 2}, lambda: {"accumulate_grad_batches": 2}, False),
    # plain Lightning's on_after_backward sees float16's scaled gradients, the pipeline's unscaled ones: no clamp
    "float16": ({"schedule": "1f1b", "microbatches": 2}, _float16, False),
}
TOLERANCE = {"float16": 1e-3}  # else 1e-5: float16 rounds the micro-batches and the whole batch apart


def _fit(root: str, strategy: Any, devices: int, case: str) -> dict[str, Any]:
    _, options, clamp = CASES[case]
    module, seen = GradientReader(clamp), NormsSeen()
    run = trainer(root, strategy, devices, callbacks=[seen], **options())
    run.fit(module, loader(BATCHES))
    final = final_state(run, module) if devices > 1 else state(module)
    return {"final": final, "logged": seen.logged, "seen": seen.seen, "after_backward": module.after_backward}


def _worker(rank: int, root: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    return {case: _fit(f"{root}/{case}", PipelineStrategy(**CASES[case][0]), 2, case) for case in CASES}


@pytest.mark.timeout(300)
def test_gradient_hooks_see_and_change_the_steps_gradients(tmp_path: Path) -> None:
    per_rank = run_local(_worker, 2, str(tmp_path), timeout=280)
    for case in CASES:
        plain = _fit(str(tmp_path / f"{case}_plain"), "auto", 1, case)
        assert len(plain["logged"]) == BATCHES and plain["logged"][-1].keys() > {"grad_2.0_norm_total"}
        tolerance = TOLERANCE.get(case, 1e-5)
        for rank in per_rank:
            got = rank[case]
            for name, value in plain["final"].items():
                assert torch.allclose(got["final"][name], value, rtol=0, atol=tolerance), (case, name)
            assert got["after_backward"] == plain["after_backward"] == BATCHES, case
            for step, (logged, expected) in enumerate(zip(got["logged"], plain["logged"], strict=True)):
                assert logged.keys() == expected.keys(), (case, step)
                assert logged == pytest.approx(expected, rel=tolerance, abs=1e-7), (case, step)
        # each rank's callback saw its own stages' gradients: together, the whole model's
        seen = [sum(parts) for parts in zip(*(rank[case]["seen"] for rank in per_rank), strict=True)]
        assert seen == pytest.approx(plain["seen"], rel=tolerance), case
        assert all(0 < part < whole for rank in per_rank for part, whole in zip(rank[case]["seen"], seen, strict=True))


def _module(gradients: list[torch.Tensor], held: list[int]) -> nn.Module:
    """A module holding the parameters ``held`` (by index, named as in the whole model), each with
    its gradient."""
    module = nn.Module()
    for index in held:
        param = nn.Parameter(torch.zeros_like(gradients[index]))
        param.grad = gradients[index]
        module.register_parameter(f"w{index}", param)
    return module


def _logged(norms: dict[str, Any]) -> Record:
    options = {"reduce_fx": "mean"}
    return Record(1, calls=[(name, float(value), options) for name, value in norms.items()])


@settings(deadline=None, max_examples=60)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    ranks=st.integers(1, 3),
    placement=st.randoms(use_true_random=False),
    p=st.sampled_from([1.0, 2.0, 3.0, math.inf]),
)
def test_ranks_norms_combine_into_the_whole_models(sizes: list[int], ranks: int, placement: Any, p: float) -> None:
    """``grad_norm`` on each rank's parameters, merged over the ranks, is ``grad_norm`` over every
    parameter: each parameter's norm from its rank, the total from the ranks' totals."""
    generator = torch.Generator().manual_seed(len(sizes) * 7 + ranks)
    gradients = [torch.randn(size, generator=generator) for size in sizes]
    owner = [placement.randrange(ranks) for _ in sizes]
    records = [
        _logged(grad_norm(_module(gradients, [i for i, o in enumerate(owner) if o == r]), p)) for r in range(ranks)
    ]
    got = {name: value for name, value, _ in merged(records)}
    whole = {name: float(value) for name, value in grad_norm(_module(gradients, list(range(len(sizes)))), p).items()}
    assert got == pytest.approx(whole, rel=1e-5)


def test_a_value_every_rank_logs_alike_is_kept_once() -> None:
    """A value logged the same on every rank (a learning rate) is that value, whatever its
    ``reduce_fx``; different values combine by it."""
    rate = [Record(1, calls=[("lr", 0.1, {"reduce_fx": "sum"})]) for _ in range(3)]
    assert merged(rate) == [("lr", 0.1, {"reduce_fx": "sum"})]
    apart = [Record(1, calls=[("x", v, {"reduce_fx": "max"})]) for v in (1.0, 3.0)]
    assert merged(apart) == [("x", 3.0, {"reduce_fx": "max"})]
