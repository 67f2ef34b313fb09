"""Memory of the non-flushing runtime: how many copies of its weights a stage holds, that they are
reused from step to step instead of allocated anew, and that a long run does not grow the process."""

from __future__ import annotations

import io
import threading

import pytest
import torch
from torch import nn

from lightning_pipe.runtime.executor import PipelineExecutor
from lightning_pipe.runtime.launch import run_local
from lightning_pipe.runtime.weights import StageWeights, WeightCopy
from lightning_pipe.schedule import make_schedule
from tests.reference import OPTIMIZERS, batches, build_stages


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def _copies_worker(rank: int, family: str, options: dict, steps: int) -> dict:
    """Trains 2 stages; records the copies of the stage's weights after every update (where the most
    are held: the outgoing version, the incoming one and the spare) and the storages used."""
    seen: list[int] = []
    storages: list[set[int]] = []
    update = StageWeights.update

    def counted(self: StageWeights, *args, **kwargs) -> None:
        update(self, *args, **kwargs)
        storages.append(self.weight_storages())
        seen.append(len(storages[-1]))

    StageWeights.update = counted
    try:
        executor = PipelineExecutor(
            lambda k: make_schedule(family, 2, 4, k, **options),
            build_stages(2, width=64),
            nn.functional.cross_entropy,
            OPTIMIZERS["sgd"],
        )
        for inputs, targets in batches(steps, rows=16):
            executor.step(inputs, targets)
        kept = [copy for weights in executor.weights.values() for copy in weights.versions.values()]
        replicas = [isinstance(copy, WeightCopy) and copy.module is not None for copy in kept]
        executor.drain()
        executor.close()
    finally:
        StageWeights.update = update
    return {"copies": seen, "storages": storages, "replicas": replicas}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("family", "options", "most"),
    [("2bw", {}, [2, 2]), ("cdp", {"rule": "cdp_v1"}, [2, 2]), ("cdp", {"rule": "cdp_v2"}, [2, 1])],
)
def test_a_stage_holds_two_weight_copies_and_reuses_their_storage(family: str, options: dict, most: list[int]) -> None:
    """PipeDream-2BW (= CDP-v1) keeps two versions (Narayanan et al. 2021, §3.1): the live weights,
    which the current version shares, and one stashed copy, reused from step to step. CDP-v2's last
    stage only ever computes with the current weights (v = t when i + j >= N - 1, Fournier & Oyallon
    2024, Eq. CDP-v2), so it holds one. Guards against a copy of the weights allocated at every step
    (the runtime did that) or kept after its last use (it kept versions of actions already run)."""
    for rank, result in enumerate(run_local(_copies_worker, 2, family, options, 12, timeout=90)):
        assert max(result["copies"]) == most[rank]
        steady = result["storages"][3:]
        assert len(set().union(*steady)) <= most[rank]  # the same storages, step after step
        assert all(result["replicas"])  # forwards run on module replicas


def _resident_worker(rank: int, steps: int) -> list[int]:
    torch.manual_seed(0)
    stages = [
        nn.Sequential(nn.Linear(6, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh()),
        nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 3)),
    ]
    executor = PipelineExecutor(
        lambda k: make_schedule("2bw", 2, 4, k),
        stages,
        nn.functional.cross_entropy,
        OPTIMIZERS["sgd"],
        timeline_length=64,
    )
    data = batches(8, rows=64)
    resident = []
    for step in range(steps):
        inputs, targets = data[step % len(data)]
        executor.step(inputs, targets)
        if step >= 50:
            resident.append(_resident_bytes())
    executor.drain()
    executor.close()
    return resident


@pytest.mark.timeout(180)
def test_two_hundred_2bw_steps_do_not_grow_the_process() -> None:
    """Resident memory of 2BW from step 50 to step 200 does not grow: the least resident memory of
    steps 150-199 is at most 32 MiB above that of steps 50-99. The least, because the allocator hands
    blocks back and forth with the transient tensors of a step: the resident size wanders by 13-38
    MiB within a run when another process loads the machine, with no trend over 1000 steps, and
    one CI run saw the least rise by 24 MiB. A copy of the weights is 1 MiB here, so a leak of one
    per step would add 100 MiB, and of one every four steps 37 MiB."""
    for resident in run_local(_resident_worker, 2, 200, timeout=150):
        early, late = min(resident[:50]), min(resident[100:])
        assert late - early < 32 << 20, (early / 2**20, late / 2**20)


