"""Checkpoints a user can trust, with every rank holding only its stages (2 processes, one run).

The oracle is plain Lightning on one device: 1F1B and GPipe train exactly as it does, so every
resumed run below, whatever it resumes on, must end with the parameters of plain Lightning's
uninterrupted run (SGD with momentum: a lost momentum buffer shows), and the callbacks that decide
through the strategy's collectives must decide as they do there.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from lightning_pipe.cli import main
from lightning_pipe.strategy.sharded import load_sharded, read_entries
from tests.lightning_cases import Chain, plain_fit
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
    stage's weights; the checkpoint holds every parameter's optimizer state in Lightning's layout.
    (g) The same checkpoint written sharded (each rank its stage) consolidates to the same file
    (``lightning-pipe consolidate``), which ``load_from_checkpoint`` and plain Lightning read, and
    resumes as is with another balance and on one process, ending as the uninterrupted run."""
    first = tmp_path / "first" / "checkpoints" / "last.ckpt"
    sharded = tmp_path / "sharded_first" / "checkpoints" / "last.ckpt"
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
    sharded_first = {**cases[0], "name": "sharded_first"}
    sharded_first["strategy"] = {**cases[0]["strategy"], "state_dict_type": "sharded"}
    cases += [sharded_first, {**cases[1], "name": "sharded_rebalanced", "resume": str(sharded)}]
    plain_first = tmp_path / "plain_first.ckpt"
    plain_fit(tmp_path / "plain_first", {"batches": 4, "save_after": str(plain_first)})
    cases.append({**base, **two_epochs, "name": "from_plain", "resume": str(plain_first), "strategy": {}})
    results = _transpose(_run_cases(tmp_path, 2, cases), cases)
    one_cases = [
        {**cases[1], "name": "one", "strategy": {}},
        {**cases[1], "name": "one_sharded", "resume": str(sharded), "strategy": {}},
    ]
    one = _transpose(_run_cases(tmp_path / "one", 1, one_cases), one_cases)
    expected = plain_fit(tmp_path / "plain", {"batches": 4, **two_epochs})["final"]
    by_plain = plain_fit(tmp_path / "by_plain", {"batches": 4, **two_epochs, "resume": str(first)})["final"]
    for name in ("rebalanced", "gpipe", "after_save", "from_plain", "sharded_rebalanced"):
        _assert_close_states(results[name][0]["final"], expected, 1e-5)
    for name in ("one", "one_sharded"):
        _assert_close_states(one[name][0]["final"], expected, 1e-5)
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
    _assert_sharded_consolidates_to(sharded, first, tmp_path)


def _assert_sharded_consolidates_to(sharded: Path, full_path: Path, tmp_path: Path) -> None:
    """Each rank wrote only its stage's entries; ``lightning-pipe consolidate`` gives the full
    checkpoint's state, optimizer state and pipeline entry; it loads with ``load_from_checkpoint``
    and resumes under plain Lightning as the full one does."""
    full = torch.load(full_path, weights_only=False)
    shards = {rank: _entries(sharded, rank) for rank in (0, 1)}
    assert shards[0]["state_dict"] == STAGE_0 and shards[1]["state_dict"] == STAGE_1
    assert shards[0]["optimizer"] == STAGE_0 and shards[1]["optimizer"] == STAGE_1
    assert shards[0]["carried"] == {"0"} and shards[1]["carried"] == {"1"}
    assert shards[0]["stamp"] == {"0"} and shards[1]["stamp"] == {"1"}  # each rank stamps its part
    entries = load_sharded(sharded)["state_dict"]
    with mock.patch.object(dcp, "load", wraps=dcp.load) as reads:
        assert read_entries(entries, [*STAGE_1, "not.an.entry"]).keys() == STAGE_1
    assert reads.call_count == 1  # one read of the entries asked for: membership comes from the metadata
    output = tmp_path / "consolidated.ckpt"
    assert main(["consolidate", str(sharded), str(output)]) == 0
    got = torch.load(output, weights_only=False)
    _assert_close_states(got["state_dict"], full["state_dict"], 0)
    (want_optimizer,), (got_optimizer,) = full["optimizer_states"], got["optimizer_states"]
    assert got_optimizer["param_groups"] == want_optimizer["param_groups"]
    assert got_optimizer["state"].keys() == want_optimizer["state"].keys()
    for index, value in want_optimizer["state"].items():
        assert torch.equal(got_optimizer["state"][index]["momentum_buffer"], value["momentum_buffer"])
    pipeline = {key: value for key, value in got_optimizer["pipeline"].items() if key != "carried"}
    assert pipeline == {key: value for key, value in want_optimizer["pipeline"].items() if key != "carried"}
    assert got["epoch"] == full["epoch"] and got["global_step"] == full["global_step"]
    loaded = Chain.load_from_checkpoint(output, map_location="cpu")
    _assert_close_states(loaded.state_dict(), full["state_dict"], 0)
    resumed = plain_fit(tmp_path / "plain_from_sharded", {"batches": 4, "trainer": {"max_epochs": 2}, "resume": output})
    expected = plain_fit(
        tmp_path / "plain_from_full", {"batches": 4, "trainer": {"max_epochs": 2}, "resume": full_path}
    )
    _assert_close_states(resumed["final"], expected["final"], 0)


def _entries(sharded: Path, rank: int) -> dict[str, set[str]]:
    """The names of each tree rank ``rank`` wrote into the sharded checkpoint."""
    metadata = FileSystemReader(str(sharded)).read_metadata()
    written: dict[str, set[str]] = {"state_dict": set(), "optimizer": set(), "carried": set(), "stamp": set()}
    for index in metadata.storage_data:
        if index.fqn in metadata.planner_data and metadata.storage_data[index].relative_path == f"__{rank}_0.distcp":
            tree, name, *_ = metadata.planner_data[index.fqn]
            written[tree].add(str(name))
    return written


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
