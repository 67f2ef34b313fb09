"""Runtime features: nested messages and skip connections, stage mismatches, recomputation's memory,
measured timelines, drains in the middle of training, losses on every rank."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn

from lightning_pipe.cost.saved_bytes import saved_bytes
from lightning_pipe.errors import PipelineRuntimeError, PlanningError
from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.forward_backward import _sent_forward
from lightning_pipe.runtime.launch import LocalRunError, run_local
from lightning_pipe.runtime.transport import _HEADER, post_ahead
from lightning_pipe.schedule import Kind, make_schedule
from lightning_pipe.schedule.draw import chrome_trace
from lightning_pipe.util.nested import flatten
from tests.reference import OPTIMIZERS, batches, build_stages, one_step_late, reference, sync


class Head(nn.Module):
    """Stage 0: returns a tuple (features, skip) whose second part jumps over stage 1."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.layer(x)), x


class Middle(nn.Module):
    """Stage 1: consumes the tuple, passes the skip on inside a dict with an integer tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        features, skip = pair
        return {"h": torch.tanh(self.layer(features)), "skip": skip, "count": torch.tensor([features.shape[0]])}


class Tail(nn.Module):
    """Stage 2: uses the skip connection."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 3)
        self.skip = nn.Linear(6, 3)

    def forward(self, message: dict[str, torch.Tensor]) -> torch.Tensor:
        assert int(message["count"]) == message["h"].shape[0]
        return self.layer(message["h"]) + self.skip(message["skip"])


def _skip_model() -> list[nn.Module]:
    torch.manual_seed(3)
    return [Head(), Middle(), Tail()]


def _train(rank: int, family: str, stages, steps: int, microbatches: int = 3, rows: int = 10, **kwargs) -> dict:
    executor = PipelineExecutor(
        make_schedule(family, len(stages), microbatches),  # a flushing schedule: its one step repeats
        stages,
        nn.functional.cross_entropy,
        OPTIMIZERS["sgd"],
        **kwargs,
    )
    for inputs, targets in batches(steps, rows):
        executor.step(inputs, targets)
    executor.drain()
    executor.close()
    return {
        "params": {s: [p.detach().clone() for p in w.params] for s, w in executor.weights.items()},
        "buffers": {s: [b.clone() for b in w.module.buffers()] for s, w in executor.weights.items()},
        "peak_saved_bytes": executor.peak_saved_bytes,
        "timeline": executor.timeline,
        "copies_inputs": executor.copies_inputs,
    }


def _skip_worker(rank: int) -> dict:
    return _train(rank, "1f1b", _skip_model(), 3)


def _assert_trained_like_the_reference(results: list[dict], model: list[nn.Module]) -> None:
    """Each rank's stage ends with the parameters of sync training of ``model`` in one process."""
    expected = reference(model, batches(3), 3, sync, "sgd")
    for stage, result in enumerate(results):
        assert len(result["params"][stage]) == len(expected[stage])
        for got, want in zip(result["params"][stage], expected[stage], strict=True):
            assert torch.allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.timeout(120)
def test_nested_messages_and_skip_connections() -> None:
    _assert_trained_like_the_reference(run_local(_skip_worker, 3, timeout=90), _skip_model())


def _weightless_model() -> list[nn.Module]:
    torch.manual_seed(4)
    return [nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Tanh(), nn.Linear(8, 3)]


def _weightless_worker(rank: int) -> dict:
    return _train(rank, "zb_h1", _weightless_model(), 3)


@pytest.mark.timeout(120)
def test_a_stage_without_weights() -> None:
    _assert_trained_like_the_reference(run_local(_weightless_worker, 3, timeout=90), _weightless_model())


def _in_place_model() -> list[nn.Module]:
    torch.manual_seed(5)
    return [
        nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8)),
        nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8), nn.BatchNorm1d(8)),
        nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 3)),
    ]


def _in_place_worker(rank: int, recompute: bool) -> dict:
    return _train(rank, "1f1b", _in_place_model(), 3, recompute=recompute)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recompute", [False, True])
