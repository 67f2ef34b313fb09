"""The set-up prediction priced beyond the layer profile, and the calibration a fit keeps for the next.

The printed prediction and ``schedule="auto"``'s ranking simulate each configuration's actions from
the layer profile. Two things a step costs are not in it:

- **the update**: each stage's optimizer step, priced from its parameters at the rate the user's
  optimizer measured on the device (:mod:`lightning_pipe.cost.update_rate`);
- **what the run adds**: the executor's own time per action, the steps' time outside their actions
  (Lightning's loop, the log relay), the profile's rate against the run's. A fit measures them over
  its settled steps and keeps them beside the profile (:mod:`lightning_pipe.cost.calibrated`); the
  next fit of the same model on the same machine predicts with them, and says so. A model's first fit
  has none of its own: its actions are priced at the rate earlier fits of other models measured on the
  machine with a schedule of the same kind (:mod:`lightning_pipe.cost.machine_rate`), and each of its
  steps with the training loop's own time earlier fits of any model measured
  (:mod:`lightning_pipe.cost.loop_time`).

:class:`StepPrices` holds both for a fit (rank 0); :func:`measured_calibration` is what a fit keeps.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from lightning_pipe.cost.calibrated import (
    REPLICATING_FAMILIES,
    Calibration,
    KeptFits,
    RunShape,
    keep_calibration,
    kept_fits,
    separated,
)
from lightning_pipe.cost.loop_time import kept_loop_seconds
from lightning_pipe.cost.machine_rate import MachineRates, kept_rates
from lightning_pipe.cost.profile_cache import model_key, profile_key
from lightning_pipe.cost.update_rate import UpdatePrices, update_rate
from lightning_pipe.planning import StagePlan, predict
from lightning_pipe.schedule import StageCosts
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.schedule.simulation import Simulation
from lightning_pipe.util.units import format_seconds

__all__ = ["LOOP_MEASURED_ON", "Predicted", "StepPrices", "actions", "measured_calibration", "run_shape"]

LOOP_MEASURED_ON = "the training loop's own time, as earlier fits on this machine measured it"


def run_shape(family: str, batch_rows: int, microbatches: int, pinned: bool | None) -> RunShape:
    """``family`` on micro-batches of ``batch_rows`` cut into ``microbatches`` (the largest's rows),
    its threads ``pinned`` or not (``None``: not known yet)."""
    return RunShape(family, -(-batch_rows // microbatches), pinned)


def actions(costs: StageCosts) -> list[float]:
    """Each stage's forward seconds, then backward, as the calibrations list them."""
    return [*costs.forward, *costs.backward]


@dataclass(frozen=True)
class Predicted:
    """A simulation's figures as :meth:`Calibration.seconds <lightning_pipe.cost.calibrated.Calibration.seconds>`
    reads them."""

    step_seconds: float
    busiest_seconds: float
    flushes: bool

    @classmethod
    def of(cls, simulation: Simulation) -> Predicted:
        schedule = simulation.schedule
        return cls(simulation.steady_step, max(simulation.busy) / schedule.steps, schedule.flush)


@dataclass(frozen=True)
class StepPrices:
    """What rank 0 prices beyond the layer profile in this fit: ``update`` (each stage's optimizer
    step, ``None``: not priced), ``kept`` (the calibration an earlier fit kept under ``key`` in
    ``directory``, ``None``: none), ``bandwidth`` (the links measured among the ranks, which the
    prediction prices messages and all-reduces at where the plan was made without them; ``None``:
    the plan's), the share of an all-reduce measured beside the compute among the ranks
    (``reduce_overlap``, ``StageCosts.reduce_overlap``: a calibration kept from a replicating family
    carries its all-reduces already, :meth:`Calibration.reduce_overlap`), the rows of the fit's
    batches (``batch_rows``: the micro-batch size of what it keeps), and the model's key however it is
    cut into layers (``model``: where nothing is kept under ``key``, the calibrations of its other
    cuts price the fit, :func:`~lightning_pipe.cost.calibrated.other_cuts`), every fit kept
    (``fits``, read once at set-up: ``kept`` and :meth:`closest` price from them), and the training
    loop's own time per step that earlier fits on the machine kept (``loop``: a calibration of that
    alone, which prices a configuration with no calibration of the model kept;
    :func:`~lightning_pipe.cost.loop_time.kept_loop_seconds`), the rates of the actions earlier fits
    of any model kept on the machine (``rates``, :mod:`~lightning_pipe.cost.machine_rate`), and what
    prices this fit from them where nothing of the model is kept (``prior``: :meth:`prior_for` the
    fit's family)."""

    update: UpdatePrices | None = None
    kept: Calibration | None = None
    directory: Path | None = None
    key: str = ""
    bandwidth: float | None = None
    batch_rows: int = 0
    reduce_overlap: float = 1.0
    model: str | None = None
    fits: KeptFits = field(default_factory=KeptFits)
    loop: Calibration | None = None
    rates: MachineRates = field(default_factory=MachineRates)
    prior: Calibration | None = None

    @classmethod
    def of(
        cls,
        layers: Sequence[nn.Module],
        names: Sequence[str] | None,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        directory: Path | None,
        shape: RunShape | None,
        batch_rows: int,
        bandwidth: float | None = None,
        reduce_overlap: float = 1.0,
        processes: int = 1,
        microbatches: int = 1,
    ) -> StepPrices:
        """The prices of ``layers`` trained with ``optimizer`` on ``device``, the calibration kept in
        ``directory`` (the profile cache; ``None``: nothing kept or read) closest to ``shape`` (the last
        kept, for ``None``), the rows of the fit's batches, the links measured, and the loop's time and
        the rates kept for fits on ``processes`` processes of the device's kind: where nothing of the
        model is kept, the :attr:`prior` of ``shape`` on ``microbatches`` micro-batches."""
        floating = [p.dtype for layer in layers for p in layer.parameters() if p.is_floating_point()]
        rate = update_rate(optimizer, device, floating[0]) if floating else None
        key, model = profile_key(layers, names, (), device, 0), model_key(layers, device)
        fits = KeptFits() if directory is None else kept_fits(directory, key, model)
        loop = None if directory is None else kept_loop_seconds(directory, device, processes)
        prices = cls(
            UpdatePrices.of(rate, layers),
            fits.closest(shape),
            directory,
            key,
            bandwidth,
            batch_rows,
            reduce_overlap,
            model,
            fits,
            None if loop is None else Calibration(1.0, 0.0, loop, LOOP_MEASURED_ON),
            MachineRates() if directory is None else kept_rates(directory, device, processes),
        )
        if prices.kept is not None or shape is None:
            return prices
        return replace(prices, prior=prices.prior_for(shape.family, microbatches, shape.pinned))

    def closest(self, family: str, microbatches: int, pinned: bool | None) -> Calibration | None:
        """The calibration kept closest to ``family`` on ``microbatches`` micro-batches, ``pinned`` or
        not, among what earlier fits kept (read once, when the fit set up: ``fits``)."""
        return self.fits.closest(run_shape(family, self.batch_rows, microbatches, pinned))

    def prior_for(self, family: str, microbatches: int, pinned: bool | None) -> Calibration | None:
        """What prices a fit of ``family`` on ``microbatches`` micro-batches (its threads ``pinned`` or
        not; ``None``: not known yet) of this model, with no calibration of its own: the rate of the
        actions and the time between them that fits of other models of the same kind of schedule
        measured on the machine (:meth:`~lightning_pipe.cost.machine_rate.MachineRates.closest`), and
        each step the loop's time; ``None`` where no such fit is kept."""
        found = self.rates.closest(family, microbatches, pinned, self.model)
        if found is None or self.loop is None:
            return found
        said = f"{found.measured_on}; the time beyond them: {self.loop.measured_on}"
        return replace(found, per_step=self.loop.per_step, measured_on=said)

    @property
    def priced_with(self) -> Calibration | None:
        """What prices the actions beyond the profile: the model's kept calibration, else the
        :attr:`prior` of other models' fits (``None``: neither; the profile then, with the contention)."""
        return self.kept if self.kept is not None else self.prior

    @property
    def beyond(self) -> Calibration | None:
        """What prices a step beyond its simulated actions: :attr:`priced_with`, else the loop's time
        earlier fits on the machine kept (``None``: neither)."""
        return self.priced_with or self.loop

    @property
    def scale(self) -> float:
        return 1.0 if self.priced_with is None else self.priced_with.scale

    @property
    def fixed(self) -> float:
        return 0.0 if self.priced_with is None else self.priced_with.fixed

    def updates(self, stage_plan: StagePlan) -> list[float] | None:
        """Each stage's update seconds in ``stage_plan``."""
        return None if self.update is None else self.update.stages(stage_plan.bounds)

    def predict(
        self,
        stage_plan: StagePlan,
        options: ScheduleOptions,
        microbatches: int,
        contention: float,
        recompute: bool | Sequence[bool],
    ) -> tuple[Simulation | None, float | None]:
        """The simulation of ``stage_plan`` run with ``options`` and its predicted step: the profile's
        actions with the updates, and, with a calibration (:attr:`priced_with`), its rate, fixed cost
        per action and time beyond the actions (the contention is in the calibration then: it was
        measured running)."""
        calibrated = self.priced_with
        simulation = predict(
            stage_plan,
            options,
            microbatches,
            contention if calibrated is None else 1.0,
            recompute,
            self.fixed,
            self.updates(stage_plan),
            self.scale,
            self.bandwidth,
            Calibration.reduce_overlap(calibrated, self.reduce_overlap),
        )
        if simulation is None:
            return None, None
        if self.beyond is None:
            return simulation, simulation.steady_step
        return simulation, self.beyond.seconds(Predicted.of(simulation))

    def said(self) -> str:
        """What the prediction priced beyond the profile, for the set-up report."""
        update = (
            "each stage's update at the rate the optimizer measured"
            if self.update is not None
            else "no update (the optimizer could not be timed)"
        )
        if self.kept is None and self.prior is not None:
            return (
                f"Predicted with the layer profile, {update}, and what fits of other models measured: {self.prior}; "
                "no run of this model kept its calibration yet"
            )
        if self.kept is None and self.loop is not None:
            return (
                f"Predicted with the layer profile, {update}, and each step {format_seconds(self.loop.per_step)} of "
                f"{self.loop.measured_on}; no run of this model kept its calibration yet"
            )
        if self.kept is None:
            return f"Predicted with the layer profile and {update}; no run of this model kept its calibration yet"
        return f"Predicted with the layer profile, {update}, and what an earlier run measured: {self.kept}"

    def keep(self, family: str, microbatches: int, pinned: bool, found: Calibration) -> Path | None:
        """Keep ``found``, measured running ``family`` on ``microbatches`` micro-batches with its
        threads ``pinned`` or not, for the next fit of this model
        (:func:`~lightning_pipe.cost.calibrated.keep_calibration`)."""
        shape = run_shape(family, self.batch_rows, microbatches, pinned)
        return keep_calibration(self.directory, self.key, shape, found, self.model)


def measured_calibration(
    prices: StepPrices,
    stage_plan: StagePlan,
    options: ScheduleOptions,
    microbatches: int,
    recompute: bool | Sequence[bool],
    profiled: Sequence[float],
    compute: StageCosts,
    until_next: StageCosts,
    step_seconds: Sequence[float],
    measured_on: str,
) -> Calibration:
    """What a fit measured beyond the profile, such that the running configuration is predicted at
    its measured step (the median of ``step_seconds``): the actions' ``compute`` seconds and the time
    until the next action (``until_next``: the executor's own time included) against their
    ``profiled`` ones (each stage's forward, then backward) give the rate and the fixed cost per action
    (:func:`~lightning_pipe.cost.calibrated.separated`); the time beyond the actions is what the
    median leaves over ``stage_plan`` simulated with them (and ``prices``' updates and links).

    Where the actions as measured predict a longer step than the run's, with nothing beyond them,
    their rate is brought down to the one that predicts the run's step (:func:`_rate_for`), and no
    time beyond the actions is kept (a flushing family priced with it would add all of it): one rate
    for every stage prices the stage that bounds the step at the stages' mean, and a run whose
    stages' rates differ then predicts its own step long (torchvision's ResNet-18: a 2BW fit on 8
    micro-batches kept its actions at 1.79x the profile, and the next fits on 8 micro-batches ran
    10-18% shorter than predicted, ``bench/auto_plan.py --pairs 8``, 2026-11-30)."""
    replicating = options.family in REPLICATING_FAMILIES
    scale, fixed = separated(profiled, actions(compute), actions(until_next))
    median = statistics.median(step_seconds)

    def simulated(rate: float) -> Predicted:
        fitted = replace(prices, kept=Calibration(rate, fixed, 0.0, replicating=replicating))
        simulation, _ = fitted.predict(stage_plan, options, microbatches, 1.0, recompute)
        assert simulation is not None
        return Predicted.of(simulation)

    def shortest(rate: float, running: Predicted | None = None) -> float:
        """The step predicted at ``rate`` with nothing beyond the actions (``running``: simulated at it)."""
        return Calibration(rate, fixed, 0.0).seconds(running or simulated(rate))

    running = simulated(scale)
    if shortest(scale, running) > median:  # nothing measured beyond the actions: none is priced
        return Calibration(_rate_for(shortest, median, scale), fixed, 0.0, measured_on, replicating)
    return Calibration.fitted(scale, fixed, running, median, measured_on, replicating)


RATE_STEPS = 20
"""Halvings of the interval :func:`_rate_for` searches: the rate to within 1e-6 of the one measured."""


def _rate_for(step_at: Callable[[float], float], step: float, measured: float) -> float:
    """The rate at most ``measured`` at which ``step_at`` (a simulated step, increasing with the rate)
    comes to ``step``, or just under it, by bisection; the smallest searched where even that comes out
    longer (a step of fixed costs and updates alone)."""
    low, high = measured * 2.0**-RATE_STEPS, measured
    if step_at(low) > step:
        return low
    for _ in range(RATE_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if step_at(middle) <= step else (low, middle)
    return low
