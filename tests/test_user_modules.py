"""LightningModules of the shapes public code has (:mod:`tests.user_modules`, and Lightning's own
demos) run unchanged on 2 processes with 1F1B, GPipe and 2BW.

- Without batch norm, 1F1B and GPipe end with the parameters of the same module trained by plain
  Lightning on one device, to 1e-5: the GPT (tied embedding and LM head, the loss inside
  ``forward(idx, targets)``, AdamW), the autoencoder, the backbone classifier, the epoch-end lists
  module and Lightning's encoder-decoder ``LightningTransformer`` (its dropout set to 0 by the test).
- With batch norm (the template's dense net, the tutorial's ResNet-18 under ``pytorch_lightning``),
  they end equal to the exact micro-batch reference: plain Lightning on one device fed the same
  micro-batches with ``accumulate_grad_batches`` and batch norm's running statistics moved once per
  step by the rows of the whole batch (an independent implementation in :class:`_DeferredStatistics`).
- 2BW trains: the loss falls.
- On every rank, ``on_train_batch_end`` receives each batch's loss, the epoch-end list and the
  torchmetrics states are those of the unsplit run, and the logged metrics agree.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import pytorch_lightning as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.demos.transformer import LightningTransformer
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PlanningError
from lightning_pipe.capture.verify import verify_chain
from lightning_pipe.cost.profiler import profile_layers
from lightning_pipe.runtime import run_local
from lightning_pipe.runtime.ties import find_ties
from lightning_pipe.strategy.contract import Call, Entry, pipeline_model
from lightning_pipe.strategy.fit_report import run_directory
from tests.lightning_cases import assert_states_close, deferred_statistics, final_state, step_losses
from tests.user_modules import (
    DenseNetModule,
    EpochEndOutputs,
    GPTModule,
    LitAutoEncoder,
    LitClassifier,
    LitResnet,
)

ROWS, MICROBATCHES, BATCHES = 8, 2, 4
# the demo transformer learns at SGD's lr 0.1: float rounding (micro-batches reorder sums) grows past
# 1e-5 after about four steps, so it is compared after two
SHORT = {"transformer": (1, 2)}  # name -> (epochs, batches) of the runs compared exactly
BATCH_NORM = ("dense", "resnet")


def _module(name: str) -> Any:
    torch.manual_seed(0)
    if name == "transformer":
        module = LightningTransformer(vocab_size=40)
        for layer in module.modules():  # dropout off, so that the pipeline can be compared exactly
            if isinstance(layer, nn.Dropout):
                layer.p = 0.0
            if isinstance(layer, nn.MultiheadAttention):
                layer.dropout = 0.0
        module.prepare_data = lambda: None  # the demo downloads WikiText-2 there; the test brings its data
        return module
    factories = {
        "gpt": GPTModule,
        # SGD: Adam would turn the vanishing gradient of the biases batch norm follows into steps of
        # its rounding noise, too sensitive to compare runs
        "dense": lambda: DenseNetModule(optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)),
        "resnet": lambda: LitResnet(lr=0.01, steps_per_epoch=BATCHES),
        "autoencoder": LitAutoEncoder,
        "classifier": LitClassifier,
        "lists": EpochEndOutputs,
    }
    return factories[name]()


def _dataset(name: str, batches: int, seed: int) -> TensorDataset:
    """Learnable data: token sequences counting up from a random start, images labelled by a fixed
    linear map of their pixels."""
    generator = torch.Generator().manual_seed(seed)
    rows = batches * ROWS
    if name in ("gpt", "transformer"):
        vocab, length = (64, 17) if name == "gpt" else (40, 9)
        start = torch.randint(0, vocab, (rows, 1), generator=generator)
        tokens = (start + torch.arange(length)) % vocab
        return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    shape = (3, 16, 16) if name == "resnet" else (1, 8, 8)
    images = torch.randn(rows, *shape, generator=generator)
    labels = (
        images.flatten(1) @ torch.randn(images[0].numel(), 10, generator=torch.Generator().manual_seed(0))
    ).argmax(1)
    return TensorDataset(images, labels)


def _flavour(name: str) -> Any:
    """The package the module is written against: the tutorial's ResNet imports pytorch_lightning."""
    return pl if name == "resnet" else L


