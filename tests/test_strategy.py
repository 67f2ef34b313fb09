"""``PipelineStrategy`` against plain Lightning and the runtime's single-process references.

Each multi-process test starts its processes once (:func:`run_local`, with a deadline) and trains
several cases in them. The synchronous families must end with the parameters of the same unchanged
module trained by Lightning on one device, and log the same values; the delayed-weight families end
with the parameters of :func:`reference.reference` under their update rule.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_pipe import consolidate
from lightning_pipe.planning import SETUP_PHASES
from lightning_pipe.runtime import run_local
from lightning_pipe.runtime.affinity import cores_of
from lightning_pipe.strategy.sharded import METADATA
from tests import reference
from tests.lightning_cases import Chain, batch_list, fit_case, loader, plain_fit, stage_modules, trainer

FP16 = {"init_scale": 2.0**40, "backoff_factor": 2.0**-30, "growth_interval": 2}  # overflows at step 1 only
FP16_STATE = {"growth_factor": 2.0, "backoff_factor": 2.0**-30, "growth_interval": 2}


def _run_cases(tmp_path: Path, processes: int, cases: list[dict[str, Any]], timeout: float = 240) -> list[list[dict]]:
    """``results[i][rank]`` of every case, trained one after the other in the same processes."""
    return run_local(_cases_worker, processes, str(tmp_path), cases, timeout=timeout)


def _cases_worker(rank: int, root: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [fit_case(rank, str(Path(root) / case["name"]), case) for case in cases]


def _transpose(results: list[list[dict]], cases: list[dict]) -> dict[str, list[dict]]:
    return {case["name"]: [per_rank[i] for per_rank in results] for i, case in enumerate(cases)}


def _metrics(root: Path) -> list[dict[str, str]]:
    """The rows of metrics.csv without the pipeline's own report (columns ``pipeline/...``)."""
    with open(root / "metrics.csv") as handle:
        rows = [{k: v for k, v in row.items() if not k.startswith("pipeline/")} for row in csv.DictReader(handle)]
    return [row for row in rows if any(v for k, v in row.items() if k not in ("step", "epoch"))]


def _assert_close_states(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=tol, rtol=0), (
            name,
            (got[name] - expected[name]).abs().max(),
        )


def _assert_same_metrics(got: list[dict[str, str]], expected: list[dict[str, str]], tol: float) -> None:
    """Same rows (steps, epochs), same columns, values equal to ``tol``."""
    assert [r.keys() for r in got] == [r.keys() for r in expected]
    assert len(got) == len(expected) > 0
    for row_got, row_expected in zip(got, expected, strict=True):
        for key, value in row_expected.items():
            if value == "" or key in ("step", "epoch"):
                assert row_got[key] == value, (key, row_got, row_expected)
            else:
                assert abs(float(row_got[key]) - float(value)) <= tol, (key, row_got[key], value)


