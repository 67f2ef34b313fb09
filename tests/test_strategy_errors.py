"""What the strategy refuses, and how a failure on one rank stops the others.

Every refusal names what is wrong and what would work, and comes before any training step; a rank
that fails during training stops every rank with its error within seconds.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    ModelPruning,
    StochasticWeightAveraging,
)
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, Subset

from lightning_pipe import PipelineRuntimeError, PipelineStrategy, PlanningError
from lightning_pipe.runtime import LocalRunError, run_local
from lightning_pipe.runtime.batches import split_batch
from lightning_pipe.strategy.arguments import check_port
from lightning_pipe.strategy.contract import ELSEWHERE_NOTE, ROWS_MIXED, Call, Entry, pipeline_model
from lightning_pipe.strategy.logs import _number, _reduction
from tests.lightning_cases import ROWS, Chain, dataset, final_state, loader, trainer


class _HeadOutside(Chain):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 3)

    def configure_pipeline(self) -> nn.Sequential:
        return self.net


class _Hooked(Chain):
    def configure_pipeline(self) -> list[nn.Module]:
        return list(self.net)


class _Branching(Chain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a decision on tensor values
            return self.net(x)
        return -self.net(x)


def test_model_contract_refusals() -> None:
    """A configure_pipeline chain leaving trainable parameters out, or called with two arguments, and
    a forward deciding on tensor values are refused, each with its remedy; the hook's chain is used as
    given."""
    x = torch.randn(4, 6)
    with pytest.raises(PlanningError, match=r"outside the layers of configure_pipeline.*head.weight, head.bias"):
        pipeline_model(_HeadOutside(), Call((x,)), stages=2)
    hooked = pipeline_model(_Hooked(), Call((x,)), stages=2)
    assert len(hooked.layers) == 7 and hooked.captured is None
    with pytest.raises(PlanningError, match=r"first layer of a configure_pipeline\(\) chain takes one input"):
        hooked.inputs(Call((x, x)))
    with pytest.raises(
        PlanningError,
        match=r"decision on tensor values \(a condition\) at .*test_strategy_errors.py:\d+: if x.sum\(\) > 0.*"
        r"submodule of its own.*pipe_split.*configure_pipeline",
    ):
        pipeline_model(_Branching(), Call((x,)), stages=2)


class _Mine(Exception):
    """An exception of the user's own, raised in their step."""


def test_step_contract_breaches_are_runtime_errors() -> None:
    """What a running step does against the model contract is a PipelineRuntimeError, not a
    PlanningError (the set-up went through): forward never called, called twice with different
    inputs, with other non-tensor arguments than it was captured with, a value or reduction that
    cannot be logged. The user's own exception in the step reaches the caller as itself."""
    x = torch.randn(4, 6)
    module = Chain()
    entry = Entry(module)
    with pytest.raises(PipelineRuntimeError, match=r"^_skip never called forward: the pipeline splits"):
        entry.capture(_skip)
    with entry.inject(torch.zeros(4, 3)):
        module(x)
        module(x.clone())  # the same values: the same output
        with pytest.raises(
            PipelineRuntimeError, match=r"^the step called forward with two different inputs.*stack\(\[x1, x2\], 1\)"
        ):
            module(x + 1)
    captured = pipeline_model(module, Call((x,)), stages=2)
    with pytest.raises(PipelineRuntimeError, match=r"^forward was called with other non-tensor arguments"):
        captured.inputs(Call((x,), {"scale": 2}))
    halves = split_batch(captured.inputs(Call((x,))), 2)  # what the pipeline runs, micro-batch by micro-batch
    captured.check_rows(halves[1], Call((x[2:],)))  # the micro-batch's rows: a view of the same memory
    captured.check_rows(halves[1], Call((x[2:].clone(),)))  # or equal values
    with pytest.raises(PipelineRuntimeError, match=re.escape(ROWS_MIXED)):
        captured.check_rows(halves[1], Call((torch.cat([x[1:2], x[3:]]),)))
    with pytest.raises(PipelineRuntimeError, match=r"^self.log\('bad', list\)"):
        _number("bad", [1.0])
    with pytest.raises(PipelineRuntimeError, match=r"^self.log\('bad', reduce_fx='median'\)"):
        _reduction("bad", "median")

    def fails() -> None:
        raise _Mine("the user's own")

    with pytest.raises(_Mine, match="the user's own"):
        entry.capture(fails)


