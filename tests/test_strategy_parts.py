"""The strategy's pure parts: combining micro-batch logs, the relay, the model contract on torchvision
models."""

from __future__ import annotations

import inspect
import math
import pickle
import time
from dataclasses import replace

import lightning.pytorch as L
import pytest
import torch
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.cost.memory import MemoryModel
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PlanningError
from lightning_pipe.partition import PlanRequest, partition
from lightning_pipe.planning import PREDICTED_STEPS, PlanOptions, StagePlan, plan_stages, predict
from lightning_pipe.runtime import run_local
from lightning_pipe.schedule import StageCosts, make_schedule, simulate
from lightning_pipe.schedule.options import ScheduleOptions
from lightning_pipe.strategy.contract import Call, pipeline_model
from lightning_pipe.strategy.log_relay import RING_BYTES, LogRelay, SharedMemoryRelay, open_log_relay
from lightning_pipe.strategy.logs import Record, combine, recording
from lightning_pipe.strategy.topology import Topology
from lightning_pipe.tables import placement_table
from lightning_pipe.zoo.models import chain_from_model, torchvision_model


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.floats(-100, 100), min_size=1, max_size=9), min_size=1, max_size=8))
def test_combined_means_equal_the_whole_batch(microbatches: list[list[float]]) -> None:
    """Per-sample values split into micro-batches: the combined mean is the whole batch's mean, the
    sum its sum, max and min its own; an explicit batch_size is summed. Guards against an unweighted
    mean of micro-batch means (wrong when micro-batches differ in size)."""
    records = []
    for values in microbatches:
        record = Record(len(values))
        base = {"reduce_fx": "mean", "batch_size": None}
        record.calls += [
            ("mean", math.fsum(values) / len(values), base),
            ("sum", math.fsum(values), {**base, "reduce_fx": "sum"}),
            ("max", max(values), {**base, "reduce_fx": torch.max}),
            ("min", min(values), {**base, "reduce_fx": "min"}),
            ("sized", 1.0, {**base, "batch_size": len(values)}),
        ]
        records.append(record)
    flat = [v for values in microbatches for v in values]
    combined = {name: (value, options) for name, value, options in combine(records)}
    assert list(combined) == ["mean", "sum", "max", "min", "sized"]
    assert combined["mean"][0] == pytest.approx(math.fsum(flat) / len(flat), abs=1e-9)
    assert combined["sum"][0] == pytest.approx(math.fsum(flat), abs=1e-9)
    assert combined["max"][0] == max(flat) and combined["min"][0] == min(flat)
    assert combined["sized"][1]["batch_size"] == len(flat)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("loss", 1.5), {}),
        (("loss", torch.tensor(1.5)), {"prog_bar": True, "reduce_fx": "sum", "batch_size": 3}),
        (("loss", 1.5, True), {"logger": False}),  # an option given by position
        ((), {"name": "loss", "value": 1.5, "on_epoch": True}),
    ],
)
def test_a_recorded_log_call_has_the_options_lightning_would_bind(args: tuple, kwargs: dict) -> None:
    """``self.log`` under :func:`recording`: the options recorded are Lightning's signature bound to the
    call (defaults filled in), whichever way the call names them. Guards the fast path of the usual
    ``self.log(name, value, **options)`` against drifting from the signature."""
    module = L.LightningModule()
    record = Record(4)
    bound = inspect.signature(L.LightningModule.log).bind(module, *args, **kwargs)
    bound.apply_defaults()
    expected = {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}
    with recording(module, record):
        module.log(*args, **kwargs)
        with pytest.raises(TypeError):
            module.log("loss", 1.0, colour="red")  # not an option of self.log: refused as Lightning would
    assert record.calls == [("loss", 1.5, expected)]
    assert "log" not in vars(module)


