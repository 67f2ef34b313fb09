"""Nothing lost: a save stopped half-way (a rank killed, a full disk) leaves the checkpoints saved
before intact and no temporary behind, every rank stops within seconds with the failing rank's error,
and ``ckpt_path="last"`` then resumes to the uninterrupted run's parameters (2 processes).

The faults are injected into the writes themselves (:mod:`tests.checkpoint_faults`), so each test
knows the fault landed mid-write: the killed or failing rank records the temporary file it was
writing and how many bytes it had written. The oracles: plain Lightning's uninterrupted run for 1F1B,
and the uninterrupted pipeline run with the same checkpoints (and so the same drains) for 2BW.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_pipe.cli import main
from lightning_pipe.runtime import run_local
from lightning_pipe.runtime.launch import LocalRunError
from lightning_pipe.strategy.atomic import TEMPORARY
from lightning_pipe.strategy.checkpoint_files import check_complete
from tests.checkpoint_faults import faulty_fit
from tests.lightning_cases import fit_case, plain_fit
from tests.test_strategy import _assert_close_states, _transpose

# 12 steps, saved at every epoch's last step (Lightning restarts an epoch resumed mid-way from its
# first batch, plain Lightning too: only a checkpoint at an epoch's end resumes to the same result)
BASE = {"batches": 2, "trainer": {"max_epochs": 6}, "checkpoint_every": 2}
ONE_F_ONE_B = {"schedule": "1f1b", "microbatches": 2, "balance": [4, 3]}
TWO_BW_SHARDED = {"schedule": "2bw", "microbatches": 2, "balance": [3, 4], "state_dict_type": "sharded"}
STOPPED_WITHIN = 20.0  # seconds from the fault to the other rank's error


def _failed_run(root: Path, case: dict[str, Any], fault: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Run ``case`` on 2 processes with ``fault``; it must fail. Returns what each rank recorded: the
    fault (``fault-<rank>.json``) and the error it stopped with (``outcome-<rank>.json``)."""
    kept = root.parent / f"{root.name}-records"
    kept.mkdir()
    with pytest.raises(LocalRunError):
        run_local(faulty_fit, 2, str(root), case, fault, str(kept), timeout=240)
    records: dict[int, dict[str, Any]] = {rank: {} for rank in range(2)}
    for rank in range(2):
        for kind in ("fault", "outcome"):
            file = kept / f"{kind}-{rank}.json"
            if file.exists():
                records[rank][kind] = json.loads(file.read_text())
    return records


def _checkpoints(directory: Path) -> dict[str, int]:
    """The checkpoints in ``directory`` by name, each with its global step; every one complete, and
    nothing else there (no temporary)."""
    assert not [p.name for p in directory.iterdir() if p.name.startswith(TEMPORARY)]
    steps = {}
    for path in sorted(directory.iterdir()):
        check_complete(path)
        meta = path / "meta.pt" if path.is_dir() else path
        steps[path.name] = torch.load(meta, weights_only=False)["global_step"]
    return steps