SYNC_CASES = [
    {
        "name": "gpipe_pinned",
        "batches": 2,
        "trainer": {"max_epochs": 3},
        "strategy": {"schedule": "gpipe", "microbatches": 2, "balance": [3, 4], "pin_cpus": True},
    },
    {
        "name": "1f1b_scheduler_clip",
        "batches": 5,
        "model": {"scheduler": True},
        "trainer": {"gradient_clip_val": 0.05},
        "strategy": {"schedule": "1f1b", "microbatches": 3, "balance": [4, 3]},
    },
    {
        "name": "zb_h1_adam",
        "batches": 4,
        "model": {"optimizer": "adam"},
        "trainer": {"max_epochs": 2},
        "strategy": {"schedule": "zb_h1", "microbatches": 2, "balance": [2, 5]},
    },
    {
        "name": "1f1b_bf16",
        "batches": 4,
        "trainer": {"precision": "bf16-mixed"},
        "strategy": {"schedule": "1f1b", "microbatches": 1, "balance": [3, 4]},
    },
    {
        "name": "1f1b_loop_options",
        "batches": 6,
        "early_stopping": True,
        "trainer": {"max_epochs": 5, "max_steps": 7, "limit_train_batches": 4, "val_check_interval": 2},
        "strategy": {"schedule": "1f1b", "microbatches": 2, "balance": [3, 4]},
    },
    {
        "name": "interleaved_value_clip",
        "batches": 4,
        "trainer": {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
        "strategy": {"schedule": "interleaved", "microbatches": 2, "balance": [2, 2, 2, 1]},
    },
]


@pytest.mark.timeout(300)
def test_sync_families_train_and_log_as_plain_lightning(tmp_path: Path) -> None:
    """GPipe (three epochs, validated after each), 1F1B (with a per-step LR scheduler and global-norm
    clipping), ZB-H1 (Adam, two epochs), 1F1B in bf16-mixed (one micro-batch: bf16 rounds
    micro-batches' gradients apart) and interleaved 1F1B (value clipping) on 2 processes end with
    the parameters of the same module trained by Lightning on one device, and write the same
    metrics.csv. Guards against a pipeline step run twice or not at all per batch, LR steps applied
    to the wrong step, clipping by per-stage instead of global norm, no autocast around the stages,
    and logs of one micro-batch instead of the batch. One 1F1B case runs Lightning's loop options: limit_train_batches,
    val_check_interval mid-epoch, max_steps and EarlyStopping on the relayed val_loss."""
    results = _transpose(_run_cases(tmp_path, 2, SYNC_CASES), SYNC_CASES)
    for case in SYNC_CASES:
        expected = plain_fit(tmp_path / "plain" / case["name"], case)["final"]
        for rank_result in results[case["name"]]:
            _assert_close_states(rank_result["final"], expected, 1e-5)
        assert any((rank_result["final"][k] - rank_result["initial"][k]).abs().max() > 1e-3 for k in expected)
        if "clip" in case["name"] or "bf16" in case["name"]:  # the option changes the result
            without = {key: value for key, value in case.get("trainer", {}).items() if "clip" not in key}
            without.pop("precision", None)
            other = plain_fit(tmp_path / "without" / case["name"], {**case, "trainer": without})["final"]
            assert max((other[k] - expected[k]).abs().max() for k in expected) > 1e-4, case["name"]
        _assert_same_metrics(_metrics(tmp_path / case["name"]), _metrics(tmp_path / "plain" / case["name"]), 1e-5)
        if case.get("early_stopping"):  # stopped at the second validation (step 4), before max_steps
            assert max(int(row["step"]) for row in _metrics(tmp_path / case["name"])) == 3
        if case["strategy"].get("pin_cpus"):  # every thread of each rank on the rank's own core(s)
            allowed = os.sched_getaffinity(0)
            expected = [[tuple(sorted(cores_of(rank, 2, allowed)))] for rank in range(2)]
            assert [rank_result["placements"] for rank_result in results[case["name"]]] == expected
            every = [[tuple(sorted(allowed))]] * 2  # after fit, back on every core they had
            assert [rank_result["placements_after"] for rank_result in results[case["name"]]] == every


NONFLUSH_CASES = [
    {"name": "2bw", "rule": "2bw", "strategy": {"schedule": "2bw", "microbatches": 2, "balance": [3, 4]}},
    {"name": "cdp_v1", "rule": "2bw", "strategy": {"schedule": "cdp", "rule": "cdp_v1", "balance": [4, 3]}},
    {"name": "cdp_v2", "rule": "cdp_v2", "strategy": {"schedule": "cdp", "rule": "cdp_v2", "balance": [4, 3]}},
    {
        "name": "cdp_dp_v1",
        "rule": "2bw",
        "strategy": {"schedule": "cdp", "form": "dp", "rule": "cdp_v1", "balance": [3, 4]},
    },
    {"name": "cdp_dp_v2", "rule": "cdp_v2", "strategy": {"schedule": "cdp", "form": "dp", "balance": [4, 3]}},
    {  # 5 layers, 2 micro-batches: each process computes one, the stages' states passed between them
        "name": "cdp_zero_v2",
        "rule": "cdp_v2",
        "model": {"blocks": 2},
        "strategy": {"schedule": "cdp", "form": "zero", "rule": "cdp_v2", "microbatches": 2, "balance": [3, 2]},
    },
    {
        "name": "cdp_zero_v1",
        "rule": "2bw",
        "strategy": {"schedule": "cdp", "form": "zero", "rule": "cdp_v1", "balance": [4, 3]},
    },
    {"name": "pipedream", "rule": "stash", "strategy": {"schedule": "pipedream", "microbatches": 2, "balance": [3, 4]}},
    {
        "name": "2bw_max_steps",
        "rule": "2bw",
        "trainer": {"max_steps": 4},
        "strategy": {"schedule": "2bw", "microbatches": 2, "balance": [3, 4]},
    },
    {
        "name": "pipedream_vertical",
        "rule": "schedule",
        "strategy": {"schedule": "pipedream", "rule": "vertical", "microbatches": 2, "balance": [3, 4]},
    },
    {
        "name": "2bw_stash",
        "rule": "schedule",
        "strategy": {"schedule": "2bw", "rule": "stash", "microbatches": 2, "balance": [4, 3]},
    },
]


def _rule(case: dict[str, Any], stages: int, microbatches: int) -> reference.Rule:
    if case["rule"] == "2bw":
        return reference.one_step_late
    if case["rule"] == "cdp_v2":
        return reference.cdp_v2(stages)
    vertical = case["strategy"].get("rule") == "vertical"  # PipeDream's default rule is stashing
    return (reference.pipedream_vertical if vertical else reference.pipedream_stash)(stages, microbatches)


EPOCHS = 3


def _epochs_and_resume(tmp_path: Path, cases: list[dict[str, Any]], batches: int) -> list[dict[str, Any]]:
    """Each case for :data:`EPOCHS` epochs of ``batches`` batches (a validation after each, which
    drains the pipeline) with a checkpoint at every epoch's end, then ``<name>_resumed``: the same
    run resumed from its first epoch's checkpoint (trained in the same processes, after it)."""
    whole = [
        {**case, "batches": batches, "checkpoint": True, "trainer": {"max_epochs": EPOCHS, **case.get("trainer", {})}}
        for case in cases
    ]
    first = f"epoch=0-step={batches}.ckpt"
    resumed = [
        {
            **case,
            "name": f"{case['name']}_resumed",
            "checkpoint": False,
            "resume": _checkpoint(tmp_path, case["name"], first),
        }
        for case in whole
    ]
    return whole + resumed


def _assert_resumed(cases: list[dict[str, Any]], results: dict[str, list[dict]]) -> None:
    """Each resumed run (:func:`_epochs_and_resume`) ends with its uninterrupted run's parameters."""
    for case in cases:
        if "resume" in case:
            for got, whole in zip(results[case["name"]], results[case["name"].removesuffix("_resumed")], strict=True):
                _assert_close_states(got["final"], whole["final"], 1e-6)


@pytest.mark.timeout(300)
def test_delayed_weight_families_equal_their_references(tmp_path: Path) -> None:
    """2BW (both rules), CDP-v1, CDP-v2 (as a pipeline; in the dp form, a replica per process,
    gradients reduced along the ring; in the ZeRO form, each stage's state passed from process to
    process, both rules) and PipeDream (stash, vertical sync) through Lightning, three epochs of 3
    batches on 2 processes with a validation after each (the pipeline drained only there, or at
    ``max_steps``), end with the parameters of the single-process reference of their update rule,
    the rule started over after each drain; resumed from the checkpoint of their first epoch they
    end as the uninterrupted run. The ZeRO form's validation after fit (its stages spread over their
    owners) gives what one device gives with those weights. Guards against a drain on every batch
    (which would make them synchronous), weight versions lost between Lightning's batches, and state
    lost or reordered at a drain or a resume (optimizer momentum, the ZeRO form's stages handed back
    to their owners, an epoch that silently trains nothing)."""
    cases = _epochs_and_resume(tmp_path, NONFLUSH_CASES, 3)
    zero = next(case for case in cases if case["name"] == "cdp_zero_v2")
    zero["evaluate"] = True  # the stages rest on their owners, one each: validation runs as a pipeline over them
    results = _transpose(_run_cases(tmp_path, 2, cases), cases)
    _assert_references(cases, results)
    _assert_resumed(cases, results)
    model = Chain(**zero["model"])
    model.load_state_dict(results["cdp_zero_v2"][0]["final"])
    plain = trainer(tmp_path / "plain_zero", "auto", 1).validate(model, loader(2, seed=7), verbose=False)
    for rank_result in results["cdp_zero_v2"]:
        assert rank_result["validate"][0].keys() == plain[0].keys()
        for key, value in plain[0].items():
            assert abs(rank_result["validate"][0][key] - value) < 1e-5, (key, rank_result["validate"], plain)


def _runs(case: dict[str, Any]) -> list[int]:
    """The steps of each run between drains: every epoch's batches, up to ``max_steps``."""
    options = case.get("trainer", {})
    steps = case["batches"] * options.get("max_epochs", 1)
    if options.get("max_steps", -1) > 0:  # max_steps ends the epoch early: drained there
        steps = min(steps, options["max_steps"])
    return [min(case["batches"], steps - start) for start in range(0, steps, case["batches"])]


def _assert_references(cases: list[dict[str, Any]], results: dict[str, list[dict]]) -> None:
    """Every rank's parameters are those of the case's update rule's reference over the case's runs
    between drains, and not those of synchronous training."""
    for case in cases:
        balance = case["strategy"]["balance"]
        microbatches = case["strategy"].get("microbatches", len(balance))
        model = Chain(**case.get("model", {}))
        stages = stage_modules(model, balance)
        rule = _rule(case, len(balance), microbatches)
        runs = _runs(case)
        data = [batch for run in runs for batch in batch_list(case["batches"])[:run]]
        expected = reference.reference(stages, data, microbatches, rule, "sgd", runs=runs)
        sync = reference.reference(stages, data, microbatches, reference.sync, "sgd")
        names = [name for name, _ in model.named_parameters()]
        for rank_result in results[case["name"]]:
            got = [rank_result["final"][name] for name in names]
            flat_expected = [p for stage in expected for p in stage]
            flat_sync = [p for stage in sync for p in stage]
            for g, e in zip(got, flat_expected, strict=True):
                assert torch.allclose(g, e, atol=1e-5, rtol=0), (case["name"], (g - e).abs().max())
            assert max((g - s).abs().max() for g, s in zip(got, flat_sync, strict=True)) > 1e-4, case["name"]


def _checkpoint(tmp_path: Path, case: str, name: str = "last.ckpt") -> str:
    return str(tmp_path / case / "checkpoints" / name)


def _resume_worker(rank: int, root: str, checkpoint: str) -> str:
    case = {"name": "resume", "batches": 4, "trainer": {"max_epochs": 2}, "resume": checkpoint, "strategy": {}}
    try:
        fit_case(rank, root, case)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "resumed"


@pytest.mark.timeout(300)
def test_resume_checkpoint_and_evaluation(tmp_path: Path) -> None:
    """On 2 processes: (1) 2BW and 1F1B (Adam, per-step LR scheduler) interrupted after one epoch and
    resumed from the checkpoint end with the parameters of the uninterrupted run, the 2BW ones not
    those of a synchronous run; (2) the checkpoint holds the full model under its own names and
    loads with ``Chain.load_from_checkpoint`` on one device, no strategy; (3) validate, test and
    predict after fit give what plain Lightning gives for the same training; (4) a checkpoint of
    plain Lightning (Adam, scheduler) resumes as a pipeline and ends as plain Lightning's uninterrupted
    run; (5) float16's loss scale resumes where it was; (6) 2BW's checkpoint (sharded, written after
    a drain) resumes on one stage, and one holding a weight version in flight is refused with what would
    work. Guards against stage optimizer states, the LR schedule, the step count or the loss scale
    lost at a resume, Adam's moments dropped when resuming an unsplit run, and a checkpoint holding
    only rank 0's stages."""
    runs = {
        "2bw": {"strategy": {"schedule": "2bw", "microbatches": 2, "balance": [3, 4], "state_dict_type": "sharded"}},
        "1f1b": {
            "strategy": {"schedule": "1f1b", "balance": [4, 3]},
            "model": {"optimizer": "adam", "scheduler": True},
        },
        "gpipe_fp16": {"strategy": {"schedule": "gpipe", "microbatches": 2, "balance": [3, 4]}, "fp16": FP16},
    }
    plain_first = {"name": "plain_first", "batches": 4, "checkpoint": True, "model": runs["1f1b"]["model"]}
    plain_fit(tmp_path / "plain_first", plain_first)
    cases = [
        {
            **runs["1f1b"],
            "name": "from_plain",
            "batches": 4,
            "trainer": {"max_epochs": 2},
            "resume": _checkpoint(tmp_path, "plain_first"),
        }
    ]
    for name, run in runs.items():
        cases += [
            {**run, "name": f"{name}_whole", "batches": 4, "trainer": {"max_epochs": 2}, "checkpoint": True},
            {**run, "name": f"{name}_first", "batches": 4, "trainer": {"max_epochs": 1}, "checkpoint": True},
            {
                **run,
                "name": f"{name}_resumed",
                "batches": 4,
                "trainer": {"max_epochs": 2},
                "resume": _checkpoint(tmp_path, f"{name}_first"),
            },
        ]
    whole_1f1b = next(case for case in cases if case["name"] == "1f1b_whole")
    whole_1f1b["evaluate"] = True
    results = _transpose(_run_cases(tmp_path, 2, cases), cases)
    for name in runs:
        whole, resumed = results[f"{name}_whole"], results[f"{name}_resumed"]
        for rank in range(2):
            _assert_close_states(resumed[rank]["final"], whole[rank]["final"], 1e-6)
            assert resumed[rank]["precision"] == whole[rank]["precision"]
        path = _checkpoint(tmp_path, f"{name}_whole")
        if Path(path).is_dir():  # sharded: one file first, by the function behind lightning-pipe consolidate
            consolidate(path, tmp_path / f"{name}.ckpt")
            path = str(tmp_path / f"{name}.ckpt")
        loaded = Chain.load_from_checkpoint(path, map_location="cpu")
        _assert_close_states({k: v for k, v in loaded.state_dict().items()}, whole[0]["final"], 0)
    # 8 steps: the first overflowed (2^40 -> 2^10), 7 good ones grew it 3 times: the resume went on from 2^11
    assert results["gpipe_fp16_whole"][0]["precision"] == {**FP16_STATE, "scale": 2.0**13, "_growth_tracker": 1}
    plain = plain_fit(tmp_path / "plain", {**whole_1f1b, "checkpoint": False})
    for rank in range(2):
        _assert_close_states(results["1f1b_whole"][rank]["final"], plain["final"], 1e-5)
        _assert_close_states(results["from_plain"][rank]["final"], plain["final"], 1e-5)
    # a 2BW checkpoint has nothing in flight (it is written after a drain): it resumes on one stage;
    # one that held a weight version still to be used could not be split otherwise, and is refused
    (resumed,) = run_local(_resume_worker, 1, str(tmp_path / "one_stage"), _checkpoint(tmp_path, "2bw_first"))
    assert resumed == "resumed"
    in_flight = tmp_path / "in_flight.ckpt"
    shutil.copytree(_checkpoint(tmp_path, "2bw_first"), in_flight)
    metadata = torch.load(in_flight / METADATA, weights_only=False)
    stages = metadata["optimizer_states"][0]["pipeline"]["stages"]
    assert set(stages) == {0, 1} and not stages[1]["in_flight"]
    stages[1]["in_flight"] = True  # as if a weight version were still to be used
    torch.save(metadata, in_flight / METADATA)
    (refused,) = run_local(_resume_worker, 1, str(tmp_path / "in_flight"), str(in_flight))
    assert re.search(
        r"holds 2bw weight versions or gradients still to apply for its split \[\[0, 2\], \[3, 6\]\], which this run "
        r"\(1f1b, \[\[0, 6\]\]\) cannot take: resume with schedule='2bw' and the checkpoint's split",
        refused,
    )
    for rank in range(2):
        got = results["1f1b_whole"][rank]
        for kind in ("validate", "test"):
            assert got[kind][0].keys() == plain[kind][0].keys()
            for key, value in plain[kind][0].items():
                assert abs(got[kind][0][key] - value) < 1e-5, (kind, key)
        assert len(got["predict"]) == len(plain["predict"]) == 2
        for p, q in zip(got["predict"], plain["predict"], strict=True):
            assert torch.allclose(p, q, atol=1e-6)


@pytest.mark.timeout(300)
def test_four_processes_and_data_parallel_pipelines(tmp_path: Path) -> None:
    """On 4 processes: 4-stage 1F1B equals plain Lightning and 4-stage 2BW its reference; two copies
    of a 2-stage 1F1B pipeline (``data_parallel=2``) train, log (``sync_dist`` included) and end
    exactly as Lightning's own DDP on 2 processes, which shards the data the same way. Guards against
    copies that read the same shard, gradients summed instead of averaged over the copies, and
    ``sync_dist`` reducing over every rank instead of over the copies; the strategy's collectives
    (``reduce``, ``all_gather``, ``broadcast``, ``reduce_boolean_decision``) give what DDP's give.
    A checkpoint of one 2-stage pipeline resumes as two copies and ends as DDP resumed from
    Lightning's own checkpoint of the same epoch (the number of copies may change at a resume), and
    as one pipeline of 4 stages it ends as plain Lightning's uninterrupted run (the stages may change
    at a resume: a sharded checkpoint of 2 stages read by parameter name, optimizer state included),
    each rank holding its stage's weights only."""
    cases = [
        {"name": "1f1b_4", "batches": 5, "strategy": {"schedule": "1f1b", "microbatches": 4, "balance": [2, 2, 2, 1]}},
        {"name": "2bw_4", "batches": 6, "strategy": {"schedule": "2bw", "microbatches": 4, "balance": [1, 2, 2, 2]}},
        {
            "name": "hybrid",
            "batches": 6,
            "collectives": True,
            "trainer": {"max_epochs": 2},
            "checkpoint": True,
            "strategy": {
                "schedule": "1f1b",
                "data_parallel": 2,
                "microbatches": 2,
                "balance": [3, 4],
                "state_dict_type": "sharded",
            },
        },
    ]
    first = {"batches": 6, "checkpoint": True, "strategy": {"schedule": "1f1b", "microbatches": 2, "balance": [3, 4]}}
    plain_fit(tmp_path / "plain_first", {**first, "name": "plain_first"})
    ddp_case = {**cases[2], "name": "ddp", "lightning_strategy": "ddp"}
    ddp_resumed = {**ddp_case, "name": "ddp_resumed", "resume": _checkpoint(tmp_path, "plain_first")}
    sharded = {**first, "name": "sharded_first", "strategy": {**first["strategy"], "state_dict_type": "sharded"}}
    two = [{**first, "name": "pipe_first"}, sharded, ddp_case, ddp_resumed]
    ddp = _transpose(_run_cases(tmp_path, 2, two), two)
    cases.append({**cases[2], "name": "hybrid_resumed", "resume": _checkpoint(tmp_path, "pipe_first")})
    four = {"schedule": "1f1b", "microbatches": 2, "balance": [2, 2, 2, 1]}
    resumed = {"trainer": {"max_epochs": 2}, "resume": _checkpoint(tmp_path, "sharded_first")}
    cases.append({"name": "four_stages_resumed", "batches": 6, "strategy": four, **resumed})
    results = _transpose(_run_cases(tmp_path, 4, cases), cases)
    expected = plain_fit(tmp_path / "plain", cases[0])["final"]
    for rank_result in results["1f1b_4"]:
        _assert_close_states(rank_result["final"], expected, 1e-5)
    model = Chain()
    names = [name for name, _ in model.named_parameters()]
    stages = stage_modules(model, cases[1]["strategy"]["balance"])
    flat = [p for stage in reference.reference(stages, batch_list(6), 4, reference.one_step_late, "sgd") for p in stage]
    for rank_result in results["2bw_4"]:
        for name, want in zip(names, flat, strict=True):
            assert torch.allclose(rank_result["final"][name], want, atol=1e-5), name
    for rank_result in results["hybrid"]:
        _assert_close_states(rank_result["final"], ddp["ddp"][0]["final"], 1e-5)
    written = consolidate(_checkpoint(tmp_path, "hybrid"))  # sharded by the first copy's ranks only
    _assert_close_states(written["state_dict"], results["hybrid"][0]["final"], 0)
    for rank_result in results["hybrid_resumed"]:  # 1 copy for epoch 1, 2 copies from the resume on
        _assert_close_states(rank_result["final"], ddp["ddp_resumed"][0]["final"], 1e-5)
    _assert_same_metrics(_metrics(tmp_path / "hybrid"), _metrics(tmp_path / "ddp"), 1e-5)
    # reduce, all_gather, broadcast, reduce_boolean_decision: what DDP's give for the same replicas' values
    expected_collectives = {"mean": 1.5, "sum": 3.0, "max": 2.0, "gather": [1.0, 2.0], "broadcast": 10}
    expected_collectives |= {"all": False, "any": True}
    assert [r["collectives"] for r in ddp["ddp"]] == [expected_collectives] * 2
    assert [r["collectives"] for r in results["hybrid"]] == [expected_collectives] * 4
    uninterrupted = plain_fit(tmp_path / "plain_two", {"batches": 6, "trainer": {"max_epochs": 2}})["final"]
    for rank_result in results["four_stages_resumed"]:
        _assert_close_states(rank_result["final"], uninterrupted, 1e-5)
    layers = [["net.0.weight", "net.0.bias"], [], ["net.2.weight", "net.2.bias"], [], ["net.4.weight", "net.4.bias"]]
    layers += [[], ["net.6.weight", "net.6.bias"]]
    spans = [(0, 2), (2, 4), (4, 6), (6, 7)]  # balance [2, 2, 2, 1]
    held = [{name for layer in layers[a:b] for name in layer} for a, b in spans]
    assert [r["held"] for r in results["four_stages_resumed"]] == held


@pytest.mark.timeout(200)
def test_one_device(tmp_path: Path) -> None:
    """``PipelineStrategy()`` on one device (one stage, one micro-batch) trains exactly as Lightning
    alone, in 32-true and bf16-mixed; CDP's single-device form (three stages, three micro-batches in
    the cyclic order) ends with the parameters of its rules' references over three epochs with a
    validation after each, and as much when resumed from its first epoch's checkpoint. The set-up's
    time is kept by phase (nothing profiled where the stages were given)."""
    cases = [
        {"name": "one_device", "batches": 5, "strategy": {}},
        {"name": "one_device_bf16", "batches": 5, "strategy": {}, "trainer": {"precision": "bf16-mixed"}},
    ]
    single = [
        {"name": "cdp_single_v2", "rule": "cdp_v2", "strategy": {"schedule": "cdp", "form": "single"}},
        {"name": "cdp_single_v1", "rule": "2bw", "strategy": {"schedule": "cdp", "form": "single", "rule": "cdp_v1"}},
    ]
    for case in single:
        case["strategy"].update(balance=[2, 2, 3])
    single = _epochs_and_resume(tmp_path, single, 3)
    results = _transpose(_run_cases(tmp_path, 1, cases + single), cases + single)
    for case in cases:
        expected = plain_fit(tmp_path / "plain" / case["name"], case)["final"]
        _assert_close_states(results[case["name"]][0]["final"], expected, 0)
    planned, given = results["one_device"][0]["setup_seconds"], results["cdp_single_v2"][0]["setup_seconds"]
    for seconds in (planned, given):  # the set-up's wall time by phase, which add up to its total
        assert list(seconds) == [*SETUP_PHASES, "executor", "total"] and min(seconds.values()) >= 0
        assert seconds["total"] == pytest.approx(sum(seconds[phase] for phase in [*SETUP_PHASES, "executor"]))
        assert seconds["capture"] > 0 and seconds["verify"] > 0
    assert planned["profile"] > 0 and given["profile"] == 0  # CDP's stages were given (balance=)
    _assert_references(single, results)
    _assert_resumed(single, results)


@pytest.mark.timeout(200)
def test_synchronous_families_on_one_device(tmp_path: Path) -> None:
    """A synchronous family with every stage on the one device (``form="single"``), planned or given,
    over two epochs with a validation after each, ends with plain Lightning's parameters; the rank
    holds every stage, and the plan's memory for the device is its stages' together."""
    cases = [
        {"name": "1f1b_single", "strategy": {"schedule": "1f1b", "form": "single", "stages": 3, "microbatches": 2}},
        {"name": "gpipe_single", "strategy": {"schedule": "gpipe", "form": "single", "balance": [2, 2, 3]}},
        {"name": "zb_h1_single", "strategy": {"schedule": "zb_h1", "form": "single", "balance": [3, 4]}},
    ]
    cases = [{**case, "batches": 3, "trainer": {"max_epochs": 2}} for case in cases]
    results = _transpose(_run_cases(tmp_path, 1, cases), cases)
    for case in cases:
        expected = plain_fit(tmp_path / "plain" / case["name"], case)["final"]
        (result,) = results[case["name"]]
        _assert_close_states(result["final"], expected, 1e-5)
        assert len(result["bounds"]) == len(case["strategy"].get("balance", [0] * 3))
        assert result["held"] == set(expected)


OTHER_SYNC_CASES = [
    {"name": "looped_bfs", "strategy": {"schedule": "looped_bfs", "balance": [2, 2, 2, 1]}},
    {"name": "1f1b_star", "strategy": {"schedule": "1f1b_star", "period": 3.0, "balance": [3, 4]}},
    {"name": "kperiodic", "strategy": {"schedule": "kperiodic", "k": 1, "balance": [3, 4]}},
    {"name": "pp", "strategy": {"schedule": "pp", "balance": [3, 4]}},
    {"name": "1f1b_rr_given", "strategy": {"schedule": "1f1b_rr", "balance": [7], "stage_replicas": [2]}},
    {"name": "1f1b_rr_planned", "strategy": {"schedule": "1f1b_rr", "partitioner": "pipedream", "microbatches": 4}},
    {"name": "ddp", "strategy": {"schedule": "ddp", "balance": [3, 4]}},
    {"name": "ddp_accumulating", "strategy": {"schedule": "ddp", "microbatches": 4, "stages": 3}},
    {"name": "fsdp", "strategy": {"schedule": "fsdp", "balance": [3, 4]}},
    {"name": "lpp", "strategy": {"schedule": "lpp", "groups": 1, "microbatches": 2, "balance": [2, 2, 2, 1]}},
    {"name": "fslpp", "strategy": {"schedule": "fslpp", "groups": 2, "balance": [3, 4]}},
]
HELD_BY_LPP = [  # lpp on one group of 2 workers: worker w holds stages w and w + 2 (net.0, net.2, net.4, net.6)
    {f"net.{i}.{p}" for i in (0, 4) for p in ("weight", "bias")},
    {f"net.{i}.{p}" for i in (2, 6) for p in ("weight", "bias")},
]


@pytest.mark.timeout(300)
def test_every_other_runnable_family_trains_as_plain_lightning(tmp_path: Path) -> None:
    """Looped BFS, 1F1B*, k-periodic, 1F1B-RR (a stage replicated over both workers, given or
    planned by PipeDream's partitioner) and Rahimi et al.'s w(s, b, d) families (pp; ddp, also with
    two micro-batches per worker; fsdp, whose workers borrow each other's stages; lpp on one group
    of two workers; fslpp on two groups of one) through Lightning on 2 processes, over three epochs
    with validation after each, end with plain Lightning's parameters, and so does each resumed from
    its checkpoint of the first epoch. Each rank of lpp holds only the stages it loops over."""
    three = {"batches": 2, "trainer": {"max_epochs": 3}}
    cases = [{**case, **three, "checkpoint": True} for case in OTHER_SYNC_CASES]
    resumed = [
        {**case, **three, "name": f"{case['name']}_resumed", "resume": _checkpoint(tmp_path, case["name"], FIRST)}
        for case in OTHER_SYNC_CASES
    ]
    results = _transpose(_run_cases(tmp_path, 2, cases + resumed), cases + resumed)
    for case in OTHER_SYNC_CASES:
        expected = plain_fit(tmp_path / "plain" / case["name"], {**case, **three})["final"]
        for name in (case["name"], f"{case['name']}_resumed"):
            for rank_result in results[name]:
                _assert_close_states(rank_result["final"], expected, 1e-5)
    assert [rank_result["held"] for rank_result in results["lpp"]] == HELD_BY_LPP


FIRST = "epoch=0-step=2.ckpt"  # a case of 2 batches per epoch: its checkpoint after the first epoch


FP16_CASES = [
    {
        "name": "gpipe_fp16",
        "batches": 6,
        "fp16": FP16,
        "strategy": {"schedule": "gpipe", "microbatches": 2, "balance": [3, 4]},
    },
    {
        "name": "1f1b_fp16_clip",
        "batches": 6,
        "fp16": FP16,
        "trainer": {"gradient_clip_val": 0.3},
        "strategy": {"schedule": "1f1b", "microbatches": 2, "balance": [4, 3]},
    },
]


@pytest.mark.timeout(300)
def test_float16_loss_scaling_as_plain_lightning(tmp_path: Path) -> None:
    """float16 mixed precision (autocast and a GradScaler, on the CPU as on a GPU) through GPipe and
    1F1B with global-norm clipping ends as Lightning's single-device run: the same skipped first
    step (a loss scale of 2^40 overflows every stage's gradients), the same scale afterwards (backed
    off to 2^10, grown twice) and the same parameters. Guards against a loss that is not scaled or
    gradients not unscaled (parameters off by the scale), an overflowed step applied or skipped on
    one stage only, a scale that is not handed back to the scaler for checkpoints, and clipping of
    the still-scaled gradients."""
    results = _transpose(_run_cases(tmp_path, 2, FP16_CASES), FP16_CASES)
    for case in FP16_CASES:
        expected = plain_fit(tmp_path / "plain" / case["name"], case)
        assert expected["precision"]["scale"] == 2.0**12 and expected["precision"]["_growth_tracker"] == 1
        for rank_result in results[case["name"]]:
            assert rank_result["precision"] == expected["precision"]
            _assert_close_states(rank_result["final"], expected["final"], 2e-4)
        _assert_same_metrics(_metrics(tmp_path / case["name"]), _metrics(tmp_path / "plain" / case["name"]), 2e-4)