def _relay_worker(rank: int, shared: bool) -> list[list[object]]:
    group = torch.distributed.new_group(backend="gloo")
    relay = open_log_relay(group, lambda error: error, 30.0) if shared else LogRelay(group, lambda error: error, 64)
    assert isinstance(relay, SharedMemoryRelay) == shared
    small = relay.post({"rank": rank})
    large = relay.post(list(range(100 * (rank + 1))))  # gloo: over the capacity on both ranks
    huge = relay.post(list(range(RING_BYTES * (rank + 1))))  # shared memory: over the ring on both ranks
    after = relay.post(("again", rank))
    waited = [relay.wait(small), relay.wait(large), relay.wait(huge), relay.wait(after)]
    # one step in flight, as a non-flushing schedule leaves it: 200 KiB round the 64 KiB ring
    many, previous = [], relay.post(("step", 0, rank, bytes(1000)))
    for step in range(1, 201):
        posted = relay.post(("step", step, rank, bytes(1000)))
        many.append(relay.wait(previous))
        previous = posted
    relay.wait(previous)
    relay.close()
    return [*waited, many, [relay.capacity]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared", [False, True], ids=["gloo", "shared memory"])
def test_relay_gathers_in_flight_and_grows(shared: bool) -> None:
    """Several gathers left in flight come back in order; a payload over the capacity is fetched the
    long way on every rank and the capacity grows to fit it (gloo), or goes by gloo in its place in
    the order (a shared-memory ring without room for it)."""
    for result in run_local(_relay_worker, 2, shared, timeout=50):
        assert result[0] == [{"rank": 0}, {"rank": 1}]
        assert result[1] == [list(range(100)), list(range(200))]
        assert result[2] == [list(range(RING_BYTES)), list(range(2 * RING_BYTES))]
        assert result[3] == [("again", 0), ("again", 1)]
        assert result[4] == [[("step", step, r, bytes(1000)) for r in (0, 1)] for step in range(200)]
        if not shared:
            assert result[5][0] >= len(pickle.dumps(list(range(2 * RING_BYTES))))


def _failing_relay_worker(rank: int) -> str:
    relay = open_log_relay(torch.distributed.new_group(backend="gloo"), lambda error: RuntimeError("peer"), 30.0)
    relay.gather(rank)
    if rank == 1:
        relay.close()  # as the strategy's on_exception does when this rank fails
        return "closed"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="peer"):
        relay.wait(relay.post(rank))
    return f"{time.monotonic() - start:.1f}"


@pytest.mark.timeout(60)
def test_a_shared_memory_relay_fails_at_once_when_a_peer_closes() -> None:
    """A rank waiting for a peer's payload fails (with ``on_error``'s error) as soon as the peer
    closes its links, not at the timeout."""
    waited, closed = run_local(_failing_relay_worker, 2, timeout=50)
    assert closed == "closed" and float(waited) < 10


class _ResNetModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = torchvision_model("resnet18", num_classes=10, cifar=True)

    def configure_pipeline(self) -> nn.Sequential:
        return chain_from_model(self.model)


def test_a_torchvision_resnet_through_the_hook() -> None:
    """``configure_pipeline`` with :func:`chain_from_model` gives the model's own layers (shared
    parameters: what the pipeline trains is the module's), ending in the classifier; its input is the
    call's one argument."""
    module = _ResNetModule()
    x = torch.randn(2, 3, 32, 32)
    model = pipeline_model(module, Call((x,)), stages=2)
    inside = {id(p) for layer in model.layers for p in layer.parameters()}
    assert inside == {id(p) for p in module.parameters()}
    assert model.layers[-1] is module.model.fc and model.captured is None
    assert model.inputs(Call((x,))) is x