def _skip() -> None:
    """A step that never calls forward."""


def test_a_step_failing_on_other_ranks_stages_says_why() -> None:
    """A step that runs the model other than through forward (``model.generate``, a submodule called
    directly) on a rank holding only its stages meets PyTorch's meta-device errors: they reach the
    caller as themselves, noted with why and what works, on the first stage (the step run to take
    forward's arguments) and on the last (the step run on the pipeline's output); on a module
    holding every tensor, or built on the meta device, unnoted."""
    module = Chain()

    def generate() -> None:
        module.net[0](torch.randn(2, 6))  # computes, bypassing forward

    def on_last_stage() -> None:
        with Entry(module).inject(None):
            generate()

    with pytest.raises(PipelineRuntimeError, match="never called forward") as whole:
        Entry(module).capture(generate)
    assert ELSEWHERE_NOTE not in getattr(whole.value, "__notes__", [])
    module.net[0].to("meta")
    for run in (lambda: Entry(module).capture(generate), on_last_stage):
        with pytest.raises(RuntimeError) as raised:  # NotImplementedError: a RuntimeError
            run()
        assert not isinstance(raised.value, PipelineRuntimeError)
        assert ELSEWHERE_NOTE in getattr(raised.value, "__notes__", []), raised.value
    assert "forward" not in vars(module)  # the stand-in is gone after the error
    module.to("meta")  # built on the meta device, nothing released: no other rank's stages to speak of
    with pytest.raises(RuntimeError) as raised:
        Entry(module).capture(generate)
    assert ELSEWHERE_NOTE not in getattr(raised.value, "__notes__", [])


CONSTRUCTOR_REFUSALS = [
    ({"schedule": "gpipes"}, r"unknown schedule 'gpipes'; choose one of gpipe, 1f1b"),
    ({"partitioner": "fast"}, r"unknown partitioner 'fast'"),
    ({"microbatches": 0}, r"microbatches must be a whole number"),
    ({"memory_limit": "banana"}, r"^memory_limit='banana': cannot read 'banana' as a size: .* e.g. 16GB"),
    ({"memory_limit": 0}, r"^memory_limit=0: a size must be a positive finite number of bytes, got 0$"),
    ({"memory_limit": True}, r"^memory_limit=True: a size is a number of bytes or a string such as 16GB, not True$"),
    ({"bandwidth": "-1GB/s"}, r"^bandwidth='-1GB/s': cannot read '-1GB' as a size"),
    ({"schedule": "lpp", "groups": 0}, r"groups must be a whole number >= 1"),
    ({"start_method": "fork"}, r"start_method must be one of 'popen', 'spawn', 'forkserver'; got 'fork'"),
    ({"contention": 0.5}, r"^contention must be a finite factor >= 1 \(1: no sharing\), got 0.5$"),
    ({"contention": "2"}, r"^contention must be a finite factor >= 1 \(1: no sharing\), got '2'$"),
    ({"reduce_overlap": 1.5}, r"^reduce_overlap must be a share from 0 \(all-reduces keep the workers busy\) .*1.5$"),
    ({"schedule": "1f1b_star", "period": -1}, r"^period must be a number > 0, or None; got -1$"),
    ({"schedule": "kperiodic", "k": 0}, r"^k must be a whole number >= 1, or None; got 0$"),
    ({"slack": -1}, r"^slack must be a whole number >= 0; got -1$"),
    ({"virtual_stages": 0}, r"^virtual_stages must be a whole number >= 1; got 0$"),
    ({"form": "ring"}, r"^form must be one of 'pipeline', 'pyramid'"),
    ({"schedule": "2bw", "form": "single"}, r"^2bw has no single-device form: on one device, a delayed-weight rule"),
    ({"pin_cpus": "yes"}, r"^pin_cpus must be True, False or 'auto' \(tried in the first steps\); got 'yes'$"),
    (
        {"recompute": 1},
        r"^recompute must be True, False or 'auto' \(each stage recomputes as it needs to fit\); got 1$",
    ),
    ({"keep_plan": "no"}, r"^keep_plan must be True or False; got 'no'$"),
    ({"release_memory": "no"}, r"^release_memory must be True, False or None"),
    (
        {"timeout": timedelta(minutes=-1)},
        r"^timeout must be a positive datetime.timedelta, e.g. timedelta\(minutes=30\)",
    ),
    ({"timeout": 30}, r"^timeout must be a positive datetime.timedelta, .*pipeline.timeout_minutes=30\); got 30$"),
    ({"process_group_backend": "glo"}, r"^process_group_backend='glo' is not a backend of this torch: use one of gloo"),
    ({"state_dict_type": "sharded_"}, r"^state_dict_type must be 'full' or 'sharded'; got 'sharded_'$"),
    ({"balance": [3, 0]}, r"^every balance entry must be a whole number of layers >= 1; got 0$"),
    ({"balance": "3,2"}, r"^balance must list the layers of each stage, e.g. \[3, 2\], or be None; got '3,2'$"),
    ({"stage_replicas": [2.5]}, r"^every stage_replicas entry must be a whole number of workers >= 1; got 2.5$"),
    ({"plan_tolerance": 1.5}, r"^plan_tolerance must be a fraction in \[0, 1\), got 1.5$"),
    ({"profile_repeats": 0}, r"^profile_repeats must be a whole number >= 1; got 0$"),
    ({"profile_cache": 3}, r"^profile_cache must be True, False or a directory, got 3$"),
    ({"plan": 3}, r"^plan must be the path of a plan file, or None; got 3$"),
    ({"profile": "none.json"}, r"^cannot read the profile none.json: No such file or directory$"),
    ({"plan": "none.json"}, r"^cannot read the plan none.json: No such file or directory$"),
    ({"stages": 0}, r"^stages must be a whole number >= 1, or None; got 0$"),
    ({"data_parallel": 2.0}, r"^data_parallel must be a whole number >= 1, or None; got 2.0$"),
    ({"shared_memory_bytes": -1}, r"^shared_memory_bytes must be a whole number of bytes >= 0, or None; got -1$"),
]


