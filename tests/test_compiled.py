"""Modules compiled with ``torch.compile`` run under the pipeline: captured uncompiled, each stage
compiled with the user's settings (:mod:`lightning_pipe.capture.compiled`,
:mod:`lightning_pipe.strategy.compiling`).

- Capture: a submodule replaced by ``torch.compile(net)`` (a), compiled in place by ``net.compile()``
  (b), gives the layers of the uncompiled module, over the same parameters, and leaves the module as
  it was (state-dict keys with ``_orig_mod.``, the compiled call back in place); the settings given
  to ``torch.compile`` are read back.
- Stages: a stage whose compilation fails (forward or backward) runs eagerly, with a warning naming
  the error, and computes what the eager stage computes; batch norm's and zero bubble's stages are
  not compiled, with the reason.
- On 2 processes (one bounded test, about a minute): (a), (b) with ``recompute=True``, and (c) the
  whole LightningModule compiled before ``trainer.fit``, with 1F1B and ``backend="aot_eager"``, end
  with the parameters of plain Lightning fed the same micro-batches (``accumulate_grad_batches``) to
  1e-6, each checkpoint with the keys plain Lightning saves (``net._orig_mod.`` for (a)), no stage
  falling back to eager, and (a) with GPipe as well; 2BW compiled ends equal to 2BW
  uncompiled (three uneven micro-batches: a smaller last one); inductor (``torch.compile``'s
  default backend) trains, its loss falling.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.compile import from_compiled
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.utilities import compile as pl_compile
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

from lightning_pipe import PipelineStrategy
from lightning_pipe.capture.compiled import CompileSettings, compiled_settings, settings_of, uncompiled
from lightning_pipe.capture.graph import signature
from lightning_pipe.runtime import run_local
from lightning_pipe.schedule import make_schedule
from lightning_pipe.strategy.compiling import StageCompilation, StageFunction
from lightning_pipe.strategy.contract import Entry, pipeline_model
from tests.lightning_cases import ROWS, Chain, assert_states_close, dataset, final_state, trainer

BATCHES = 3


def _compiled(kind: str | None, backend: str | None = "aot_eager") -> tuple[Chain, Any]:
    """A :class:`Chain` compiled as ``kind`` says, and what ``fit`` is given: (a) ``self.net`` replaced
    by ``torch.compile(net)``, (b) ``net.compile()``, (c) the whole module compiled (``None``:
    uncompiled)."""
    model = Chain()
    settings = {} if backend is None else {"backend": backend}
    if kind == "a":
        model.net = torch.compile(model.net, **settings)
    elif kind == "b":
        model.net.compile(**settings)
    return model, torch.compile(model, **settings) if kind == "c" else model


def _layers(model: Chain) -> tuple[Any, Any]:
    """The layers captured from ``model``'s forward, and their chain's output on a micro-batch."""
    x, y = dataset(1).tensors
    call = Entry(model).capture(model.training_step, (x[:4], y[:4]), 0)
    captured = pipeline_model(model, call, 2)
    output = captured.inputs(call)
    with torch.no_grad():
        for layer in captured.layers:
            output = layer(output)
    return captured, output


@pytest.mark.parametrize("kind", ["a", "b"])
def test_a_compiled_module_is_captured_as_the_module_it_compiles(kind: str) -> None:
    plain, expected = _layers(Chain())
    model, _ = _compiled(kind)
    keys = list(model.state_dict())
    captured, output = _layers(model)
    assert captured.names == plain.names and len(captured.names) >= 2
    assert signature(captured.captured.graph.graph) == signature(plain.captured.graph.graph)
    assert [layer.code.code for layer in captured.layers] == [layer.code.code for layer in plain.layers]
    held = {id(p) for layer in captured.layers for p in layer.parameters()}
    assert held == {id(p) for p in model.parameters()}  # the module's own parameters, not copies
    assert torch.equal(output, expected)
    assert list(model.state_dict()) == keys  # (a): net._orig_mod.0.weight, ... as plain Lightning saves them
    assert ("_orig_mod" in keys[0]) == (kind == "a")
    assert (model.net._compiled_call_impl is not None) == (kind == "b")  # put back after capture


def test_the_settings_given_to_torch_compile_are_read_back() -> None:
    net = nn.Linear(2, 2)
    cases = [
        ({}, CompileSettings()),
        (
            {"backend": "aot_eager", "dynamic": True, "fullgraph": True},
            CompileSettings("aot_eager", None, None, True, True),
        ),
        ({"mode": "max-autotune-no-cudagraphs"}, CompileSettings(mode="max-autotune-no-cudagraphs")),
        (
            {"options": {"max_autotune": True}, "dynamic": False},
            CompileSettings(options={"max_autotune": True}, dynamic=False),
        ),
        ({"backend": "eager", "mode": "reduce-overhead"}, CompileSettings("eager", "reduce-overhead")),
    ]
    for given, expected in cases:
        assert settings_of(torch.compile(net, **given).dynamo_ctx) == expected, given
    custom = aot_autograd(fw_compiler=lambda gm, _: gm)
    assert settings_of(torch.compile(net, backend=custom).dynamo_ctx).backend is custom
    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    inner[1].compile(backend="eager", dynamic=False)
    outer = nn.Sequential(torch.compile(inner, backend="aot_eager"))
    assert compiled_settings(outer) == [
        ("0", CompileSettings("aot_eager")),
        ("0.1", CompileSettings("eager", dynamic=False)),
    ]
    with uncompiled(outer):
        assert outer[0] is inner and inner[1]._compiled_call_impl is None
    assert isinstance(outer[0], torch._dynamo.eval_frame.OptimizedModule) and inner[1]._compiled_call_impl is not None


def test_a_module_compiled_whole_is_taken_back_uncompiled_with_its_settings() -> None:
    """``trainer.fit(torch.compile(model))``: Lightning unwraps it (``from_compiled``) and hands the
    strategy the module, which it refuses for strategies other than its own; the pipeline's takes the
    original back (the standalone ``pytorch_lightning``'s too)."""
    from lightning_pipe.pytorch_lightning import PipelineStrategy as Standalone

    for strategy_class, unwrap, module_class in (
        (PipelineStrategy, from_compiled, Chain),
        (Standalone, pl_compile.from_compiled, BoringModel),
    ):
        model = module_class()
        strategy = strategy_class()
        strategy._lightning_module = unwrap(torch.compile(model, backend="eager", dynamic=True))
        assert strategy.lightning_module is model and model._compiler_ctx is None
        assert model.forward.__func__ is module_class.forward
        assert model.training_step.__func__ is module_class.training_step
        assert strategy._whole_compiled == (model, CompileSettings("eager", dynamic=True))


def _failing(gm: torch.fx.GraphModule, inputs: Any) -> Any:
    raise RuntimeError("no kernel for this graph")


def test_a_stage_that_fails_to_compile_runs_eagerly_and_says_why() -> None:
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3, requires_grad=True)
    expected = stage(x)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    backward_fails = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=_failing)
    for backend, named in ((_failing, "no kernel for this graph"), (backward_fails, "no kernel for this graph")):
        function = StageFunction(1, CompileSettings(backend))
        with pytest.warns(UserWarning, match=rf"stage 1 runs eagerly: compiling it with .* failed with .*{named}"):
            out = function(stage, x)
        assert function.compiled is None
        assert torch.equal(out, expected)
        assert torch.equal(torch.autograd.grad(out.sum(), x)[0], expected_grad)
    with pytest.warns(UserWarning, match="stage 0 runs eagerly: .*failed with .*no_such_backend"):
        assert StageFunction(0, CompileSettings("no_such_backend")).compiled is None