def test_stages_that_start_with_an_in_place_layer(recompute: bool) -> None:
    """A cut just before ``ReLU(inplace=True)`` (as torchvision's ResNets and VGGs have after every
    batch norm and convolution): the received input is a leaf that requires grad, which autograd
    forbids to change in place; the stage gets a copy and trains as the reference, with and without
    recomputation. Guards against the error reaching the user and against a recomputation that
    sees an input its first forward changed in place."""
    results = run_local(_in_place_worker, 3, recompute, timeout=90)
    _assert_trained_like_the_reference(results, _in_place_model())
    assert [result["copies_inputs"] for result in results] == [set(), {1}, {2}]


def _short_timeline_worker(rank: int) -> dict:
    stages, loss = build_stages(2), nn.functional.cross_entropy
    for option, unit in (("timeline_length", "actions"), ("post_ahead_bytes", "bytes")):
        for bad in (-1, 2.5, True):
            with pytest.raises(PlanningError, match=rf"{option} must be a whole number of {unit} >= 0, or None"):
                PipelineExecutor(make_schedule("1f1b", 2, 2), stages, loss, OPTIMIZERS["sgd"], **{option: bad})
    return _train(rank, "1f1b", build_stages(2), 3, timeline_length=4)


@pytest.mark.timeout(120)
def test_the_timeline_keeps_the_latest_actions() -> None:
    for rank, result in enumerate(run_local(_short_timeline_worker, 2, timeout=90)):
        timeline = list(result["timeline"])
        assert len(timeline) == 4 and all(i.action.step == 2 for i in timeline)
        assert timeline[-1].action.kind is Kind.UPDATE and timeline[-1].worker == rank