@pytest.mark.parametrize(("options", "pattern"), CONSTRUCTOR_REFUSALS)
def test_constructor_refusals(options: dict[str, Any], pattern: str) -> None:
    """Every option a process, the process group or a file depends on is refused when the strategy is
    made, saying what is wrong and what would work, not once the processes are up."""
    with pytest.raises(PlanningError, match=pattern):
        PipelineStrategy(**options)


def test_a_profile_cache_that_is_a_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "profiles"
    blocked.write_text("")
    message = rf"^the profile cache {re.escape(str(blocked))} is a file, not a directory: give profile_cache a "
    with pytest.raises(PlanningError, match=message):
        PipelineStrategy(profile_cache=str(blocked))
    monkeypatch.setenv("LIGHTNING_PIPE_CACHE", str(blocked))
    with pytest.raises(PlanningError, match=message + r".*\$LIGHTNING_PIPE_CACHE"):
        PipelineStrategy()
    assert PipelineStrategy(profile_cache=False).plan_options.cache is None


@settings(deadline=None)
@given(
    st.one_of(
        st.timedeltas(max_value=timedelta(0)),
        st.integers(),
        st.floats(allow_nan=True),
        st.text(max_size=4),
        st.none(),
    )
)
def test_any_timeout_but_a_positive_timedelta_is_refused(timeout: object) -> None:
    with pytest.raises(PlanningError, match=r"^timeout must be a positive datetime.timedelta"):
        PipelineStrategy(timeout=timeout)


@settings(deadline=None)
@given(st.one_of(st.text(max_size=4), st.integers(), st.floats(), st.lists(st.integers(0, 3), max_size=2)))
def test_any_flag_but_true_or_false_is_refused(value: object) -> None:
    """``pin_cpus="yes"`` used to pin (a string is true) and ``pin_cpus=[0, 1]`` to pin to every core;
    ``"auto"`` is the one string ``pin_cpus`` and ``recompute`` take."""
    assume(value != "auto")
    for name, allowed in (("pin_cpus", "True, False or 'auto'"), ("recompute", "True, False or 'auto'")):
        with pytest.raises(PlanningError, match=rf"^{name} must be {allowed} \(.*\); got "):
            PipelineStrategy(**{name: value})
    with pytest.raises(PlanningError, match=r"^keep_plan must be True or False; got "):
        PipelineStrategy(keep_plan=value)