class _GoogLeNetModule(L.LightningModule):
    """torchvision's GoogLeNet as built by default: auxiliary heads computed in training only."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torchvision.models.googlenet(init_weights=False, num_classes=10)

    def forward(self, x: torch.Tensor) -> object:
        return self.net(x)


def test_a_module_run_whole_that_leaves_too_few_layers_is_named_with_its_reason_and_the_way_out() -> None:
    """GoogLeNet runs other operations in training than in evaluation, so it runs whole: one layer
    for two stages. The refusal names the module (not the heads inside it), why, where in its code the
    modes part, and what to change; built without the heads, the same module is split."""
    x = torch.randn(2, 3, 64, 64)
    model = pipeline_model(_GoogLeNetModule(), Call((x,)), stages=2)
    assert list(model.run_whole) == ["net"]  # what the set-up names
    with pytest.raises(PlanningError) as refused:  # as the strategy plans it, the modules run whole given
        cpu = torch.device("cpu")
        plan_stages(model.layers, x, 2, PlanOptions(), MemoryModel(), cpu, names=model.names, whole=model.run_whole)
    message = str(refused.value)
    assert message.startswith(
        "2 stages but the model has 1 layer (net): a stage holds at least one layer. net runs whole, inside one "
        "layer, because its forward cannot be traced (net: forward records other operations in eval mode from "
    )
    # where the modes part: GoogLeNet's own line (torchvision's files are not torch's, whose frames are skipped)
    assert f"{inspect.getsourcefile(torchvision.models.GoogLeNet)}:" in message and "self.aux1(x)" in message
    assert "aux_logits=False" in message and "configure_pipeline(self)" in message
    module = _GoogLeNetModule()
    module.net = torchvision.models.googlenet(init_weights=False, num_classes=10, aux_logits=False)
    split = pipeline_model(module, Call((x,)), stages=2)
    assert len(split.layers) >= 2 and split.run_whole == {}


def test_the_prediction_shares_the_machine_by_the_contention_given() -> None:
    """Four layers of 1 s split into two equal stages, 1F1B with 4 micro-batches: on devices that
    share one machine by 1.5 the prediction is the simulator's with that contention, slower than on
    devices that share nothing, and at most 1.5 times slower. Guards against the option not
    reaching the prediction."""
    costs = ChainCosts.from_lists([1.0, 1.0, 1.0, 1.0])
    plan = partition(PlanRequest(costs, 2), "time")
    stage_plan = StagePlan(tuple((s.layers[0], s.layers[-1]) for s in plan.stages), plan, costs)
    options = ScheduleOptions("1f1b", 4)
    alone, shared = (predict(stage_plan, options, 4, contention) for contention in (1.0, 1.5))
    priced = StageCosts.from_plan(plan.to_dict())
    expected = simulate(
        make_schedule("1f1b", 2, 4, PREDICTED_STEPS), replace(priced, contention=1.5), early_gradients=True
    )
    assert shared.makespan == expected.makespan
    assert alone.makespan < shared.makespan <= 1.5 * alone.makespan


def test_placement_table_shows_where_stages_compute_and_where_their_weights_live() -> None:
    """The set-up print of Rahimi's families: FSDP computes every stage on every worker and keeps
    stage ``s``'s weights on worker ``s mod W``; LPP on one group of two loops the stages over the
    workers; FSLPP on two groups of one computes everywhere, weights on ``h(s, s)``. CDP's dp form
    says where each replica starts: a quarter of a pass after the previous, three forwards of four
    stages when backwards take twice as long."""
    fsdp = placement_table(make_schedule("fsdp", 3, 4, workers=2)).splitlines()
    assert fsdp[0] == "===== Placement (fsdp, 2 workers per pipeline) ====="
    assert [line.split() for line in fsdp[2:]] == [["0", "0,1", "0"], ["1", "0,1", "1"], ["2", "0,1", "0"]]
    lpp = placement_table(make_schedule("lpp", 4, 2, groups=1, replicas=2)).splitlines()
    assert [line.split()[1:] for line in lpp[2:]] == [["0", "0"], ["1", "1"], ["0", "0"], ["1", "1"]]
    ddp = placement_table(make_schedule("ddp", 2, 4)).splitlines()
    assert [line.split()[1:] for line in ddp[2:]] == [["0-3", "0-3"]] * 2
    cdp = placement_table(make_schedule("cdp", 4, 4, form="dp", stage_durations=([1.0] * 4, [2.0] * 4)))
    assert cdp.splitlines()[-1] == "each worker starts its micro-batch when the previous one has done its F2"


@settings(max_examples=200, deadline=None)
@given(
    family=st.sampled_from(["1f1b", "gpipe", "interleaved", "2bw", "lpp"]),
    world=st.integers(1, 16),
    stages=st.one_of(st.none(), st.integers(1, 16)),
    copies=st.one_of(st.none(), st.integers(1, 16)),
)
def test_the_topology_tiles_the_ranks(family: str, world: int, stages: int | None, copies: int | None) -> None:
    """Every shape the options allow on ``world`` ranks: the pipelines are ``data_parallel`` runs of
    ``workers`` consecutive ranks covering each rank once, and each rank finds itself in its pipeline
    at its worker; a world that does not tile is refused with the counts that would."""
    options = ScheduleOptions(family=family)
    if stages is not None and copies is not None:
        copies = None  # the strategy refuses both at once
    try:
        shapes = [Topology.of(options, world, rank, stages, copies) for rank in range(world)]
    except PlanningError as error:
        assert "use a multiple of" in str(error) or "choose groups among" in str(error) or "stages is not" in str(error)
        return
    shape = shapes[0]
    assert shape.data_parallel * shape.workers == world
    assert sorted(rank for pipeline in shape.pipelines for rank in pipeline) == list(range(world))
    for rank, mine in enumerate(shapes):
        assert mine.pipelines[mine.pipeline_index][mine.worker] == rank
        assert (mine.data_parallel, mine.workers, mine.stages) == (shape.data_parallel, shape.workers, shape.stages)
    if copies is not None:
        assert shape.data_parallel == copies
    if stages is not None:
        assert shape.stages == stages
    elif family == "interleaved":
        assert shape.stages == 2 * shape.workers
    elif family != "lpp":
        assert shape.stages == shape.workers


@settings(max_examples=60, deadline=None)
@given(
    family=st.sampled_from(["gpipe", "1f1b", "pipedream", "2bw", "cdp"]),
    seconds=st.lists(st.floats(0.001, 0.1), min_size=2, max_size=6),
    microbatches=st.sampled_from([2, 4, 8]),
)
def test_the_predicted_step_is_no_shorter_than_the_busiest_stage(
    family: str, seconds: list[float], microbatches: int
) -> None:
    """Whatever the family, a step cannot take less than the busiest worker's compute: its stage's
    forward and backward of every micro-batch. Guards against a non-flushing family's steady step
    taken over the drain (2BW, m = 2, stages of 18 and 15 ms was predicted at 15.75 ms)."""
    costs = ChainCosts.from_lists(seconds)
    plan = partition(PlanRequest(costs, 2), "time")
    stage_plan = StagePlan(tuple((s.layers[0], s.layers[-1]) for s in plan.stages), plan, costs)
    predicted = predict(stage_plan, ScheduleOptions(family, microbatches), microbatches)
    busiest = max(stage.compute_seconds for stage in plan.stages) * microbatches
    assert predicted.steady_step >= busiest * (1 - 1e-9)


def test_the_topology_of_known_shapes() -> None:
    """Worked cases: 4 ranks of 1F1B are one pipeline; 2 copies of 2 workers put rank 3 at worker 1 of
    copy 1; interleaved puts 2 stages on each worker; 3 ranks cannot hold 2 copies."""
    one = Topology.of(ScheduleOptions("1f1b"), 4, 3)
    assert (one.data_parallel, one.workers, one.stages, one.pipelines) == (1, 4, 4, [[0, 1, 2, 3]])
    two = Topology.of(ScheduleOptions("1f1b"), 4, 3, data_parallel=2)
    assert (two.pipelines, two.pipeline_index, two.worker) == ([[0, 1], [2, 3]], 1, 1)
    assert Topology.of(ScheduleOptions("interleaved"), 2, 0).stages == 4
    with pytest.raises(PlanningError, match="3 devices cannot hold 2 equal pipeline copies: use a multiple of 2"):
        Topology.of(ScheduleOptions("1f1b"), 3, 0, data_parallel=2)
