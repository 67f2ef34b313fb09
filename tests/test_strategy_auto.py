"""``PipelineStrategy(schedule="auto")``: the strategy chooses its pipeline with the search, runs it as
if given, keeps within the memory limit, and a switch after calibration carries the weights and the
optimizer state exactly (a synchronous run that switches ends as plain Lightning)."""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineStrategy
from lightning_pipe.auto import FLUSHING_FAMILIES
from lightning_pipe.cost.calibrated import Calibration
from lightning_pipe.errors import PlanningError
from lightning_pipe.runtime import run_local
from lightning_pipe.schedule import StageCosts
from lightning_pipe.strategy.calibrating import CALIBRATE_AFTER
from lightning_pipe.strategy.choosing import DEFAULT_MICROBATCHES, AutoOptions, Chosen
from lightning_pipe.strategy.trials import (
    CONFIRM_WITHIN,
    MAX_TRIAL_STEPS,
    PIN_STEPS,
    SETTLED_BY,
    TRIAL_STEPS,
    WARM_UP,
    Trial,
    Trials,
    trial_steps,
)
from tests.lightning_cases import Chain, Placements, final_state, loader, placements, plain_fit, trainer
from tests.user_modules import GPTModule

BATCHES = SETTLED_BY + WARM_UP + 1
"""Batches of a fit's data: as many as any fit may take to settle, and a few more. Each fit ends
:data:`WARM_UP` steps after it settled (:class:`_UntilSettled`)."""


class _UntilSettled(L.Callback):
    """Ends the fit :data:`WARM_UP` steps after the strategy settled on its configuration (every rank
    at the same step: the decisions are broadcast), and counts the steps run."""

    def __init__(self) -> None:
        self.steps = 0
        self.stop_at: int | None = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps += 1
        if self.stop_at is None and trainer.strategy.settled:
            self.stop_at = self.steps + WARM_UP
        if self.stop_at is not None and self.steps >= self.stop_at:
            trainer.should_stop = True


class _Switching(PipelineStrategy):
    """Tries at the calibration the best two two-stage 1F1B or GPipe configurations whose splits
    differ from the running one's and each other's, whatever the prediction says (then goes on with
    the fastest of the three as measured)."""

    def _to_try(self, compute: StageCosts, in_run: StageCosts, since: int) -> Any:
        super()._to_try(compute, in_run, since)
        self.before = self.stage_plan.bounds
        others = [
            c
            for c in self.candidates
            if c.family in ("1f1b", "gpipe") and len(c.bounds) == 2 and c.bounds != self.stage_plan.bounds
        ]
        picked = [others[0], next(c for c in others if c.bounds != others[0].bounds)]
        self.tried = [c.bounds for c in picked]
        return [Trial(c.stage_plan, Chosen.of(c, self.schedule_options), c.label) for c in picked]

    def _to_try_next(self, trials: Trials) -> list[Trial]:
        """Priced again after each trial as any run is, the forced trials kept."""
        self.repriced = [t.label for t in super()._to_try_next(trials)]
        return trials.waiting