@settings(deadline=None)
@given(st.one_of(st.text(max_size=6), st.integers(-10, 10**6).map(str)))
@example("²").via("a digit to str.isdigit, not to int()")
@example(" 29500 ")
def test_a_master_port_is_a_port_number(port: str) -> None:
    """``MASTER_PORT``, which Lightning's environments and torch read with ``int()`` when the processes
    meet (superscript digits are digits to ``str.isdigit`` but not to ``int``)."""
    try:
        number: int | None = int(port)
    except ValueError:
        number = None
    if number is not None and 1 <= number <= 65535:
        check_port({"MASTER_PORT": port})
    else:
        with pytest.raises(PlanningError, match=rf"^MASTER_PORT={re.escape(repr(port))} \(environment\) is not a port"):
            check_port({"MASTER_PORT": port})
    check_port({})


class _Manual(Chain):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class _TwoOptimizers(Chain):
    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.net[:2].parameters(), lr=0.1), torch.optim.SGD(self.net[2:].parameters(), lr=0.1)]


class _OwnClipping(Chain):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, algorithm: Any = None) -> None:
        pass


class _ReadsGradients(Chain):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log_dict(grad_norm(self, norm_type=2))


class _LogsAList(Chain):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("bad", torch.ones(3))
        return loss


class _ReturnsNothing(Chain):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])


class _SkipsTheNet(Chain):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return batch[0].sum()


class _Tiny(Chain):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 3))