def _resized_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Mini-batches whose size changes from step to step: every message stream changes layout."""
    return [batch for seed, rows in enumerate((10, 10, 7, 12)) for batch in batches(1, rows=rows, seed=seed)]


def _resized_worker(rank: int) -> dict:
    executor = PipelineExecutor(
        make_schedule("1f1b", 2, 3), build_stages(2), nn.functional.cross_entropy, OPTIMIZERS["sgd"]
    )
    for inputs, targets in _resized_batches():
        executor.step(inputs, targets)
    executor.close()
    return {s: [p.detach().clone() for p in w.params] for s, w in executor.weights.items()}


@pytest.mark.timeout(120)
def test_shapes_are_negotiated_again_when_the_batch_size_changes() -> None:
    results = run_local(_resized_worker, 2, timeout=90)
    expected = reference(build_stages(2), _resized_batches(), 3, sync, "sgd")
    for stage in range(2):
        for got, want in zip(results[stage][stage], expected[stage], strict=True):
            assert torch.allclose(got, want, atol=1e-6, rtol=0)


def _mismatch_worker(rank: int) -> dict:
    stages = build_stages(2)
    stages[1] = nn.Linear(5, 3)  # stage 0 sends 8 features
    return _train(rank, "1f1b", stages, 2)


@pytest.mark.timeout(120)
def test_a_stage_mismatch_names_both_stages() -> None:
    with pytest.raises(LocalRunError) as caught:
        run_local(_mismatch_worker, 2, timeout=60)
    message = caught.value.errors[1]
    assert message.startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")  # the error's own type
    assert (
        "raised in the forward of stage 1 (rank 1) on the output of stage 0 (rank 0), tensors [((4, 8), 'float32')]"
        in message
    )
    assert caught.value.errors[0].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert "raised on rank 1; rank 0 stopped because of it" in caught.value.errors[0]


class Wide(nn.Module):
    """A stage whose activations dwarf its weights, with dropout and batch norm."""

    def __init__(self, width: int) -> None:
        super().__init__()
        # dropout: the recomputed forward must draw the same masks as the first one; batch norm: it must
        # not update the running statistics a second time
        self.layers = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Tanh(), nn.Dropout(0.2))
                for _ in range(6)
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _memory_stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 64), Wide(64)), nn.Sequential(Wide(64), nn.Linear(64, 3))]


def _memory_worker(rank: int, recompute: bool) -> dict:
    return _train(rank, "gpipe", _memory_stages(), 2, recompute=recompute, microbatches=4, rows=8, track_memory=True)


def _saved_by_one_forward(module: nn.Module, inputs: torch.Tensor) -> int:
    """What autograd keeps for one micro-batch's backward of the whole stage, model state (parameters,
    buffers) left out: :func:`saved_bytes` (hand-checked per layer in tests/test_profiler.py) around a
    plain forward, outside the runtime."""
    with saved_bytes([*module.parameters(), *module.buffers()]) as counted:
        module(inputs)
        return counted()


def _description(output: torch.Tensor, differentiated: bool) -> int:
    """Bytes the description of a stage's message takes ahead of its tensors (the transport's layout,
    pickled and aligned)."""
    skeleton, found = flatten(_sent_forward(output, differentiated))
    layout = (skeleton, [(t.dtype, tuple(t.shape)) for t in found])
    return -(-len(pickle.dumps(layout)) // _HEADER) * _HEADER


@pytest.mark.timeout(180)
def test_recomputation_saves_activation_memory() -> None:
    """Exact bytes: GPipe keeps the saved tensors of all m = 4 micro-batches (4·S, the data they are
    cut from left out); with recomputation
    the forward keeps none and the backward's forward again keeps one micro-batch's (S). Guards against
    counting the no-grad forward, not releasing a micro-batch after its backward, or a ratio that any
    saving passes."""
    kept = run_local(_memory_worker, 2, False, timeout=90)
    recomputed = run_local(_memory_worker, 2, True, timeout=90)
    stages = _memory_stages()
    microbatch = batches(1, rows=8)[0][0][:2]
    with torch.no_grad():
        received = stages[0](microbatch)
    # stage 1's first Linear saves its input: a view of the received message, which keeps the message's
    # description of its layout alive with it (which tensors require grad: not known after a no-grad forward)
    saved = [
        _saved_by_one_forward(stages[0], microbatch),
        _saved_by_one_forward(stages[1], received.clone().requires_grad_()),
    ]
    assert saved[1] > 6 * 2 * 64 * 4  # at least each block's Linear input: the count is not empty
    # stage 0's first Linear saves its input, the mini-batch's data: not counted (saved[0] counts the
    # storage it views, the whole batch)
    data = [batches(1, rows=8)[0][0].untyped_storage().nbytes(), 0]
    for rank in range(2):
        assert kept[rank]["peak_saved_bytes"] == 4 * (saved[rank] - data[rank] + rank * _description(received, True))
        assert recomputed[rank]["peak_saved_bytes"] == saved[rank] - data[rank] + rank * _description(received, False)
        for got, want in zip(recomputed[rank]["params"][rank], kept[rank]["params"][rank], strict=True):
            assert torch.allclose(got, want, atol=1e-6, rtol=0)
        for got, want in zip(recomputed[rank]["buffers"][rank], kept[rank]["buffers"][rank], strict=True):
            assert torch.allclose(got.double(), want.double(), atol=1e-6, rtol=0)


def _drain_worker(rank: int) -> dict:
    executor = PipelineExecutor(
        lambda k: make_schedule("2bw", 2, 2, k), build_stages(2), nn.functional.cross_entropy, OPTIMIZERS["sgd"]
    )
    losses: dict[int, float] = {}
    data = batches(6)
    outputs = {}
    for inputs, targets in data[:3]:
        output = executor.step(inputs, targets, share_losses=True, return_outputs=True)
        losses.update(output.losses)
        outputs.update(output.outputs)
    losses.update(executor.drain(share_losses=True).losses)  # e.g. validation in the middle of an epoch
    for inputs, targets in data[3:]:
        losses.update(executor.step(inputs, targets, share_losses=True).losses)
    losses.update(executor.drain(share_losses=True).losses)
    executor.close()
    snapshots = [version for weights in executor.weights.values() for version in weights.versions]
    return {
        "losses": losses,
        "timeline": executor.timeline,
        "calls": executor.origin,
        "outputs": outputs,
        "snapshots": snapshots,
    }


@pytest.mark.timeout(120)
def test_drain_midway_shares_losses_and_records_every_action() -> None:
    results = run_local(_drain_worker, 2, timeout=90)
    assert results[0]["losses"] == results[1]["losses"] and sorted(results[0]["losses"]) == list(range(6))
    assert results[0]["snapshots"] == results[1]["snapshots"] == []  # a drain keeps no weight copies
    assert results[0]["calls"] == 6
    for result in results:  # outputs of the micro-batches whose last stage ran during the shared calls
        assert result["outputs"] and all(tensor.shape[1] == 3 for tensor in result["outputs"].values())
        assert set(result["outputs"]) == set(results[0]["outputs"])
    for rank, result in enumerate(results):
        timeline = result["timeline"]
        forwards = [i for i in timeline if i.action.kind is Kind.F]
        assert len(forwards) == 6 * 2 and {i.action.step for i in forwards} == set(range(6))
        assert all(i.worker == rank and i.end >= i.start >= 0 for i in timeline)
        assert all(0 <= i.waited <= i.end - i.start for i in timeline)
        # what waits for messages: stage 1's forwards (activations), stage 0's backwards (gradients)
        receiving = Kind.F if rank == 1 else Kind.B
        assert all(i.waited > 0 for i in timeline if i.action.kind is receiving)
        assert all(i.waited == 0 for i in timeline if i.action.kind not in (Kind.F, Kind.B))
        events = chrome_trace(timeline)["traceEvents"]
        assert len(events) > len(timeline)
        waits = [e["args"]["waited_us"] for e in events if "waited_us" in e.get("args", {})]
        assert waits and sum(waits) == pytest.approx(sum(i.waited for i in timeline) * 1e6)


def _checkpoint_worker(rank: int, restore: bool) -> dict:
    def make() -> PipelineExecutor:
        return PipelineExecutor(
            lambda k: make_schedule("2bw", 2, 2, k), build_stages(2), nn.functional.cross_entropy, OPTIMIZERS["adam"]
        )

    data = batches(6)
    executor = make()
    for inputs, targets in data[:3]:
        executor.step(inputs, targets)
    executor.drain()
    if restore:  # a checkpoint after the drain, loaded into a fresh executor (a restarted job)
        state = executor.state_dict()
        executor.close()
        executor = make()
        executor.load_state_dict(state)
    for inputs, targets in data[3:]:
        executor.step(inputs, targets)
    executor.drain()
    executor.close()
    return {s: [p.detach().clone() for p in w.params] for s, w in executor.weights.items()}


@pytest.mark.timeout(120)
def test_checkpoint_after_a_drain_resumes_exactly() -> None:
    straight = run_local(_checkpoint_worker, 2, False, timeout=90)
    resumed = run_local(_checkpoint_worker, 2, True, timeout=90)
    for rank in range(2):
        for got, want in zip(resumed[rank][rank], straight[rank][rank], strict=True):
            assert torch.equal(got, want)


def _mid_stream_worker(rank: int) -> str:
    executor = PipelineExecutor(
        lambda k: make_schedule("2bw", 2, 2, k), build_stages(2), nn.functional.cross_entropy, OPTIMIZERS["sgd"]
    )
    for inputs, targets in batches(2):
        executor.step(inputs, targets)
    with pytest.raises(PipelineRuntimeError, match="drain") as refused:
        executor.state_dict()
    executor.drain()
    assert executor.state_dict()["calls"] == 0
    executor.close()
    return str(refused.value)


@pytest.mark.timeout(120)
def test_a_checkpoint_with_steps_in_flight_is_refused() -> None:
    """2BW between steps has micro-batches in the pipeline whose activations no checkpoint holds: its
    state_dict says to drain first, on every worker alike, instead of saving a state no restart
    can finish. Guards against a mid-stream checkpoint that restores into a crash or wrong weights."""
    messages = run_local(_mid_stream_worker, 2, timeout=90)
    assert all("2bw steps in flight" in message for message in messages)


TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist
from torch import nn
from lightning_pipe.errors import PlanningError
from lightning_pipe.util.nested import flatten
from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.schedule import make_schedule
dist.init_process_group("gloo")
torch.manual_seed(0)
stages = [nn.Sequential(nn.Linear(32, 64), nn.ReLU()), nn.Linear(64, 10)]
executor = PipelineExecutor(
    lambda k: make_schedule("cdp", 2, 2, k), stages, nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.1)
)
losses = {}
for _ in range(4):
    losses.update(executor.step(torch.randn(16, 32), torch.randint(0, 10, (16,)), share_losses=True).losses)
losses.update(executor.drain(share_losses=True).losses)
executor.close()
print(f"rank {dist.get_rank()} steps {sorted(losses)}")
dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
def test_runs_under_torchrun(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rank 0 steps [0, 1, 2, 3]" in done.stdout and "rank 1 steps [0, 1, 2, 3]" in done.stdout


def test_small_receives_wait_until_needed_on_cpus_only_by_default() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert post_ahead(None, cpu) == 256 * 1024
    assert post_ahead(None, gpu) == 0  # NCCL: a pending send waits for its receive, so post them all
    assert post_ahead(0, cpu) == 0 and post_ahead(4096, gpu) == 4096


def _losses_worker(rank: int, family: str, options: dict, early: bool) -> dict:
    executor = PipelineExecutor(
        lambda k: make_schedule(family, 2, 3, k, **options),
        build_stages(2),
        nn.functional.cross_entropy,
        OPTIMIZERS["sgd"],
        early_gradients=early,
    )
    losses, microbatch_losses, outputs = {}, {}, {}
    for inputs, targets in batches(4, rows=11):  # micro-batches of 4, 4 and 3 rows
        output = executor.step(inputs, targets, share_losses=True, return_outputs=True)
        losses.update(output.losses), microbatch_losses.update(output.microbatch_losses), outputs.update(output.outputs)
    output = executor.drain(share_losses=True, return_outputs=True)
    losses.update(output.losses), microbatch_losses.update(output.microbatch_losses), outputs.update(output.outputs)
    executor.close()
    return {"losses": losses, "microbatch": microbatch_losses, "outputs": outputs}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("family", "options", "rule", "early"),
    [("1f1b", {}, sync, True), ("1f1b", {}, sync, False), ("2bw", {}, one_step_late, True)],
)
def test_losses_and_outputs_equal_the_references(family: str, options: dict, rule, early: bool) -> None:
    """Every micro-batch's weighted loss, every step's loss and every last-stage output, as every rank
    gets them, equal a one-process run of the same update rule (uneven micro-batches included); with
    and without early input gradients in the cool-down. Guards against a loss weighted wrongly, an
    output of the wrong micro-batch, or a backward that sends a stale input gradient."""
    record: dict = {}
    reference(build_stages(2), batches(4, rows=11), 3, rule, "sgd", record)
    for result in run_local(_losses_worker, 2, family, options, early, timeout=120):
        assert sorted(result["microbatch"]) == sorted(record) == sorted(result["outputs"])
        for key, (loss, output) in record.items():
            assert result["microbatch"][key] == pytest.approx(loss, abs=1e-6)
            torch.testing.assert_close(result["outputs"][key], output, atol=1e-6, rtol=0)
        for step in range(4):
            expected = sum(record[(step, i)][0] for i in range(3))
            assert result["losses"][step] == pytest.approx(expected, abs=1e-6)


def _open_files_after_each_executor(rank: int) -> list[int]:
    counts = []
    for _ in range(4):
        executor = PipelineExecutor(
            lambda k: make_schedule("1f1b", 2, 2, k), build_stages(2), nn.functional.cross_entropy, OPTIMIZERS["sgd"]
        )
        for inputs, targets in batches(2):
            executor.step(inputs, targets)
        executor.close()
        counts.append(len(os.listdir("/proc/self/fd")))
    return counts


@pytest.mark.timeout(120)
def test_closing_an_executor_releases_its_files() -> None:
    """An executor's close releases every connection it opened (process groups, shared-memory links):
    a process that builds executor after executor has no more open files after the fourth than after
    the first (it grew by 5 per executor while the group of the losses was never destroyed)."""
    for counts in run_local(_open_files_after_each_executor, 2, timeout=90):
        assert max(counts[1:]) <= counts[0], counts  # never more (one may close late: fewer)