def _callbacks(name: str, reference_microbatches: int | None) -> list[Any]:
    package = _flavour(name)
    callbacks = [_outputs_callback(package)()]
    if reference_microbatches:
        callbacks.append(deferred_statistics(package)(reference_microbatches))
    return callbacks


def _outputs_callback(package: Any) -> type:
    class StepLosses(package.Callback):
        """A user's callback reading training_step's outputs."""

        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.losses.append(float(outputs["loss"]))

    return StepLosses


def _train(name: str, root: str, strategy: Any, devices: int, epochs: int, reference: int | None = None) -> dict:
    """Fit ``name`` (the pipeline's run, plain Lightning's, or with ``reference`` micro-batches the
    micro-batch reference) and return what the tests compare."""
    package = _flavour(name)
    module = _module(name)
    rows = ROWS // reference if reference else ROWS
    callbacks = _callbacks(name, reference)
    trainer = package.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        logger=package.loggers.CSVLogger(root, name="", version="")
        if package is pl
        else CSVLogger(root, name="", version=""),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        accumulate_grad_batches=reference or 1,
        log_every_n_steps=1,
        callbacks=callbacks,
    )
    batches = SHORT.get(name, (epochs, BATCHES))[1] if epochs <= 2 else BATCHES
    train = DataLoader(_dataset(name, batches, seed=1), batch_size=rows)
    val = DataLoader(_dataset(name, 2, seed=2), batch_size=ROWS)
    trainer.fit(module, train, val if hasattr(type(module), "validation_step") else None)
    losses = callbacks[0].losses
    if reference:
        losses = step_losses(losses, reference)
    return {
        "final": final_state(trainer, module),
        "metrics": {key: float(value) for key, value in trainer.callback_metrics.items()},
        "losses": losses,
        "epoch_means": list(getattr(module, "epoch_means", [])),
        "differences": list(getattr(trainer.strategy, "differences", [])),
    }


SCHEDULES = ("1f1b", "gpipe", "2bw")
NAMES = ("gpt", "dense", "resnet", "autoencoder", "classifier", "lists", "transformer")


def _pipelines_worker(rank: int, root: str, cases: list[tuple[str, str]]) -> list[dict]:
    os.environ["LOCAL_RANK"] = str(rank)
    results = []
    for name, schedule in cases:
        strategy = _flavour_strategy(name)(schedule, microbatches=MICROBATCHES)
        results.append(
            _train(name, str(Path(root) / f"{name}_{schedule}"), strategy, 2, epochs=_epochs(name, schedule))
        )
    return results


def _flavour_strategy(name: str) -> type:
    if _flavour(name) is pl:
        from lightning_pipe.pytorch_lightning import PipelineStrategy as Standalone

        return Standalone
    from lightning_pipe import PipelineStrategy

    return PipelineStrategy


def _epochs(name: str, schedule: str) -> int:
    """2BW trains longer (its loss must fall); the runs compared exactly, 2 epochs or :data:`SHORT`'s."""
    return 3 if schedule == "2bw" else SHORT.get(name, (2, BATCHES))[0]


@pytest.mark.timeout(600)
def test_public_module_shapes_run_unchanged_on_two_processes(tmp_path: Path) -> None:
    cases = [(name, schedule) for name in NAMES for schedule in SCHEDULES]
    per_rank = run_local(_pipelines_worker, 2, str(tmp_path / "pipe"), cases, timeout=560)
    results = {case: [rank[i] for rank in per_rank] for i, case in enumerate(cases)}
    for name in NAMES:
        epochs = _epochs(name, "1f1b")
        plain = _train(name, str(tmp_path / f"{name}_plain"), "auto", 1, epochs=epochs)
        expected = (
            _train(name, str(tmp_path / f"{name}_ref"), "auto", 1, epochs=epochs, reference=MICROBATCHES)
            if name in BATCH_NORM
            else plain
        )
        for schedule in ("1f1b", "gpipe"):
            ranks = results[(name, schedule)]
            for result in ranks:  # every rank holds the whole trained module after fit
                assert_states_close(result["final"], expected["final"], 1e-5)
                assert result["losses"] == pytest.approx(expected["losses"], abs=1e-5), (name, schedule)
                assert result["epoch_means"] == pytest.approx(expected["epoch_means"], abs=1e-5)
                for key, value in expected["metrics"].items():
                    if name in BATCH_NORM and key == "train_loss":
                        continue  # the reference's batches are micro-batches: its step value is the last one's
                    assert result["metrics"][key] == pytest.approx(value, abs=1e-5), (name, schedule, key)
        said = "\n".join(results[(name, "1f1b")][0]["differences"])  # rank 0 says it with the plan
        assert ("Shared parameters model.transformer.wte.weight = model.lm_head.weight" in said) == (name == "gpt")
        assert ("Batch norm:" in said and "micro-batch of 4 rows" in said) == (name in BATCH_NORM), said
        assert "Dropout" not in said  # none here (the transformer's set to 0)
        for result in results[(name, "2bw")]:
            losses = result["losses"]
            assert all(loss == loss for loss in losses), (name, losses)  # no NaN reaches the callbacks
            first, last = sum(losses[:BATCHES]) / BATCHES, sum(losses[-BATCHES:]) / BATCHES
            assert last < first, (name, losses)


