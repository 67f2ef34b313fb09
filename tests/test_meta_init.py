"""A model built on the meta device is never whole anywhere: each rank materialises its own stages
(:mod:`lightning_pipe.strategy.materialise`).

Oracles: the same module built eagerly after the same seed (an ``nn.Sequential`` of layers whose
constructors call ``reset_parameters``: the values must be equal bitwise), and plain Lightning on
one device trained from that eager module (the pipeline built on the meta device must end with its
parameters).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pipe import PipelineStrategy, PlanningError
from lightning_pipe.runtime import run_local
from lightning_pipe.strategy.materialise import materialise
from lightning_pipe.strategy.ownership import tensor_ids
from tests.lightning_cases import Chain, final_state, held, loader, plain_fit, trainer
from tests.test_strategy import _assert_close_states
from tests.user_modules import GPTModule

STAGE_0 = {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
STAGE_1 = {"net.4.weight", "net.4.bias", "net.6.weight", "net.6.bias"}


@settings(max_examples=30, deadline=None)
@given(st.lists(st.booleans(), min_size=7, max_size=7), st.integers(0, 3))
def test_any_share_of_the_layers_materialises_as_the_eager_model(kept: list[bool], seed: int) -> None:
    """Whatever layers a rank keeps, its tensors equal the eagerly built module's bitwise, the others
    stay on the meta device, and the optimizer holds the materialised parameters."""
    eager = Chain(blocks=3, seed=seed)
    with torch.device("meta"):
        lazy = Chain(blocks=3, seed=seed)
    optimizer = torch.optim.SGD(lazy.parameters(), lr=0.1)
    keep = tensor_ids(layer for layer, flag in zip(lazy.net, kept, strict=True) if flag)
    materialise(lazy, [lazy], keep, torch.device("cpu"), [optimizer])
    for (name, want), (_, got) in zip(eager.state_dict().items(), lazy.state_dict().items(), strict=True):
        index = int(name.split(".")[1])
        assert got.is_meta == (not kept[index]), name
        if kept[index]:
            assert torch.equal(got, want), name
    params = [p for group in optimizer.param_groups for p in group["params"]]
    assert [p is q for p, q in zip(params, lazy.parameters(), strict=True)] == [True] * len(params)


def test_a_tensor_no_reset_parameters_sets_is_refused_by_name() -> None:
    """The GPT's LayerNorm is a module of its own with nn.Parameters and no reset_parameters: built on
    the meta device, its weights would be uninitialised memory."""
    with torch.device("meta"):
        module = GPTModule()
    keep = tensor_ids([module])
    with pytest.raises(PlanningError, match=r"no reset_parameters\(\) sets model\.transformer\.h\.0\.ln_1\.bias"):
        materialise(module, [module], keep, torch.device("cpu"))


class _Configured(Chain):
    """The Chain's net built on the meta device in ``configure_model``, as for Lightning's
    ``ModelParallelStrategy`` (and torchtitan)."""

    def __init__(self) -> None:
        super().__init__()
        del self.net

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            with torch.device("meta"):
                self.net = Chain().net
            self.built_on_meta = all(p.is_meta for p in self.net.parameters())


def _meta_worker(rank: int, root: str, how: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    result: dict[str, Any] = {}
    saved = str(Path(root) / "saved")
    for epochs, resume in ((1, None), (2, saved)) if how == "init_module" else ((1, None),):
        strategy = PipelineStrategy("1f1b", microbatches=2, balance=[4, 3], state_dict_type="sharded")
        run = trainer(Path(root) / how / str(epochs), strategy, 2, max_epochs=epochs)
        if how == "init_module":
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # Lightning warns when a strategy cannot build the model there
                with run.init_module(empty_init=True):
                    model = Chain()
            model.built_on_meta = all(p.is_meta for p in model.parameters())
        else:
            model = _Configured()
        run.fit(model, loader(4), ckpt_path=resume)
        if resume is None:
            run.save_checkpoint(saved)
        result[f"epochs_{epochs}"] = {
            "meta": model.built_on_meta,
            "held": held(model),
            "final": final_state(run, model),
        }
    return result


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["init_module", "configure_model"])
def test_a_model_built_on_the_meta_device_trains_as_the_eager_one(tmp_path: Path, how: str) -> None:
    """``Trainer.init_module(empty_init=True)`` or ``configure_model``: the module is built on the meta
    device, each of the 2 ranks materialises its stage only, and training ends with the parameters of
    plain Lightning trained from the eagerly built module (1e-5). A sharded checkpoint of it resumes
    into a new model built on the meta device (each rank reads its stage's weights and momentum once
    materialised) and ends as plain Lightning's uninterrupted run."""
    results = run_local(_meta_worker, 2, str(tmp_path), how, timeout=200)
    expected = plain_fit(tmp_path / "plain", {"batches": 4})["final"]
    runs = [results[0]["epochs_1"], results[1]["epochs_1"]]
    if how == "init_module":
        runs += [results[0]["epochs_2"], results[1]["epochs_2"]]
        two = plain_fit(tmp_path / "plain_two", {"batches": 4, "trainer": {"max_epochs": 2}})["final"]
        _assert_close_states(results[0]["epochs_2"]["final"], two, 1e-5)
    assert all(r["meta"] for r in runs)
    assert [r["held"] for r in runs] == [STAGE_0, STAGE_1] * (len(runs) // 2)
    _assert_close_states(results[0]["epochs_1"]["final"], expected, 1e-5)