def test_batch_norm_and_zero_bubble_stages_are_not_compiled() -> None:
    stages = [nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), nn.Sequential(nn.Linear(2, 2))]
    found = [("net", CompileSettings("eager")), ("head", CompileSettings("aot_eager"))]
    compilation = StageCompilation.of(found, stages, make_schedule("1f1b", 2, 2, 1))
    assert compilation.compiled == [1] and list(compilation.eager) == [0]
    said = compilation.summary()
    assert said.startswith("Compiled per stage with backend='eager'") and "head, compiled otherwise" in said
    assert "stage 0 runs eagerly: its batch norm layers" in said
    split = StageCompilation.of(found, stages[1:] * 2, make_schedule("zb_h1", 2, 2, 1))
    assert split.compiled == [] and "zero bubble splits its backward" in split.summary()


# -- on two processes ---------------------------------------------------------------------------------
# name -> (kind, backend, strategy options, micro-batches); compared as the module docstring says
CASES = {
    "a": ("a", "aot_eager", {}, 2),
    "b": ("b", "aot_eager", {"recompute": True}, 2),
    "c": ("c", "aot_eager", {}, 2),
    "gpipe": ("a", "aot_eager", {"schedule": "gpipe"}, 2),
    "2bw": ("b", "aot_eager", {"schedule": "2bw"}, 3),
    "2bw_eager": (None, None, {"schedule": "2bw"}, 3),
    "inductor": ("a", None, {}, 2),
}
EPOCHS = {"inductor": 3}


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, index: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(root: Path, name: str, devices: int, accumulate: int = 1) -> dict[str, Any]:
    kind, backend, options, microbatches = CASES[name]
    model, fitted = _compiled(kind, backend)
    losses = _Losses()
    pipeline = devices > 1
    strategy = PipelineStrategy(microbatches=microbatches, **options) if pipeline else "auto"
    epochs = EPOCHS.get(name, 2)
    run = trainer(root, strategy, devices, callbacks=[losses], max_epochs=epochs, accumulate_grad_batches=accumulate)
    rows = ROWS // accumulate
    frames = counters["frames"]["ok"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(fitted, DataLoader(dataset(BATCHES), batch_size=rows), DataLoader(dataset(2, 7), batch_size=rows))
    run.save_checkpoint(root / "last.ckpt")
    compilation = getattr(run.strategy, "compilation", None)
    return {
        "final": final_state(run, model),
        "losses": losses.losses,
        "compiled": compilation.compiled if compilation else [],
        "frames": counters["frames"]["ok"] - frames,
        "eager": [str(w.message) for w in caught if "runs eagerly" in str(w.message)],
    }


def _pipelines(rank: int, root: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    return {name: _fit(Path(root) / name, name, 2) for name in CASES}


@pytest.mark.timeout(300)
def test_compiled_modules_train_as_plain_lightning_on_two_processes(tmp_path: Path) -> None:
    ranks = run_local(_pipelines, 2, str(tmp_path / "pipe"), timeout=280)
    plains = {}
    for kind in ("a", "b", "c"):
        plain = plains[kind] = _fit(tmp_path / f"plain_{kind}", kind, 1, accumulate=CASES[kind][3])
        for result in ranks:
            assert result[kind]["compiled"] == [0, 1] and result[kind]["frames"] > 0, kind  # run compiled
            assert not result[kind]["eager"], result[kind]["eager"]
            assert_states_close(result[kind]["final"], plain["final"], 1e-6)
        saved = torch.load(tmp_path / "pipe" / kind / "last.ckpt", weights_only=False)["state_dict"]
        expected = torch.load(tmp_path / f"plain_{kind}" / "last.ckpt", weights_only=False)["state_dict"]
        assert list(saved) == list(expected)
        assert any("_orig_mod." in key for key in saved) == (kind == "a")  # (c): the module itself is saved
    for result in ranks:
        assert result["gpipe"]["compiled"] == [0, 1] and not result["gpipe"]["eager"]
        assert_states_close(result["gpipe"]["final"], plains["a"]["final"], 1e-6)  # GPipe computes what 1F1B does
        assert result["2bw"]["compiled"] == [0, 1] and result["2bw_eager"]["frames"] == 0
        assert_states_close(result["2bw"]["final"], result["2bw_eager"]["final"], 1e-6)
        losses = result["inductor"]["losses"]
        assert all(torch.isfinite(torch.tensor(losses))) and result["inductor"]["compiled"] == [0, 1]
        assert not result["inductor"]["eager"] and not result["2bw"]["eager"]
        assert sum(losses[-BATCHES:]) < sum(losses[:BATCHES]), losses