@pytest.mark.timeout(600)
def test_a_rank_killed_mid_save_then_resume_from_last(tmp_path: Path) -> None:
    """(1) 1F1B, full format: rank 0 is killed while it writes last.ckpt at step 8; (2) 2BW, sharded:
    rank 1 is killed while it writes its shard of last.ckpt/ at step 8. Each time the other rank stops
    within seconds naming the save; last.ckpt still holds step 6, complete, beside the step-numbered
    checkpoints; no temporary is left. Then ``ckpt_path="last"`` resumes both to the end, equal to
    their uninterrupted runs; the sharded step-6 checkpoint, consolidated with ``lightning-pipe
    consolidate``, resumes on the same split and on another one, equal to the uninterrupted run too.
    After fit, ``gather_after_fit=True`` gives every rank the whole model; by default a rank's module
    holds only its stages and calling it says how to get the rest."""
    full, sharded = tmp_path / "full", tmp_path / "sharded"
    cases = {
        "full": {**BASE, "name": "run", "strategy": ONE_F_ONE_B},
        "sharded": {**BASE, "name": "run", "strategy": TWO_BW_SHARDED},
    }
    # rank 0 opens one temporary per full save, rank 1 one per sharded save: step files and last.ckpt
    # alternate from step 2, so the 8th is step 8's last.ckpt
    killed = {
        "full": _failed_run(full, cases["full"], {"rank": 0, "kind": "kill", "nth": 8, "after": 1024}),
        "sharded": _failed_run(sharded, cases["sharded"], {"rank": 1, "kind": "kill", "nth": 8, "after": 256}),
    }
    for name, (dead, alive) in {"full": (0, 1), "sharded": (1, 0)}.items():
        records = killed[name]
        fault, outcome = records[dead]["fault"], records[alive]["outcome"]
        assert TEMPORARY in fault["path"] and fault["written"] > 0  # the kill landed mid-write
        assert "outcome" not in records[dead]  # SIGKILL: nothing ran after it
        assert outcome["type"] == "CheckpointSaveError", outcome
        assert "could not save the checkpoint" in outcome["message"] and "last.ckpt" in outcome["message"]
        assert "The checkpoints saved before are intact" in outcome["message"]
        assert outcome["time"] - fault["time"] < STOPPED_WITHIN
        steps = _checkpoints(tmp_path / name / "run" / "checkpoints")
        assert steps["last.ckpt"] == 6, steps
        assert {steps[k] for k in steps if k != "last.ckpt"} == {2, 4, 6, 8}, steps
    consolidated = tmp_path / "consolidated.ckpt"
    assert main(["consolidate", str(sharded / "run" / "checkpoints" / "epoch=2-step=6.ckpt"), str(consolidated)]) == 0
    resumed_full = {**cases["full"], "resume": "last", "strategy": {**ONE_F_ONE_B, "gather_after_fit": True}}
    resumed_sharded = {**cases["sharded"], "resume": "last"}
    from_file = {k: v for k, v in cases["sharded"].items() if k != "checkpoint_every"}
    resume_cases = [  # each in its directory: the killed runs' own, where "last" is looked for
        {**resumed_full, "name": "full_last", "directory": full / "run"},
        {**resumed_sharded, "name": "sharded_last", "directory": sharded / "run"},
        {**cases["sharded"], "name": "whole", "directory": tmp_path / "whole"},
        {**from_file, "name": "same_split", "resume": str(consolidated), "directory": tmp_path / "same_split"},
        {**from_file, "name": "other_split", "resume": str(consolidated), "directory": tmp_path / "other_split"},
    ]
    resume_cases[-1]["strategy"] = {**TWO_BW_SHARDED, "balance": [4, 3]}
    results = _transpose(_run_rooted(resume_cases), resume_cases)
    expected = plain_fit(tmp_path / "plain", {**BASE, "name": "plain"})["final"]
    for rank in range(2):
        _assert_close_states(results["full_last"][rank]["final"], expected, 1e-5)
    whole = results["whole"][0]["final"]
    sharded_results = [results[name] for name in ("sharded_last", "same_split", "other_split")]
    for per_rank in sharded_results:
        for result in per_rank:
            _assert_close_states(result["final"], whole, 1e-6)
    _assert_after_fit(results["full_last"], results["whole"])


