"""Tied weights with every stage on one device (``form="single"``): a ``transformers`` GPT-2, whose token
embedding is its LM head's weight, trained through ``PipelineStrategy`` on one device ends with the
parameters plain Lightning gives it, to 1e-5.

The parameter is one tensor there, used by the first and the last stage: the first stage updates it,
the last computes through a view of its own, and the two parts of its gradient are summed before the
one update (``lightning_pipe/runtime/ties.py``). Both stages once stepped it (AdamW twice a step) and
their gradients met in the tensor's one ``.grad``: far off plain Lightning's 1e-5 after 3 steps. The
predicted memory counts the parameter and its optimizer state once (``lightning_pipe/worker_memory.py``):
within 10% of the bytes allocated from the second step on.

CDP's single form updates each stage at its own time and keeps a copy per stage, as its pipeline form
does on workers of their own; its program runs each sharing stage's update of a step after every
sharing stage's backwards of the step (``lightning_pipe/schedule/tied_updates.py``), where the pipeline
form's collective waits for them. Oracle: the pipeline form on 2 processes, the same split and rule.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineStrategy
from lightning_pipe.runtime import run_local
from lightning_pipe.runtime.ties import find_ties, updated_elsewhere_here
from lightning_pipe.runtime.weights import StageWeights
from tests.lightning_cases import AllocatedFrom, trainer
from tests.user_modules import HuggingFaceGPT2

ROWS, STEPS, TOKENS, VOCABULARY = 8, 3, 16, 64
SPLIT = {"partitioner": "uniform"}  # the split (and so the memory predicted) whatever the machine's load
CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "gpipe P=2": {"schedule": "gpipe", "stages": 2, "microbatches": 2, **SPLIT},
    "1f1b P=4": {"schedule": "1f1b", "stages": 4, "microbatches": 4, **SPLIT},
    "zb_h1 P=4": {"schedule": "zb_h1", "stages": 4, "microbatches": 4, **SPLIT},  # weight gradients apart (W)
    "fsdp P=4": {"schedule": "fsdp", "stages": 4, "microbatches": 4, **SPLIT},
}
CLIPPED = {"gradient_clip_val": 0.05}  # the tied parameter's norm counted once in the model's


def _gpt() -> HuggingFaceGPT2:
    torch.manual_seed(0)
    module = HuggingFaceGPT2(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCABULARY, n_positions=TOKENS)
    for layer in module.modules():
        if isinstance(layer, nn.Dropout):
            layer.p = 0.0
    return module


def _fit(rank: int, root: str, strategy_options: dict[str, Any] | None, trainer_options: dict[str, Any]) -> dict:
    """Worker of :func:`run_local` (a fit leaves its process group behind): the state this rank's
    module holds after :data:`STEPS` steps (every stage's on one device), plain Lightning's when
    ``strategy_options`` is ``None``; ``form="single"`` unless the options say another."""
    os.environ["LOCAL_RANK"] = str(rank)
    module = _gpt()
    options = {"form": "single", **(strategy_options or {})}
    strategy = "auto" if strategy_options is None else PipelineStrategy(**options)
    peak = AllocatedFrom(1)
    devices = torch.distributed.get_world_size()
    run = trainer(root, strategy, devices, max_steps=STEPS, callbacks=[peak], **trainer_options)
    tokens = torch.randint(0, VOCABULARY, (ROWS * STEPS, TOKENS), generator=torch.Generator().manual_seed(1))
    run.fit(module, DataLoader(TensorDataset(tokens), batch_size=ROWS))
    return {
        "state": {name: value.detach().clone() for name, value in module.state_dict().items() if not value.is_meta},
        "tied": module.model.transformer.wte.weight is module.model.lm_head.weight,
        "measured": peak.peak,
        "predicted": None if strategy == "auto" else strategy.predicted_memory - strategy.ring_bytes,
    }


CASES = [(name, False) for name in sorted(CONFIGURATIONS)] + [("1f1b P=4", True)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("name", "clipped"), CASES, ids=[f"{n}{' clipped' if c else ''}" for n, c in CASES])
def test_tied_stages_on_one_device_train_as_plain_lightning(tmp_path: Path, name: str, clipped: bool) -> None:
    options = CLIPPED if clipped else {}
    expected = run_local(_fit, 1, str(tmp_path / "plain"), None, options, timeout=200)[0]
    got = run_local(_fit, 1, str(tmp_path / "pipe"), CONFIGURATIONS[name], options, timeout=200)[0]
    assert got["tied"] and expected["tied"]  # the user's module keeps its tie
    for key, want in expected["state"].items():
        assert torch.allclose(got["state"][key], want, atol=1e-5, rtol=0), (key, (got["state"][key] - want).abs().max())
    moved = (expected["state"]["model.lm_head.weight"] - _gpt().state_dict()["model.lm_head.weight"]).abs().max()
    assert moved > 1e-3  # the steps moved the tied weight: its update is checked, not its start
    assert got["predicted"] == pytest.approx(got["measured"], rel=0.1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rule", ["cdp_v1", "cdp_v2"])
def test_cdp_on_one_device_trains_tied_stages_as_its_pipeline_form(tmp_path: Path, rule: str) -> None:
    """CDP's single form with the embedding and the LM head on its two stages ends with the parameters
    of its pipeline form on 2 processes (the same split: ``uniform``), to 1e-5, under both rules; its
    memory predicted within 10% (a copy of the tied weight per stage, as each keeps its versions)."""
    options = {"schedule": "cdp", "rule": rule, "stages": 2, "microbatches": 2, **SPLIT}
    single = run_local(_fit, 1, str(tmp_path / "single"), options, {}, timeout=200)[0]
    pipeline = run_local(_fit, 2, str(tmp_path / "pipeline"), {**options, "form": "pipeline"}, {}, timeout=200)
    merged = {**pipeline[1]["state"], **pipeline[0]["state"]}
    assert merged.keys() == single["state"].keys()
    for key, want in merged.items():
        assert torch.allclose(single["state"][key], want, atol=1e-5, rtol=0), (
            key,
            (single["state"][key] - want).abs().max(),
        )
    assert single["tied"]
    assert single["predicted"] == pytest.approx(single["measured"], rel=0.1)


def test_the_first_local_sharing_stage_updates_a_tied_parameter() -> None:
    """Of stages 0, 1, 2 sharing a weight (0 and 2) and all on this worker, stage 2 leaves it to stage
    0's optimizer and computes through a view of its own; on a worker holding only stage 2 it updates
    it itself."""
    shared = nn.Linear(3, 3)
    stages = {0: nn.Sequential(shared), 1: nn.Sequential(nn.Linear(3, 3)), 2: nn.Sequential(nn.Linear(3, 3))}
    stages[2][0].weight = shared.weight
    ties = find_ties(stages)
    assert updated_elsewhere_here(ties, [0, 1, 2]) == {2: {id(shared.weight)}}
    assert updated_elsewhere_here(ties, [2]) == {} == updated_elsewhere_here(ties, [0, 1])
    weights = StageWeights(stages[2], lambda ps: torch.optim.SGD(ps, lr=0.1), False, None, {id(shared.weight)})
    assert weights.optimizer is not None
    stepped = [p for group in weights.optimizer.param_groups for p in group["params"]]
    assert stepped == [stages[2][0].bias]
    leaves = weights.leaves(0)
    assert leaves["0.weight"] is not shared.weight  # its gradient stays this stage's
    assert leaves["0.weight"].untyped_storage().data_ptr() == shared.weight.untyped_storage().data_ptr()
    before = shared.weight.detach().clone()
    weights.forward(leaves, torch.ones(2, 3)).sum().backward()
    assert leaves["0.weight"].grad is not None and shared.weight.grad is None
    weights.add(0, [leaf.grad for leaf in weights.differentiable(leaves)])
    weights.update(0, set())
    assert torch.equal(shared.weight, before)  # stage 0's optimizer applies it
    assert weights.version == 1 and weights.leaves(1) is leaves  # the same views, following the storage


def test_a_non_flushing_stage_keeps_its_own_copy_of_a_tied_parameter() -> None:
    """Under a non-flushing schedule the later sharing stage keeps a copy with its own versions: its
    optimizer steps the copy, which takes over the state the optimizer had for the parameter (a
    checkpoint's, restored by name), and the module's parameter is left to the first stage."""
    shared = nn.Linear(3, 3)
    stage = nn.Sequential(nn.Linear(3, 3))
    stage[0].weight = shared.weight

    def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        built = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        built.state[shared.weight] = {"momentum_buffer": torch.ones(3, 3)}  # as restored from a checkpoint
        return built

    weights = StageWeights(stage, optimizer, True, None, {id(shared.weight)})
    copy = weights.params[0]
    assert copy is not shared.weight and torch.equal(copy, shared.weight)
    assert copy.untyped_storage().data_ptr() != shared.weight.untyped_storage().data_ptr()
    assert weights.optimizer is not None and weights.optimizer.param_groups[0]["params"][0] is copy
    assert torch.equal(weights.optimizer.state[copy]["momentum_buffer"], torch.ones(3, 3))
    assert shared.weight not in weights.optimizer.state
    before = shared.weight.detach().clone()
    leaves = weights.leaves(0)
    weights.forward(leaves, torch.ones(2, 3)).sum().backward()
    weights.add(0, [leaf.grad for leaf in weights.differentiable(leaves)])
    weights.update(0, set())
    assert torch.equal(shared.weight, before) and not torch.equal(copy, before)