class _StopsIterating(Chain):
    """A step whose iterator runs out at its second batch: Lightning alone would end the epoch."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            next(iter([]))
        return super().training_step(batch, batch_idx)


ONE_PROCESS = {
    "manual": (_Manual, {}, {}, r"manual optimization .* not supported"),
    "accumulate_delayed": (
        Chain,
        {"schedule": "2bw"},
        {"accumulate_grad_batches": 4},
        r"accumulate_grad_batches=4 with a non-flushing schedule \('2bw'\): .*no batch can end without an update; "
        r"use batches 4x larger with microbatches=4 \(the same gradient per update\), or a flushing schedule",
    ),
    "accumulate_scheduled_delayed": (  # the scheduler sets accumulate_grad_batches when the epoch starts
        Chain,
        {"schedule": "pipedream"},
        {"callbacks": [GradientAccumulationScheduler({0: 2})]},
        r"gradient accumulation over calls \(update=False, accumulation=2\) needs a flushing schedule: pipedream",
    ),
    "optimizers": (_TwoOptimizers, {}, {}, r"multiple optimizers is only supported with manual optimization"),
    "clipping": (_OwnClipping, {}, {}, r"configure_gradient_clipping is overridden.*gradient_clip_val"),
    "gradients_delayed": (
        _ReadsGradients,
        {"schedule": "2bw"},
        {},
        r"LightningModule.on_before_optimizer_step reads each step's gradients before its update, but a "
        r"non-flushing schedule \('2bw'\) .*use a flushing schedule \(gpipe, 1f1b",
    ),
    "precision": (Chain, {}, {"precision": "64-true"}, r"precision='64-true' is not supported.*bf16-mixed"),
    "float16_delayed": (
        Chain,
        {"schedule": "2bw"},
        {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]},
        r"precision='16-mixed' needs a loss scale .* non-flushing schedule \('2bw'\).*bf16-mixed",
    ),
    "log": (_LogsAList, {}, {}, r"self.log\('bad', Tensor\).*one-element tensor"),
    "none": (_ReturnsNothing, {}, {}, r"training_step must return the loss.*got NoneType"),
    "skips": (_SkipsTheNet, {}, {}, r"training_step never called forward: .*self\.encoder\(x\).*configure_pipeline"),
    "split": (Chain, {"microbatches": 16}, {}, r"batch_size=10 cannot be cut into 16 micro-batches: use batches of"),
    "last_batch": (
        Chain,
        {"microbatches": 4},
        {},
        r"the last training batch of each epoch has 3 rows \(23 samples in batches of 10\), fewer than the 4 "
        r"micro-batches a step cuts it into: pass drop_last=True to the DataLoader",
    ),
    "last_batch_dropped": (Chain, {"microbatches": 4}, {}, r"^trained$"),
    "stop_iteration": (
        _StopsIterating,
        {},
        {},
        r"^RuntimeError: StopIteration raised inside training_step on rank 0 .*end the epoch there without a word",
    ),
}
_RAISED = {  # each refusal's type: set-up (planning) or raised by a running step
    **dict.fromkeys(
        [
            "manual",
            "accumulate_delayed",
            "clipping",
            "gradients_delayed",
            "precision",
            "float16_delayed",
            "split",
            "last_batch",
        ],
        "PlanningError",
    ),
    **dict.fromkeys(["accumulate_scheduled_delayed", "log", "none", "skips"], "PipelineRuntimeError"),
}
_DATA = {  # the cases' training data when not loader(3)'s 30 rows in batches of 10
    "last_batch": lambda: DataLoader(Subset(dataset(3), range(23)), batch_size=ROWS),
    "last_batch_dropped": lambda: DataLoader(Subset(dataset(3), range(23)), batch_size=ROWS, drop_last=True),
}


def _refusal_worker(rank: int, root: str, cases: dict[str, tuple]) -> dict[str, str]:
    os.environ["LOCAL_RANK"] = str(rank)
    messages = {}
    for name, (model_class, strategy_options, trainer_options, _) in cases.items():
        run = trainer(Path(root) / name, PipelineStrategy(**strategy_options), 1, **trainer_options)
        try:
            run.fit(model_class(), _DATA.get(name, lambda: loader(3))())
            messages[name] = "trained"
        except Exception as error:
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


@pytest.mark.timeout(240)
def test_setup_refusals(tmp_path: Path) -> None:
    """Each unsupported use fails with its reason and remedy (one process: the refusals do not
    depend on the number of stages)."""
    (messages,) = run_local(_refusal_worker, 1, str(tmp_path), ONE_PROCESS, timeout=200)
    for name, (*_, pattern) in ONE_PROCESS.items():
        assert re.search(pattern, messages[name]), (name, messages[name])
        if name in _RAISED:
            assert messages[name].startswith(f"{_RAISED[name]}: "), (name, messages[name])


def _plan_refusal_worker(rank: int, root: str, strategy_options: dict, model: type) -> str:
    os.environ["LOCAL_RANK"] = str(rank)
    trainer(root, PipelineStrategy(**strategy_options), 2).fit(model(), loader(3))
    return "trained"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("options", "model", "pattern"),
    [
        ({}, _Tiny, r"2 stages but the model has 1 layer \(net.0\): a stage holds at least one layer"),
        (
            {"partitioner": "memory", "memory_limit": "1KB", "shared_memory_bytes": 0},
            Chain,
            r"no partition on 2 device\(s\) fits the memory limit of 1000 B .*: the smallest limit that fits 2 device",
        ),
        (
            {"partitioner": "memory", "memory_limit": "100MB"},
            Chain,
            r"memory_limit=95.4 MiB leaves nothing for the stages once the shared-memory rings between processes "
            r"\(128 MiB\) are counted: raise the limit, or make the rings smaller \(shared_memory_bytes=",
        ),
        ({"schedule": "cdp", "form": "pyramid"}, Chain, r"pyramid form runs P stages on P\(P\+1\)/2 workers; 2 is no"),
    ],
)
def test_planning_refusals_on_every_rank(tmp_path: Path, options: dict, model: type, pattern: str) -> None:
    """A plan that cannot exist fails on every rank with the planner's reason, before training."""
    with pytest.raises(LocalRunError) as raised:
        run_local(_plan_refusal_worker, 2, str(tmp_path), options, model, timeout=100)
    assert set(raised.value.errors) == {0, 1}
    for message in raised.value.errors.values():
        assert re.search(pattern, message), message