def _worker(rank: int, root: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    os.environ["LOCAL_RANK"] = str(rank)
    found = []
    for case in cases:
        model = Chain()
        kind = _Switching if case.get("switch") else PipelineStrategy
        strategy = kind(schedule="auto", profile_cache=False, **case.get("strategy", {}))
        placed, until = Placements(), _UntilSettled()
        run = trainer(Path(root) / case["name"], strategy, 2, callbacks=[placed, until])
        run.fit(model, loader(BATCHES))
        measured = None if strategy.trials is None else strategy.trials.measured
        found.append(
            {
                "final": final_state(run, model),
                "family": strategy.schedule_options.family,
                "rule": strategy.schedule_options.rule,
                "microbatches": strategy.microbatches,
                "bounds": strategy.stage_plan.bounds,
                "before": getattr(strategy, "before", None),
                "tried": getattr(strategy, "tried", None),
                "repriced": getattr(strategy, "repriced", None),
                "trials": None if measured is None else [t.seconds for t in measured],
                "trial_bounds": None if measured is None else [t.stage_plan.bounds for t in measured],
                "settled_step": strategy.settled_step,
                "steps": until.steps,
                "planned": strategy.planned_step_seconds,
                "priced_as_run": _priced_as_run(strategy),
                "own_trial": _own_trial(strategy),
                "predicted_memory": strategy.predicted_memory,
                "ranked": [(c.step_seconds, c.family, c.peak_memory_bytes) for c in strategy.candidates],
                "pinned": None if strategy._pin_trial is None else strategy._pin_trial.pinned,
                "pin_trial": None
                if (pin := strategy._pin_trial) is None
                else (pin.unpinned, pin.steps, pin.unpinned_steps),
                "cores": placed.during,
                "cores_after": placements(),
                "gloo_threads": _gloo_threads(),
            }
        )
    return found


def _priced_as_run(strategy: PipelineStrategy) -> float | None:
    """Rank 0: the step of the configuration the fit ended on, priced with the run's calibration."""
    if strategy.calibration is None:
        return None
    prices = dataclasses.replace(strategy.step_prices, kept=strategy.calibration)
    recompute = strategy.recompute
    return prices.predict(strategy.stage_plan, strategy.options, strategy.microbatches, 1.0, recompute)[1]


def _own_trial(strategy: PipelineStrategy) -> tuple[float, Calibration | None] | None:
    """Rank 0: the last trial of the split the fit ended on (the trials' splits all differ): its
    median step and what its steps measured beyond the profile."""
    measured = [] if strategy.trials is None else strategy.trials.measured
    ran = [t for t in measured if t.stage_plan.bounds == strategy.stage_plan.bounds]
    return (ran[-1].seconds, ran[-1].calibration) if ran else None


def _gloo_threads() -> int:
    """This process's gloo threads, once what the fits before left unreachable is collected."""
    gc.collect()
    names = [Path(task, "comm").read_text() for task in Path("/proc/self/task").iterdir()]
    return sum("gloo" in name for name in names)


@pytest.mark.timeout(300)
def test_auto_runs_the_winner_as_plain_lightning_and_a_switch_carries_the_state(tmp_path: Path) -> None:
    """Three runs on 2 processes: ``schedule="auto"`` (a flushing family, the ranking sorted, the
    result plain Lightning's); the same within a memory limit that the whole model does not fit (a
    two-stage pipeline within it); and a run made to try two other splits and schedules after
    calibration, one after the other, and go on with the fastest of the three as measured: it ends
    with plain Lightning's parameters too (weights and momentum carried by name, through two
    switches or three);
    and ``pin_cpus="auto"``, whose trial leaves every rank pinned or every rank unpinned. The fits run
    one after the other in the same processes, and none keeps the process groups of the ones before."""
    limit = 2600
    cases = [
        {"name": "auto"},
        {"name": "limit", "strategy": {"memory_limit": limit, "shared_memory_bytes": 0}},
        {"name": "switch", "switch": True, "strategy": {"microbatches": [2]}},
        {"name": "pin", "strategy": {"pin_cpus": "auto"}},
    ]
    results = run_local(_worker, 2, str(tmp_path), cases, timeout=240)
    for index, case in enumerate(cases):
        steps = results[0][index]["steps"]  # ended once settled: as many steps of plain Lightning
        said = {key: results[0][index][key] for key in ("steps", "settled_step", "trials", "family", "microbatches")}
        assert results[1][index]["steps"] == steps < BATCHES, (case["name"], said)
        plain = {"batches": BATCHES, "trainer": {"max_steps": steps}}
        expected = plain_fit(tmp_path / f"plain_{case['name']}", plain)["final"]
        for rank in range(2):
            got = results[rank][index]
            for name, value in expected.items():
                assert torch.allclose(got["final"][name], value, atol=1e-5, rtol=0), (case["name"], name)
        chosen = results[0][index]
        assert chosen["family"] in FLUSHING_FAMILIES and chosen["rule"] is None
        assert results[1][index]["ranked"] == []  # only rank 0 searches
    ranked = results[0][0]["ranked"]
    assert ranked and [r[0] for r in ranked] == sorted(r[0] for r in ranked)
    assert results[0][0]["microbatches"] in DEFAULT_MICROBATCHES
    within = results[0][1]
    assert within["family"] not in ("ddp", "1f1b_rr")  # each worker would hold the whole model
    assert all(r["predicted_memory"] <= limit for r in (results[0][1], results[1][1]))
    assert all(peak <= limit for _, _, peak in within["ranked"])
    switched = results[0][2]  # two tried (the closest two again), the fastest measured run on: exact whichever
    seconds, bounds = switched["trials"], switched["trial_bounds"]
    splits = [switched["before"], *switched["tried"]]
    assert bounds[:3] == splits and switched["before"] not in switched["tried"]
    first = sorted(range(3), key=seconds.__getitem__)
    if seconds[first[1]] <= seconds[first[0]] * (1 + CONFIRM_WITHIN):  # measured again, the later first
        assert bounds[3:] == [splits[i] for i in sorted(first[:2], reverse=True)]
    else:
        assert len(seconds) == 3
    means = {b: statistics.fmean(t for t, c in zip(seconds, bounds, strict=True) if c == b) for b in splits}
    assert switched["bounds"] == min(means, key=means.__getitem__)
    assert switched["microbatches"] == 2
    assert switched["repriced"] is not None and results[1][2]["repriced"] is None  # rank 0 priced after each trial
    seconds, own = switched["own_trial"]
    if own is None:  # the first configuration, measured once: priced with the run's calibration
        assert switched["planned"] == pytest.approx(switched["priced_as_run"], rel=1e-9)
    else:  # priced with what its own trial measured: that trial's median, unless the simulation alone is longer
        assert switched["planned"] >= seconds * (1 - 1e-9)
        if own.per_step > 0:
            assert switched["planned"] == pytest.approx(seconds, rel=1e-9)
    assert CALIBRATE_AFTER + WARM_UP + TRIAL_STEPS < switched["settled_step"] < BATCHES  # the second tried or later
    assert all(results[0][index]["settled_step"] <= SETTLED_BY for index in range(len(cases)))  # the bound holds
    for rank in range(2):  # fit after fit, the groups of the fits before are closed and collected: no growth
        threads = [found["gloo_threads"] for found in results[rank]]
        assert len(set(threads[1:])) == 1, threads
    pinned = {results[rank][3]["pinned"] for rank in range(2)}
    assert len(pinned) == 1 and pinned <= {True, False}  # rank 0's measurement decides for all
    unpinned, steps, before = results[0][3]["pin_trial"]  # each side a quarter second at its pace, on every rank
    assert results[1][3]["pin_trial"] == (unpinned, steps, before)
    assert steps == max(PIN_STEPS, trial_steps(unpinned) + 1)
    assert TRIAL_STEPS <= before <= MAX_TRIAL_STEPS
    every = [tuple(sorted(os.sched_getaffinity(0)))]
    for rank in range(2):
        cores = results[rank][3]["cores"]
        assert (cores != every) if pinned == {True} else (cores == every)
        assert results[rank][3]["cores_after"] == every  # after fit, back on every core


def test_auto_options_search_what_is_left_open_and_refuse_bad_values() -> None:
    auto, start = AutoOptions.of("auto", None, None, None)
    assert auto is not None and auto.families is None and auto.rule is None and auto.recompute is None
    assert auto.microbatches == DEFAULT_MICROBATCHES and start.family == "1f1b"
    fixed, start = AutoOptions.of("2bw", "auto", None, False)
    assert fixed is not None and fixed.families == ("2bw",) and fixed.rule == "2bw" and fixed.recompute is False
    assert start.family == "2bw"
    counts, _ = AutoOptions.of("1f1b", [4, 2, 4], None, "auto")
    assert counts is not None and counts.microbatches == (4, 2) and counts.recompute is None
    assert AutoOptions.of("1f1b", 4, None, True)[0] is None
    with pytest.raises(PlanningError, match="'kperiodic' is not searched"):
        AutoOptions.of("kperiodic", "auto", None, None)
    with pytest.raises(PlanningError, match="no update rule"):
        AutoOptions.of("auto", None, "fastest", None)
    with pytest.raises(PlanningError, match="rule='delayed' lets schedule='auto' choose"):
        AutoOptions.of("1f1b", None, "delayed", None)
    with pytest.raises(PlanningError, match="recompute must be True, False or 'auto'"):
        AutoOptions.of("auto", None, None, "yes")
    with pytest.raises(PlanningError, match="a whole number, a list of them or 'auto'"):
        AutoOptions.of("auto", "many", None, None)
    delayed, _ = AutoOptions.of("auto", None, "delayed", None)
    assert delayed is not None and delayed.flushing_only("accumulate_grad_batches=2").rule is None
    only_2bw, _ = AutoOptions.of("2bw", "auto", None, None)
    with pytest.raises(PlanningError, match="2bw cannot run with accumulate_grad_batches=2"):
        only_2bw.flushing_only("accumulate_grad_batches=2")
    with pytest.raises(PlanningError, match="recompute must be"):
        PipelineStrategy(schedule="auto", recompute=1)
    assert PipelineStrategy(schedule="auto").schedule_options.family == "1f1b"


class _Retrying(PipelineStrategy):
    """Tries at the calibration the best other split or micro-batch count of its family, whatever
    the prediction says."""

    def _to_try(self, compute: StageCosts, in_run: StageCosts, since: int) -> Any:
        super()._to_try(compute, in_run, since)
        other = next(c for c in self.candidates if not self._runs(c))
        return [Trial(other.stage_plan, Chosen.of(other, self.schedule_options), other.label)]


def _tied_worker(rank: int, root: str) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (8 * BATCHES, 17), generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    strategy = _Retrying(
        "cdp", microbatches=[2, 4], pin_cpus="auto", profile_cache=False, timeout=timedelta(seconds=60)
    )
    trainer(Path(root), strategy, 2, callbacks=[_UntilSettled()]).fit(GPTModule(), data)
    measured = strategy.trials.measured
    return {
        "trials": [t.seconds for t in measured],
        "labels": [(t.label, t.stage_plan.bounds) for t in measured],
        "pinned": strategy._pin_trial.pinned,
    }


@pytest.mark.timeout(300)
def test_decisions_between_steps_of_a_delayed_schedule_with_tied_weights_do_not_deadlock(tmp_path: Path) -> None:
    """A GPT whose embedding and head share their weight, run as 2BW: each decision (the pinning
    trial, the calibration, a trial judged) is a collective between steps, while a rank may still owe
    the tied weight's gradient sum of a step in flight; the pipeline is drained first, so every rank
    gets there (this hung until the gloo timeout before the drain)."""
    results = run_local(_tied_worker, 2, str(tmp_path), timeout=240)
    for found in results:
        seconds, labels = found["trials"], found["labels"]
        assert all(s > 0 for s in seconds)
        close = max(seconds[:2]) <= min(seconds[:2]) * (1 + CONFIRM_WITHIN)  # then both measured again, reversed
        assert labels == (labels[:2] + labels[:2][::-1] if close else labels[:2]) and len(labels) == 2 + 2 * close
        assert found["pinned"] in (True, False)
