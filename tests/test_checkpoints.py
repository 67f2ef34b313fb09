"""Checkpoints a user can trust, with every rank holding only its stages (2 processes, one run).

The oracle is plain Lightning on one device: 1F1B and GPipe train exactly as it does, so every
resumed run below, whatever it resumes on, must end with the parameters of plain Lightning's
uninterrupted run (SGD with momentum: a lost momentum buffer shows), and the callbacks that decide
through the strategy's collectives must decide as they do there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.lightning_cases import plain_fit
from tests.test_strategy import _assert_close_states, _run_cases, _transpose

STAGE_0 = {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}  # layers 0..3 of the Chain
STAGE_1 = {"net.4.weight", "net.4.bias", "net.6.weight", "net.6.bias"}


@pytest.mark.timeout(300)
def test_resume_on_another_split_or_device_count_and_from_or_to_plain_lightning(tmp_path: Path) -> None:
    """A 1F1B checkpoint after one epoch (split 4 | 3 layers), resumed (a) with another balance
    (2 | 5), (b) as GPipe without a balance (the checkpoint's split is reused, no profiling), (c) on
    one process, (d) by plain Lightning, and (e) a checkpoint saved by ``trainer.save_checkpoint``
    after ``fit`` returned, resumed by a new Trainer: each ends with plain Lightning's uninterrupted
    parameters to 1e-5. (f) A plain checkpoint resumes as a pipeline. Each rank held only its
    stage's weights; the checkpoint holds every parameter's optimizer state in Lightning's layout."""
    first = tmp_path / "first" / "checkpoints" / "last.ckpt"
    saved_after = str(tmp_path / "saved_after.ckpt")
    base = {"batches": 4, "strategy": {"schedule": "1f1b", "microbatches": 2}}
    two_epochs = {"trainer": {"max_epochs": 2}}
    cases = [
        {**base, "name": "first", "checkpoint": True, "strategy": {**base["strategy"], "balance": [4, 3]}},
        {**base, **two_epochs, "name": "rebalanced", "resume": str(first), "strategy": {"balance": [2, 5]}},
        {**base, **two_epochs, "name": "gpipe", "resume": str(first), "strategy": {"schedule": "gpipe"}},
        {**base, "name": "fit_then_save", "save_after": saved_after, "strategy": {"balance": [4, 3]}},
        {**base, **two_epochs, "name": "after_save", "resume": saved_after, "strategy": {"balance": [3, 4]}},
    ]
    plain_first = tmp_path / "plain_first.ckpt"
    plain_fit(tmp_path / "plain_first", {"batches": 4, "save_after": str(plain_first)})
    cases.append({**base, **two_epochs, "name": "from_plain", "resume": str(plain_first), "strategy": {}})
    results = _transpose(_run_cases(tmp_path, 2, cases), cases)
    (one,) = _run_cases(tmp_path / "one", 1, [{**cases[1], "name": "one", "strategy": {}}])
    expected = plain_fit(tmp_path / "plain", {"batches": 4, **two_epochs})["final"]
    by_plain = plain_fit(tmp_path / "by_plain", {"batches": 4, **two_epochs, "resume": str(first)})["final"]
    for name in ("rebalanced", "gpipe", "after_save", "from_plain"):
        _assert_close_states(results[name][0]["final"], expected, 1e-5)
    _assert_close_states(one[0]["final"], expected, 1e-5)
    _assert_close_states(by_plain, expected, 1e-5)
    assert results["gpipe"][0]["bounds"] == results["first"][0]["bounds"] == ((0, 3), (4, 6))
    assert results["rebalanced"][0]["bounds"] == ((0, 1), (2, 6))
    assert [r["held"] for r in results["first"]] == [STAGE_0, STAGE_1]  # each rank its stage, no more
    checkpoint = torch.load(first, weights_only=False)
    (optimizer,) = checkpoint["optimizer_states"]
    assert sorted(optimizer["state"]) == list(range(8))  # every parameter, by its index in the optimizer
    assert all(set(s) == {"momentum_buffer"} for s in optimizer["state"].values())
    assert optimizer["pipeline"]["plan"]["bounds"] == [[0, 3], [4, 6]]
    assert sorted(checkpoint["state_dict"]) == sorted(STAGE_0 | STAGE_1)


@pytest.mark.timeout(300)
def test_callbacks_decide_as_under_plain_lightning(tmp_path: Path) -> None:
    """``ModelCheckpoint(monitor="val_loss", save_top_k=2)`` keeps the same best two checkpoints and
    ``EarlyStopping`` stops at the same epoch as plain Lightning (both vote through
    ``reduce_boolean_decision``); ``ModelCheckpoint(every_n_train_steps=3)`` writes at the same steps;
    ``LearningRateMonitor`` runs. 1F1B and 2BW, 2 processes."""
    case = {
        "batches": 4,
        "monitor": 2,
        "every_n_train_steps": 3,
        "lr_monitor": True,
        "early_stopping": True,
        "model": {"scheduler": True},
        "trainer": {"max_epochs": 4},
    }
    expected = plain_fit(tmp_path / "plain", case)["callbacks"]
    cases = [{**case, "name": name, "strategy": {"schedule": name, "microbatches": 2}} for name in ("1f1b", "2bw")]
    results = _transpose(_run_cases(tmp_path, 2, cases), cases)
    assert expected["best"]["files"] and expected["steps"]["files"]
    for rank in range(2):
        got = results["1f1b"][rank]["callbacks"]
        assert got["stopped_epoch"] == expected["stopped_epoch"]
        assert got["best"]["files"] == expected["best"]["files"]
        assert got["best"]["best"] == expected["best"]["best"]
        assert got["best"]["score"] == pytest.approx(expected["best"]["score"], abs=1e-5)
        assert got["steps"]["files"] == expected["steps"]["files"]
        two = results["2bw"][rank]["callbacks"]  # other values, the same decisions' shape
        assert len(two["best"]["files"]) == len(expected["best"]["files"])
        assert two["steps"]["files"] == expected["steps"]["files"]
