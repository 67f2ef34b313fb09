"""What a fit keeps (``measured_calibration``): a calibration that predicts the running configuration
at its measured step, whatever the stages' rates measured."""

from __future__ import annotations

import math

from hypothesis import example, given, settings
from hypothesis import strategies as st

from lightning_pipe.cost.calibrated import Calibration, separated
from lightning_pipe.planning import predict
from lightning_pipe.schedule import StageCosts
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.strategy.step_prices import RATE_STEPS, Predicted, StepPrices, measured_calibration
from tests.stage_plans import one_layer_per_stage


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(1e-3, 1.0), st.floats(1e-3, 1.0), st.floats(0.5, 2.5)), min_size=2, max_size=3),
    st.floats(0.0, 0.05),
    st.floats(0.3, 2.0),
    st.sampled_from(["gpipe", "1f1b", "2bw", "cdp"]),
    st.integers(2, 6),
)
@example([(0.1, 0.2, 1.0), (0.1, 0.2, 1.5)], 1e-4, 1.5, "1f1b", 2)  # room beyond the actions
@example([(0.1, 0.2, 1.0), (0.1, 0.2, 1.5)], 1e-4, 0.5, "1f1b", 2)  # the rate brought down
@example([(1e-3, 1e-3, 1.0), (1e-3, 1e-3, 1.0)], 0.02, 0.3, "gpipe", 4)  # the executor's own time alone is longer
def test_the_running_configuration_is_predicted_at_its_measured_step(
    stages: list[tuple[float, float, float]], own: float, share: float, family: str, m: int
) -> None:
    """Each stage's actions measured at a rate of its own, the executor's own time ``own`` after each,
    and a step ``share`` × the one the measured actions predict: the calibration kept predicts the
    running configuration at that step (to 1e-5), unless even actions of no time simulate a longer
    one (then it predicts that floor); its rate is the measured one where the actions' predicted step
    leaves room (time beyond them is added), else the one that predicts the measured step."""
    forward, backward, rates = (list(column) for column in zip(*stages, strict=True))
    plan = one_layer_per_stage(forward, backward)
    options = ScheduleOptions(family=family, microbatches=m).on_workers(len(stages))
    profiled = [*forward, *backward]
    compute = StageCosts(
        forward=[r * f for r, f in zip(rates, forward, strict=True)],
        backward=[r * b for r, b in zip(rates, backward, strict=True)],
    )
    until_next = StageCosts(forward=[f + own for f in compute.forward], backward=[b + own for b in compute.backward])
    scale, fixed = separated(
        profiled, [*compute.forward, *compute.backward], [*until_next.forward, *until_next.backward]
    )

    def shortest(rate: float) -> float:  # predicted at ``rate``, nothing beyond the actions
        simulation = predict(plan, options, m, 1.0, False, fixed, None, rate)
        assert simulation is not None
        return Calibration(rate, fixed, 0.0).seconds(Predicted.of(simulation))

    step = share * shortest(scale)
    steps = [step * 0.9, step, step * 1.3]  # their median is the step
    found = measured_calibration(
        StepPrices(), plan, options, m, False, profiled, compute, until_next, steps, "measured on the test"
    )
    assert found.fixed == fixed and found.measured_on == "measured on the test"
    simulation = predict(plan, options, m, 1.0, False, found.fixed, None, found.scale)
    assert simulation is not None
    predicted = found.seconds(Predicted.of(simulation))
    floor = shortest(scale * 2.0**-RATE_STEPS)  # the slowest rate searched
    if share >= 1:  # room for time beyond the actions: the rate is the one measured
        assert found.scale == scale and math.isclose(predicted, step, rel_tol=1e-9)
    elif floor <= step:
        assert found.scale < scale and found.per_step == 0
        assert math.isclose(predicted, step, rel_tol=1e-5)
    else:
        assert found.per_step == 0 and math.isclose(predicted, floor, rel_tol=1e-9)