def _run_rooted(cases: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Cases trained one after the other in the same 2 processes, each in its ``directory``."""
    return run_local(_rooted_worker, 2, cases, timeout=300)


def _rooted_worker(rank: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [fit_case(rank, str(case["directory"]), case) for case in cases]


def _assert_after_fit(gathered: list[dict], kept: list[dict]) -> None:
    """``gather_after_fit=True``: every rank's module holds the whole trained model and runs; by
    default each holds only its stages, and calling the module says how to get the rest."""
    for result in gathered:
        assert result["after_fit"]["released"] == []
        assert isinstance(result["after_fit"]["output"], torch.Tensor)
    outputs = [result["after_fit"]["output"] for result in gathered]
    assert torch.equal(outputs[0], outputs[1])
    for result in kept:
        assert result["after_fit"]["released"], "each rank keeps only its stages by default"
        message = result["after_fit"]["output"]
        assert isinstance(message, str) and "trainer.save_checkpoint(path)" in message, message
        assert "gather_after_fit=True" in message


@contextlib.contextmanager
def _small_disk(directory: Path) -> Iterator[bool]:
    """``directory`` on a tmpfs of its own where this machine allows mounting one (yields ``True``),
    else an ordinary directory (``False``: the test injects the full disk instead)."""
    directory.mkdir(parents=True)
    command = ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(directory)]
    mounted = subprocess.run(command, capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_a_full_disk_leaves_the_previous_checkpoints(tmp_path: Path, state_dict_type: str) -> None:
    """The disk fills just before step 6's checkpoint is written (a real tmpfs, filled by a file at the
    end of step 6, where the machine allows mounting one; else a write that raises ``ENOSPC`` half-way,
    on the rank writing the most): every rank raises ``CheckpointSaveError`` naming the checkpoint and
    the full disk, within seconds of each other; the checkpoints of steps 2 and 4 are complete and no
    temporary is left."""
    strategy = {**ONE_F_ONE_B, "state_dict_type": state_dict_type}
    root = tmp_path / "disk"
    with _small_disk(root) as mounted:
        case = {**BASE, "name": "run", "strategy": strategy}
        fault = None
        if mounted:
            case["fill_disk_at"] = 6
        else:  # rank 0 opens one temporary per full save, rank 1 one per sharded save: the 5th is step 6's
            fault = {"rank": 0 if state_dict_type == "full" else 1, "kind": "full", "nth": 5, "after": 512}
        records = _failed_run(root, case, fault)
        outcomes = [records[rank].get("outcome") for rank in range(2)]
        assert all(o is not None and o["type"] == "CheckpointSaveError" for o in outcomes), records
        for outcome in outcomes:
            assert "could not save the checkpoint" in outcome["message"], outcome
            assert "epoch=2-step=6.ckpt" in outcome["message"], outcome
            assert "is full" in outcome["message"] or "No space left on device" in outcome["message"], outcome
        assert abs(outcomes[0]["time"] - outcomes[1]["time"]) < STOPPED_WITHIN
        (root / "run" / "ballast").unlink(missing_ok=True)
        steps = _checkpoints(root / "run" / "checkpoints")
    assert steps == {"epoch=0-step=2.ckpt": 2, "epoch=1-step=4.ckpt": 4, "last.ckpt": 4}, steps


def _refusal(rank: int, root: str, cases: list[dict[str, Any]]) -> list[str]:
    """Worker: each case's fit, which must fail at the resume: its error's type and message."""
    refusals = []
    for case in cases:
        try:
            fit_case(rank, str(Path(root) / case["name"]), case)
        except Exception as error:
            refusals.append(f"{type(error).__name__}: {error}")
        else:
            refusals.append("resumed")
    return refusals


@pytest.mark.timeout(300)
def test_a_resume_from_a_broken_checkpoint_says_which_and_why(tmp_path: Path) -> None:
    """A resume given a checkpoint cut short, another model's checkpoint, or a sharded directory whose
    save did not finish is refused before training, naming the file, what is wrong and, for a save
    that did not finish, the complete checkpoints beside it."""
    plain_fit(tmp_path / "plain", {**BASE, "trainer": {"max_epochs": 2}})
    checkpoints = tmp_path / "plain" / "checkpoints"
    whole = (checkpoints / "last.ckpt").read_bytes()
    (checkpoints / "last.ckpt").write_bytes(whole[: len(whole) // 3])
    other = tmp_path / "other.ckpt"
    plain_fit(tmp_path / "wider", {"batches": 2, "model": {"width": 16, "blocks": 4}, "save_after": str(other)})
    partial = tmp_path / "sharded" / "last.ckpt"
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    resume = {**BASE, "strategy": {"schedule": "1f1b"}}
    cases = [
        {**resume, "name": "cut", "resume": str(checkpoints / "last.ckpt")},
        {**resume, "name": "foreign", "resume": str(other)},
        {**resume, "name": "partial", "resume": str(partial)},
    ]
    cut, foreign, unfinished = run_local(_refusal, 1, str(tmp_path), cases, timeout=200)[0]
    assert cut.startswith(f"IncompleteCheckpoint: {checkpoints / 'last.ckpt'} is incomplete: its "), cut
    assert "newest first: epoch=1-step=4.ckpt (" in cut and "epoch=0-step=2.ckpt (" in cut, cut
    assert foreign.startswith(f"CheckpointError: {other} is not a checkpoint of this Chain: "), foreign
    assert "entries the module does not have: net.8.weight, net.8.bias" in foreign, foreign
    assert "net.0.weight (16, 6) (the module's: (8, 6))" in foreign, foreign
    assert unfinished.startswith(f"IncompleteCheckpoint: {partial} is incomplete: it has no meta.pt"), unfinished
    assert "There is no complete checkpoint beside it." in unfinished