WHOLE_MODEL = {  # Lightning's callbacks that act on every parameter during a fit: what is said, and what works
    "swa": (
        lambda: StochasticWeightAveraging(swa_lrs=0.05),
        r"the StochasticWeightAveraging callback keeps an average of every parameter .* holds only the parameters "
        r"of its stages: average the weights of checkpoints",
    ),
    "ema": (EMAWeightAveraging, r"the EMAWeightAveraging callback keeps an average of every parameter"),
    "finetuning": (
        lambda: BackboneFinetuning(unfreeze_backbone_at_epoch=1),
        r"the BackboneFinetuning callback freezes and unfreezes parameters .*: fit with the parameters to freeze set "
        r"requires_grad_\(False\) before fit, then fit the same module again with a new Trainer",
    ),
    "pruning": (
        lambda: ModelPruning("l1_unstructured", amount=0.5),
        r"the ModelPruning callback prunes .*: prune the model after the fit \(gather_after_fit=True",
    ),
}


class _Backbone(Chain):
    """Trains only the parameters that take a gradient (as Lightning's fine-tuning examples build
    the optimizer)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _frozen_then_unfrozen(root: str, strategy: Any, devices: int) -> dict[str, torch.Tensor]:
    """What the fine-tuning refusal says works: a fit with the first block frozen, then a fit of the
    same module, unfrozen, by a new Trainer."""
    module = _Backbone()
    module.net[:2].requires_grad_(False)
    trainer(f"{root}/frozen", strategy(), devices).fit(module, loader(3))
    module.net[:2].requires_grad_(True)
    run = trainer(f"{root}/unfrozen", strategy(), devices)
    run.fit(module, loader(3))
    return final_state(run, module)


def _whole_model_worker(rank: int, root: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    os.environ["LOCAL_RANK"] = str(rank)
    messages = {}
    for name, (callback, _) in WHOLE_MODEL.items():  # one after the other in the same processes
        try:
            trainer(f"{root}/{name}", PipelineStrategy(), 2, callbacks=[callback()]).fit(Chain(), loader(3))
            messages[name] = "trained"
        except PlanningError as error:
            messages[name] = str(error)
    return messages, _frozen_then_unfrozen(f"{root}/remedy", PipelineStrategy, 2)


@pytest.mark.timeout(200)
def test_callbacks_acting_on_every_parameter_are_refused(tmp_path: Path) -> None:
    """Weight averaging, fine-tuning and pruning callbacks are refused on every rank before the ranks
    connect (each rank holds only its stages' parameters, which they read whole), saying what works;
    the fits after a refusal run in the same processes, and the fine-tuning remedy (frozen, then
    unfrozen by a new Trainer) ends as plain Lightning's two fits."""
    per_rank = run_local(_whole_model_worker, 2, str(tmp_path), timeout=180)
    expected = _frozen_then_unfrozen(str(tmp_path / "plain"), lambda: "auto", 1)
    for messages, remedy in per_rank:
        for name, (_, pattern) in WHOLE_MODEL.items():
            assert re.search(pattern, messages[name]), (name, messages[name])
        for key, value in expected.items():
            assert torch.allclose(remedy[key], value, rtol=0, atol=1e-6), key
        assert not torch.equal(remedy["net.0.weight"], Chain().net[0].weight.detach()), "the unfrozen block trained"


class _TwoViews(Chain):
    """A contrastive step: the batch and a shifted view of it through one call of ``forward``, the
    views joined with ``torch.cat`` (rows of one micro-batch's views then land in different
    micro-batches) or, as the refusal says, each sample's views next to each other."""

    def __init__(self, stacked: bool) -> None:
        super().__init__()
        self.stacked = stacked

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.stacked:
            z1, z2 = self(torch.stack([x, x + 0.1], 1).flatten(0, 1)).unflatten(0, (-1, 2)).unbind(1)
        else:
            z1, z2 = self(torch.cat([x, x + 0.1])).chunk(2)
        loss = nn.functional.cross_entropy(z1, y) + (z1 - z2).pow(2).mean()
        self.log("train_loss", loss)
        return loss


def _views_worker(rank: int, root: str, stacked: bool) -> str | dict[str, torch.Tensor]:
    os.environ["LOCAL_RANK"] = str(rank)
    module = _TwoViews(stacked)
    run = trainer(root, PipelineStrategy(microbatches=2), 2)
    try:
        run.fit(module, loader(3))
    except PipelineRuntimeError as error:
        return str(error)
    return final_state(run, module)


@pytest.mark.timeout(150)
def test_a_step_mixing_rows_across_micro_batches_is_refused(tmp_path: Path) -> None:
    """Two views joined with ``torch.cat`` before ``forward`` trained wrong without a word (each
    micro-batch's rerun of the step took other rows than the pipeline ran); it is refused, saying
    what works, and what it says works ends as plain Lightning."""
    first, last = run_local(_views_worker, 2, str(tmp_path / "joined"), False, timeout=60)
    assert isinstance(first, str) and isinstance(last, str) and ROWS_MIXED in last, (first, last)
    per_rank = run_local(_views_worker, 2, str(tmp_path / "stacked"), True, timeout=60)
    module = _TwoViews(stacked=True)
    trainer(tmp_path / "plain", "auto", 1).fit(module, loader(3))
    for final in per_rank:
        assert isinstance(final, dict), final
        for name, value in module.state_dict().items():
            assert torch.allclose(final[name], value, rtol=0, atol=1e-6), name


class _FailsAt(Chain):
    """Raises on rank ``rank`` at batch 2 (after its layers ran: on the last stage, in the loss)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.failing_rank = rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2 and self.failing_rank == 0 and self.global_rank == 0:
            raise ValueError("planted failure on the first stage")
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 2 and self.failing_rank == 1:
            raise ValueError("planted failure on the last stage")
        return loss


def _failing_worker(rank: int, root: str, failing: int, schedule: str) -> str:
    os.environ["LOCAL_RANK"] = str(rank)
    trainer(root, PipelineStrategy(schedule), 2).fit(_FailsAt(failing), loader(6))
    return "trained"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("failing", "schedule"), [(0, "1f1b"), (1, "2bw")])
def test_a_failing_rank_stops_every_rank(tmp_path: Path, failing: int, schedule: str) -> None:
    """The planted error of one rank reaches the other within the run's 60 s deadline (the process
    group's own timeout is 30 minutes), naming the rank that failed."""
    with pytest.raises(LocalRunError) as raised:
        run_local(_failing_worker, 2, str(tmp_path), failing, schedule, timeout=60)
    errors = raised.value.errors
    assert set(errors) == {0, 1}, errors
    assert "did not finish" not in " ".join(errors.values())
    assert errors[failing].startswith("ValueError: planted failure")
    other = errors[1 - failing]  # the failed rank's own error, with its type and message
    assert other.startswith("ValueError: planted failure"), other
    assert f"raised on rank {failing}; rank {1 - failing} stopped because of it" in other, other


def _fail_then_fit_worker(rank: int, root: str) -> tuple[list[str], list[dict[str, torch.Tensor]]]:
    os.environ["LOCAL_RANK"] = str(rank)
    errors, finals = [], []
    for attempt, (failing, schedule) in enumerate([(0, "1f1b"), (1, "2bw"), (1, "1f1b")]):
        with pytest.raises(ValueError) as raised:
            trainer(f"{root}/failed{attempt}", PipelineStrategy(schedule), 2).fit(_FailsAt(failing), loader(6))
        errors.append(str(raised.value))
        module = Chain()
        run = trainer(f"{root}/fit{attempt}", PipelineStrategy("1f1b"), 2)
        run.fit(module, loader(3))
        finals.append(final_state(run, module))
    return errors, finals


@pytest.mark.timeout(200)
def test_a_fit_after_a_failed_one_in_the_same_processes_connects_again(tmp_path: Path) -> None:
    """A failure closes the default process group on every rank (so that the others stop); the next
    fit in the same processes — a sweep that catches the error and goes on — opens it again and trains
    as plain Lightning, failure after failure (it hung in its rendezvous, or was refused the connection,
    until each reconnection took a namespace of its own in the first store: .connection)."""
    per_rank = run_local(_fail_then_fit_worker, 2, str(tmp_path), timeout=180)
    module = Chain()
    trainer(tmp_path / "plain", "auto", 1).fit(module, loader(3))
    for errors, finals in per_rank:
        assert [error.startswith("planted failure") for error in errors] == [True] * 3, errors
        for final in finals:
            for name, value in module.state_dict().items():
                assert torch.allclose(final[name], value, rtol=0, atol=1e-6), name
