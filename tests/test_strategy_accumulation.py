"""``Trainer(accumulate_grad_batches=k)`` under ``PipelineStrategy``: the flushing schedules
accumulate as Lightning does, the non-flushing ones are refused (``tests/test_strategy_errors.py``).

On 2 processes, 1F1B and GPipe with ``k = 2`` over epochs of 5 batches (the last update of each
epoch after one batch) end with the parameters of plain Lightning with ``accumulate_grad_batches=k``
on one device, and of plain Lightning fed the micro-batches (``k·m`` of them accumulated, ``1/m``
of the rows each), to 1e-6 with SGD; they write plain Lightning's ``metrics.csv`` (the unscaled loss
per batch, the step count, the learning rate of a per-step scheduler) and end at its
``global_step``. ZB-H1 follows a ``GradientAccumulationScheduler``, and float16's loss scale skips
and grows as plain Lightning's under accumulation. A checkpoint written mid-accumulation holds no
gradient, as Lightning's holds none: it resumes on another split and ends as plain Lightning's
resume of the same file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.lightning_cases import ROWS, plain_fit
from tests.test_strategy import (
    FP16,
    FP16_STATE,
    _assert_close_states,
    _assert_same_metrics,
    _metrics,
    _run_cases,
    _transpose,
)

ACCUMULATE, MICROBATCHES, BATCHES = 2, 2, 5  # 5 batches: updates after batches 2, 4 and 5 of each epoch


def _cases(tmp_path: Path) -> list[dict[str, Any]]:
    accumulate = {"accumulate_grad_batches": ACCUMULATE}
    mid = str(tmp_path / "mid.ckpt")
    one_f_one_b = {"schedule": "1f1b", "microbatches": MICROBATCHES, "balance": [4, 3]}
    return [
        {
            "name": "1f1b",
            "batches": BATCHES,
            "model": {"scheduler": True},
            "lr_monitor": True,
            "trainer": {**accumulate, "max_epochs": 2, "gradient_clip_val": 0.05},
            "strategy": one_f_one_b,
        },
        {
            "name": "gpipe",
            "batches": BATCHES,
            "trainer": {**accumulate, "max_epochs": 2},
            "strategy": {"schedule": "gpipe", "microbatches": MICROBATCHES, "balance": [3, 4]},
        },
        {
            "name": "zb_h1_scheduled",
            "batches": BATCHES,
            "accumulation_schedule": {1: 3},  # epoch 0 updates every batch, epoch 1 after batches 3 and 5
            "trainer": {"max_epochs": 2},
            "strategy": {"schedule": "zb_h1", "microbatches": MICROBATCHES, "balance": [2, 5]},
        },
        {
            "name": "gpipe_fp16",
            "batches": BATCHES,
            "fp16": FP16,  # the first update overflows: skipped, the scale backed off, then grown
            "trainer": {**accumulate, "gradient_clip_val": 0.05},
            "strategy": {"schedule": "gpipe", "microbatches": MICROBATCHES, "balance": [3, 4]},
        },
        {  # saved after batch 3 (index 2): the first batch of the second update accumulated
            "name": "saved_mid",
            "batches": BATCHES,
            "save_at": (2, mid),
            "trainer": accumulate,
            "strategy": one_f_one_b,
        },
        {  # on another split: nothing in flight
            "name": "resumed_mid",
            "batches": BATCHES,
            "resume": mid,
            "trainer": {**accumulate, "max_epochs": 2},
            "strategy": {**one_f_one_b, "balance": [3, 4]},
        },
    ]


@pytest.mark.timeout(300)
def test_flushing_schedules_accumulate_as_plain_lightning(tmp_path: Path) -> None:
    """Guards against an update on a batch Lightning accumulates (or none where it steps, the last
    batch of an epoch included), a loss not divided by ``k`` (or divided in the logs too), a
    gradient carried into the next step lost or applied twice, the LR scheduler or the loss scale
    moved per batch instead of per update, clipping of each batch's gradient instead of the sum, and
    an accumulated gradient saved in a checkpoint that plain Lightning's resume would not have."""
    cases = _cases(tmp_path)
    results = _transpose(_run_cases(tmp_path, 2, cases, timeout=200), cases)
    plain = {case["name"]: plain_fit(tmp_path / "plain" / case["name"], case) for case in cases[:4]}
    for case in cases[:4]:
        expected = plain[case["name"]]
        for rank_result in results[case["name"]]:
            _assert_close_states(rank_result["final"], expected["final"], 2e-4 if "fp16" in case else 1e-6)
            assert rank_result["global_step"] == expected["global_step"]
            assert rank_result["precision"] == expected["precision"]
        _assert_same_metrics(_metrics(tmp_path / case["name"]), _metrics(tmp_path / "plain" / case["name"]), 1e-6)
    assert plain["zb_h1_scheduled"]["global_step"] == 5 + 2
    # 3 updates: the first overflowed (2^40 backed off to 2^10), the next 2 grew it once
    assert plain["gpipe_fp16"]["precision"] == {**FP16_STATE, "scale": 2.0**11, "_growth_tracker": 0}
    for case in cases[:2]:  # the micro-batches fed to plain Lightning, k·m of them accumulated
        finer = {
            **case,
            "rows": ROWS // MICROBATCHES,
            "trainer": {**case["trainer"], "accumulate_grad_batches": ACCUMULATE * MICROBATCHES},
        }
        reference = plain_fit(tmp_path / "micro" / case["name"], finer)
        assert reference["global_step"] == results[case["name"]][0]["global_step"] == 6
        for rank_result in results[case["name"]]:
            _assert_close_states(rank_result["final"], reference["final"], 1e-6)
    saved, resumed = cases[4], cases[5]
    uninterrupted = plain_fit(tmp_path / "plain" / "saved_mid", {k: v for k, v in saved.items() if k != "save_at"})
    plain_resumed = plain_fit(tmp_path / "plain" / "resumed_mid", resumed)
    for rank in range(2):
        _assert_close_states(results["saved_mid"][rank]["final"], uninterrupted["final"], 1e-6)
        _assert_close_states(results["resumed_mid"][rank]["final"], plain_resumed["final"], 1e-6)
        assert results["resumed_mid"][rank]["global_step"] == plain_resumed["global_step"]
    pipeline = torch.load(saved["save_at"][1], weights_only=False)["optimizer_states"][0]["pipeline"]
    assert pipeline["calls"] + pipeline["origin"] == 3 and not any(s["in_flight"] for s in pipeline["stages"].values())