def _capture(module: L.LightningModule, batch: Any, stages: int = 2) -> Any:
    call = Entry(module).capture(module.training_step, batch, 0)
    return call, pipeline_model(module, call, stages)


def test_the_gpt_carries_its_targets_and_shares_its_embedding() -> None:
    """The GPT's forward(idx, targets) is captured with both inputs: the targets cross every cut
    up to the loss in the last layer; the tied embedding and LM head are one parameter of two layers,
    found shared when those layers are on different stages."""
    module = _module("gpt")
    idx, targets = _dataset("gpt", 1, seed=3).tensors
    call, model = _capture(module, (idx[:4].contiguous(), targets[:4].contiguous()))
    graph = model.captured.graph
    nodes = list(graph.graph.nodes)
    for spec in model.captured.specs[:-1]:
        assert "targets" in [nodes[i].name for i in spec.carried]
    stages = {0: nn.Sequential(*model.layers[:4]), 1: nn.Sequential(*model.layers[4:])}
    (tie,) = find_ties(stages)
    assert tie.stages == (0, 1) and tie.parameters == [module.model.lm_head.weight]
    assert model.batch_reduced  # the loss: outputs of micro-batches cannot be concatenated
    costs = profile_layers(model.layers, model.inputs(call), repeats=1, layer_names=model.names)
    for spec, cost in zip(model.captured.specs[:-1], costs.layers, strict=False):
        crossing = sum(
            graph.shadows[nodes[i]].value.nbytes for i in spec.carried if graph.shadows[nodes[i]].value is not None
        )
        assert cost.activation_bytes == crossing  # what a cut costs: everything crossing it, the targets too


def test_each_module_is_captured_and_its_chain_verified() -> None:
    """Every module's forward becomes at least two layers holding all its trainable parameters, and
    the chain gives forward's output in both modes."""
    for name in NAMES:
        module = _module(name)
        batch = _dataset(name, 1, seed=4).tensors
        call, model = _capture(module, tuple(t[:4].contiguous() for t in batch))
        held = {id(p) for layer in model.layers for p in layer.parameters()}
        assert {id(p) for p in module.parameters()} <= held, name
        assert len(model.layers) >= 2, name
        verify_chain(
            module, model.layers, lambda m=module, c=call: type(m).forward(m, *c.args), model.inputs(call), model.names
        )


def test_a_dropped_log_softmax_is_refused_before_any_update() -> None:
    """configure_pipeline returning the ResNet's chain without forward's log_softmax: the chain is
    refused, naming code after the last module call."""
    from lightning_pipe.zoo.models import chain_from_model

    class Hooked(LitResnet):
        def configure_pipeline(self) -> nn.Sequential:
            return chain_from_model(self.model)

    module = Hooked()
    x = torch.randn(2, 3, 16, 16)
    model = pipeline_model(module, Call((x,)), 2)
    with pytest.raises(
        PlanningError, match=r"do not compute forward \(eval mode.*every module call agrees.*log_softmax"
    ):
        verify_chain(module, model.layers, lambda: module.forward(x), x, model.names)


