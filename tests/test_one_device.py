"""Every synchronous family with its stages on one device (``form="single"``,
``lightning_pipe/schedule/one_device.py``): one worker's program holding every action of the family's
schedule, each worker's order kept, valid, and what a one-device topology asks for; the runtime's
results are in ``tests/test_runtime_rules.py`` and the strategy's in ``tests/test_strategy.py``."""

from __future__ import annotations

import pytest

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule import FAMILIES, NON_FLUSHING_FAMILIES, Kind, make_schedule
from lightning_pipe.schedule.one_device import on_one_worker
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.strategy.topology import Topology

SYNCHRONOUS = [family for family in FAMILIES if family not in NON_FLUSHING_FAMILIES]
OPTIONS = {"1f1b_star": {"period": 3.0}, "kperiodic": {"k": 1}, "lpp": {"groups": 1}, "fslpp": {"groups": 1}}


@pytest.mark.parametrize("family", SYNCHRONOUS)
@pytest.mark.parametrize(("stages", "microbatches", "steps"), [(2, 2, 1), (4, 4, 2), (4, 6, 3), (3, 5, 2)])
def test_one_worker_runs_every_action_in_each_workers_order(
    family: str, stages: int, microbatches: int, steps: int
) -> None:
    options = {**OPTIONS.get(family, {}), **({"workers": 1} if family in ("ddp", "fsdp") else {})}
    if family in ("interleaved", "looped_bfs") and stages % 2:  # stages over 2 workers, or all on 1
        options["virtual_stages"] = stages
    if family in ("lpp", "fslpp") and stages % 2:
        options["replicas"] = 1
    spread = make_schedule(family, stages, microbatches, steps, **options)
    single = make_schedule(family, stages, microbatches, steps, form="single", **options)
    assert single.workers == 1 and single.owners == ((0,),) * stages
    (order,) = single.orders
    assert sorted(map(str, order)) == sorted(str(a) for _, _, a in spread.actions())  # versions included
    position = {action.key: i for i, action in enumerate(order) if action.kind is not Kind.UPDATE}
    for worker_order in spread.orders:
        computed = [position[a.key] for a in worker_order if a.kind is not Kind.UPDATE]
        assert computed == sorted(computed)  # each worker's order kept
    assert (single.rule, single.flush, single.steps) == (spread.rule, spread.flush, spread.steps)


def test_the_last_stage_computes_as_soon_as_its_input_is_ready() -> None:
    """1F1B on one device: a micro-batch's backward starts at the last stage right after its forward
    there (the dependency order of the programs), so stage 3's F0 is followed by its B0."""
    (order,) = make_schedule("1f1b", 4, 4, 1, form="single").orders
    text = [str(a) for a in order]
    assert text[text.index("3F0v0") + 1] == "3B0v0"
    assert text[-1].endswith("UPDATE")


def test_what_cannot_go_on_one_worker_is_refused() -> None:
    with pytest.raises(PlanningError, match=r"^2bw has no single-device form"):
        make_schedule("2bw", 2, 2, 1, form="single")
    with pytest.raises(PlanningError, match=r"^1f1b_rr cannot put its stages on one device: its stages are replicated"):
        make_schedule("1f1b_rr", 2, 2, 1, form="single", stage_replicas=[2, 1])
    ringed = make_schedule("cdp", 2, 2, 1, form="dp")
    assert ringed.rings
    with pytest.raises(PlanningError, match="cannot put its stages on one device"):
        on_one_worker(ringed)
    one = make_schedule("1f1b", 1, 2, 1)
    assert on_one_worker(one) is one


@pytest.mark.parametrize("family", ["gpipe", "1f1b", "zb_h1", "interleaved"])
def test_a_one_device_topology(family: str) -> None:
    """``form="single"`` on one device: one worker whatever the stages; the stages are the
    micro-batches when not given; on two devices, two copies of the pipeline."""
    options = ScheduleOptions(family, form="single", microbatches=3)
    assert options.one_device and options.any_stage_count and options.workers_for(5) == 1
    assert options.stages_for(1) == 3
    on_one = Topology.of(options, 1, 0, stages=4)
    assert (on_one.workers, on_one.data_parallel, on_one.stages) == (1, 1, 4)
    on_two = Topology.of(options, 2, 1)
    assert (on_two.workers, on_two.data_parallel, on_two.stages, on_two.worker) == (1, 2, 3, 0)
    with pytest.raises(PlanningError, match=r"^form='single' runs every stage on one device: give stages="):
        ScheduleOptions(family, form="single").stages_for(1)