def test_a_replica_shares_buffers_and_computes_with_its_own_leaves() -> None:
    """A weight copy's module replica reads the copy's leaves and updates the live module's batch-norm
    statistics, as the live module would."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    storages = {name: param.detach().clone() * 2 for name, param in module.named_parameters()}
    copy = WeightCopy.of(module, storages)
    x = torch.randn(8, 4)
    expected = torch.func.functional_call(module, {n: t.clone() for n, t in storages.items()}, (x,))
    module.get_buffer("1.running_mean").zero_()
    out = copy.module(x)
    torch.testing.assert_close(out, expected)
    assert copy.module[1].running_mean is module[1].running_mean and module[1].running_mean.abs().sum() > 0
    assert all(copy.module.get_parameter(n) is copy[n] for n in copy)
    storages["0.weight"].add_(1)  # the leaves are views of the storages given
    torch.testing.assert_close(copy["0.weight"], storages["0.weight"])


def _stage() -> StageWeights:
    torch.manual_seed(0)
    return StageWeights(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), OPTIMIZERS["sgd"], snapshots=True)


def _train_once(weights: StageWeights, step: int, version: int, x: torch.Tensor) -> None:
    leaves = weights.leaves(version)
    out = weights.forward(leaves, x)
    weights.backward(step, leaves, [out.square().sum()], None, [])


def test_an_update_keeps_the_outgoing_version_where_its_forwards_saw_it() -> None:
    """A forward of version 0, then the update to version 1 while it is in flight (kept), then its
    backward: the gradient is that of version 0's weights (as functional_call on a clone gives), the
    live weights are version 1, and the kept version survives a state_dict round trip into a fresh
    stage. Guards against the move of the live weights changing the copy the forward used."""
    weights, x = _stage(), torch.randn(3, 4)
    before = {name: p.detach().clone() for name, p in weights.module.named_parameters()}
    _train_once(weights, 0, 0, x)
    weights.update(0, keep={0})  # version 0 still used by a micro-batch in flight
    assert weights.version == 1 and len(weights.weight_storages()) == 2
    leaves = weights.leaves(0)
    out = weights.forward(leaves, x)
    expected = torch.func.functional_call(weights.module, {n: t.clone() for n, t in before.items()}, (x,))
    torch.testing.assert_close(out, expected)
    assert all(torch.equal(leaves[n], before[n]) for n in before)
    assert not torch.equal(weights.module.get_parameter("0.weight"), before["0.weight"])  # live: version 1
    restored = _stage()
    restored.load_state_dict(weights.state_dict())
    assert sorted(restored.versions) == [0] and restored.version == 1
    torch.testing.assert_close(restored.forward(restored.leaves(0), x), expected)
    assert isinstance(restored.versions[0], WeightCopy) and restored.versions[0].module is not None


def test_a_state_with_a_version_and_a_gradient_in_flight_resumes_exactly() -> None:
    """2BW's state between micro-batches: version 0 kept for a micro-batch in flight, the live weights
    at version 1, and step 1's gradient half accumulated. A fresh stage loaded from the state_dict
    finishes the step exactly as the original does: the same kept leaves, the same gradient (the
    half saved plus the second half) and the same weights after the update. Guards against a state
    that drops the pending gradient or restores it into the wrong step."""
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    stages = [_stage(), _stage()]
    _train_once(stages[0], 0, 0, x)
    stages[0].update(0, keep={0})
    _train_once(stages[0], 1, 0, x)  # step 1's first micro-batch, on the version kept
    file = io.BytesIO()  # through bytes, as a checkpoint: the optimizer's state_dict refers to its live tensors
    torch.save({"module": stages[0].module.state_dict(), **stages[0].state_dict()}, file)  # as the executor saves
    file.seek(0)
    state = torch.load(file)
    stages[1].module.load_state_dict(state["module"])
    stages[1].load_state_dict(state)
    assert stages[1].version == 1 and sorted(stages[1].versions) == [0] and sorted(stages[1].gradients) == [1]
    for weights in stages:
        _train_once(weights, 1, 0, y)  # its second micro-batch
        weights.update(1, keep=set())
    assert stages[1].version == stages[0].version == 2
    for restored, original in zip(stages[1].params, stages[0].params, strict=True):
        assert torch.equal(restored, original)
    assert not torch.equal(stages[1].params[0], _stage().params[0])  # both really trained


class _Uncopyable(nn.Linear):
    """A layer holding something :func:`copy.deepcopy` refuses (a lock)."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.lock = threading.Lock()


def test_a_module_that_cannot_be_copied_computes_through_functional_call() -> None:
    """No replica when the module refuses deepcopy: the kept version still computes with its own
    leaves (through functional_call) and gives them the gradient. Guards the fallback path."""
    torch.manual_seed(0)
    weights = StageWeights(_Uncopyable(), OPTIMIZERS["sgd"], snapshots=True)
    x = torch.randn(3, 4)
    leaves = weights.leaves(0)
    assert isinstance(leaves, WeightCopy) and leaves.module is None
    before = {name: t.detach().clone() for name, t in leaves.items()}
    weights.backward(0, leaves, [weights.forward(leaves, x).square().sum()], None, [])
    weights.update(0, keep={0})
    expected = torch.func.functional_call(weights.module, before, (x,))
    torch.testing.assert_close(weights.forward(weights.leaves(0), x), expected)
    assert not torch.equal(weights.module.weight, before["weight"])  # the live weights moved on