def test_a_chain_in_another_order_is_refused_at_its_first_differing_layer() -> None:
    """configure_pipeline returning the autoencoder's layers with two of the decoder's swapped: the
    refusal names the first module call whose output differs and its layer."""

    class Swapped(LitAutoEncoder):
        def configure_pipeline(self) -> list[nn.Module]:
            decoder = list(self.decoder)
            return [*self.encoder, decoder[0], decoder[2], decoder[1]]

    module = Swapped()
    x = torch.randn(4, 64)
    model = pipeline_model(module, Call((x,)), 2)
    pattern = r"first module call that differs is Linear \(call 1\), in layer 4 \(Linear\)"
    with pytest.raises(PlanningError, match=pattern):
        verify_chain(module, model.layers, lambda: module.forward(x), x, model.names)


def test_boring_model_on_two_devices_says_what_to_do(tmp_path: Path) -> None:
    """Lightning's BoringModel (one Linear) cannot make two stages: on every rank the refusal names
    its one layer and the ways out."""
    messages = run_local(_boring_worker, 2, str(tmp_path), timeout=120)
    for message in messages:
        assert "2 stages but the model has 1 layer (layer): a stage holds at least one layer" in message, message
        assert "devices=1" in message


def _pipe_trainer(rank: int, root: str, logger: CSVLogger | bool = False, **options: Any) -> L.Trainer:
    """A Trainer as a user writes it for ``strategy="pipe"`` on 2 devices, without a logger by default."""
    os.environ["LOCAL_RANK"] = str(rank)
    quiet = {"enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": False}
    return L.Trainer(
        accelerator="cpu", devices=2, strategy="pipe", logger=logger, default_root_dir=root, **quiet, **options
    )


def _boring_worker(rank: int, root: str) -> str:
    trainer = _pipe_trainer(rank, root, max_steps=1)
    try:
        trainer.fit(BoringModel(), DataLoader(torch.randn(8, 32), batch_size=4))
    except PlanningError as error:
        return str(error)
    return "no error"


def test_without_a_logger_each_fit_reports_in_a_directory_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``logger=False``: each fit's end-of-fit timeline and trace go to a new
    ``<default_root_dir>/pipeline_logs/version_<N>`` (two fits, two directories, the earlier one
    untouched), never to the working directory the processes run in; with a CSVLogger, to its
    ``log_dir``."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # the spawned processes start there
    run_local(_report_worker, 2, str(tmp_path), timeout=180)
    files = ["pipeline_timeline.png", "pipeline_trace.json"]
    runs = tmp_path / "root" / "pipeline_logs"
    assert sorted(p.name for p in runs.iterdir()) == ["version_0", "version_1"]
    # "first" was written between the fits: the second fit left the first's directory alone
    assert sorted(p.name for p in (runs / "version_0").iterdir()) == ["first", *files]
    assert sorted(p.name for p in (runs / "version_1").iterdir()) == files
    logged = tmp_path / "csv" / "lightning_logs" / "version_0"
    assert all((logged / name).is_file() for name in [*files, "metrics.csv"])
    assert not list(cwd.iterdir())


def test_run_directories_are_numbered_as_lightnings_versions(tmp_path: Path) -> None:
    """The next ``version_<N>`` follows the largest numbered directory (Lightning's convention), and a
    name taken by something else is skipped rather than shared."""
    assert run_directory(tmp_path) == tmp_path / "pipeline_logs" / "version_0"
    for name in ("version_4", "version_x", "other"):
        (tmp_path / "pipeline_logs" / name).mkdir()
    (tmp_path / "pipeline_logs" / "version_5").touch()  # a file, not a run
    assert run_directory(tmp_path) == tmp_path / "pipeline_logs" / "version_6"
    assert run_directory(tmp_path).is_dir()


def _report_worker(rank: int, tmp: str) -> None:
    """Two fits without a logger, then one with a CSVLogger (each with a Trainer of its own)."""
    root = Path(tmp) / "root"
    for fit in range(2):
        trainer = _pipe_trainer(rank, str(root), max_epochs=1)
        trainer.fit(_module("autoencoder"), DataLoader(_dataset("autoencoder", 6, seed=5), batch_size=ROWS))
        if fit == 0 and rank == 0:
            (root / "pipeline_logs" / "version_0" / "first").touch()
    trainer = _pipe_trainer(rank, str(root), logger=CSVLogger(Path(tmp) / "csv"), max_epochs=1)
    trainer.fit(_module("autoencoder"), DataLoader(_dataset("autoencoder", 6, seed=5), batch_size=ROWS))
