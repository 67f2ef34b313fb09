"""The out-of-place SGD step against torch's own ``SGD.step()``: bitwise the same weights and momentum
buffers, the source weights untouched, and used by a stashing stage only where it is exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from lightning_pipe.runtime.out_of_place import step_into, steps_out_of_place
from lightning_pipe.runtime.weights import StageWeights

_SHAPES = [(3, 5), (5,), (2, 2, 3)]


@st.composite
def _hyper_parameters(draw: st.DrawFn) -> dict:
    momentum = draw(st.sampled_from([0.0, 0.5, 0.9]))
    nesterov = momentum > 0 and draw(st.booleans())
    return {
        "lr": draw(st.sampled_from([0.1, 0.013, 1.7])),
        "momentum": momentum,
        "dampening": 0.0 if nesterov else draw(st.sampled_from([0.0, 0.3])),
        "weight_decay": draw(st.sampled_from([0.0, 1e-4, 0.05])),
        "nesterov": nesterov,
        "maximize": draw(st.booleans()),
        "foreach": draw(st.sampled_from([None, False])),
    }


@given(
    options=_hyper_parameters(),
    second_lr=st.sampled_from([None, 0.02]),
    missing=st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_the_step_into_other_tensors_is_bitwise_torchs_step(
    options: dict, second_lr: float | None, missing: list[list[bool]], seed: int
) -> None:
    """Three steps over two parameter groups (the second with its own learning rate, given as a
    tensor), a random subset of the parameters without a gradient in each step: the weights written
    into the targets and the momentum buffers equal those of ``SGD.step()`` on a copy of the weights,
    and the weights read are left as they were. Guards against any reordering of torch's operations
    (one rounding apart fails ``torch.equal``) and against a skipped parameter left unwritten."""
    generator = torch.Generator().manual_seed(seed)
    ours = [nn.Parameter(torch.randn(shape, generator=generator)) for shape in _SHAPES]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]

    def groups(params: list[nn.Parameter]) -> list[dict]:
        if second_lr is None:
            return [{"params": params}]
        return [{"params": params[:1]}, {"params": params[1:], "lr": torch.tensor(second_lr)}]

    mine, reference = torch.optim.SGD(groups(ours), **options), torch.optim.SGD(groups(theirs), **options)
    for absent in missing:
        grads = [
            None if skip else torch.randn(p.shape, generator=generator) for p, skip in zip(ours, absent, strict=True)
        ]
        for q, grad in zip(theirs, grads, strict=True):
            q.grad = None if grad is None else grad.clone()
        assert steps_out_of_place(mine, grads)
        targets = [torch.full_like(p, float("nan")) for p in ours]
        before = [p.detach().clone() for p in ours]
        # the gradients are given, not read from .grad (None on ours); so are the weights, detached
        step_into(mine, grads, [p.detach() for p in ours], targets)
        reference.step()
        for p, q, old, target in zip(ours, theirs, before, targets, strict=True):
            assert torch.equal(p, old)  # only read
            assert torch.equal(target, q)
            p.data = target
    for p, q in zip(ours, theirs, strict=True):
        buffers = (mine.state[p].get("momentum_buffer"), reference.state[q].get("momentum_buffer"))
        assert (buffers[0] is None) == (buffers[1] is None)
        assert buffers[0] is None or torch.equal(*buffers)


class _MySGD(torch.optim.SGD):
    """A subclass may change ``step``: it is not stepped out of place."""


def _sgd(**options) -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1, **options)


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: _sgd(momentum=0.9), True),
        (lambda: _sgd(foreach=True), False),  # multi-tensor kernels: the copy and torch's step are cheaper
        (lambda: _sgd(fused=True), False),
        (lambda: _MySGD([nn.Parameter(torch.ones(2))], lr=0.1), False),
        (lambda: torch.optim.Adam([nn.Parameter(torch.ones(2))]), False),
        (lambda: torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=torch.tensor(0.1, requires_grad=True)), False),
    ],
)
def test_only_a_plain_per_tensor_sgd_steps_out_of_place(build, expected: bool) -> None:
    assert steps_out_of_place(build(), [torch.ones(2)]) is expected


def test_gradients_and_targets_must_match_the_optimizers_parameters() -> None:
    optimizer = _sgd()
    with pytest.raises(ValueError, match="2 gradients, 2 sources and 2 targets for an optimizer of 1 parameters"):
        step_into(optimizer, [torch.ones(2)] * 2, [torch.ones(2)] * 2, [torch.empty(2)] * 2)
    with pytest.raises(ValueError, match="1 gradients, 0 sources and 1 targets"):
        step_into(optimizer, [torch.ones(2)], [], [torch.empty(2)])


def test_a_step_hook_or_a_sparse_gradient_keeps_torchs_own_step() -> None:
    optimizer, dense = _sgd(), [torch.ones(2)]
    handle = optimizer.register_step_pre_hook(lambda *_: None)
    assert not steps_out_of_place(optimizer, dense)
    handle.remove()
    assert steps_out_of_place(optimizer, dense)
    assert steps_out_of_place(optimizer, [None])
    global_handle = register_optimizer_step_post_hook(lambda *_: None)
    try:
        assert not steps_out_of_place(optimizer, dense)
    finally:
        global_handle.remove()
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (2,), check_invariants=True)
    assert not steps_out_of_place(optimizer, [sparse])


def _stashing_stage(optimizer: type[torch.optim.Optimizer], frozen: bool = True, reverse: bool = False) -> StageWeights:
    """A two-layer stage whose last bias is ``frozen`` (not in the optimizer, copied with the rest);
    ``reverse``: the optimizer's groups hold its parameters last layer first."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    module[2].bias.requires_grad_(not frozen)

    def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        trained = [p for p in params if p.requires_grad]
        groups = [{"params": trained[2:]}, {"params": trained[:2]}] if reverse else [{"params": trained}]
        return optimizer(groups, lr=0.1, momentum=0.9, weight_decay=0.01)

    return StageWeights(module, build, snapshots=True)


@pytest.mark.parametrize(("frozen", "reverse"), [(True, False), (False, False), (False, True)])
def test_a_stashing_stage_writes_its_sgd_update_into_the_spare_storage(frozen: bool, reverse: bool) -> None:
    """Six 2BW-like updates (the outgoing version kept for a micro-batch in flight each time) with
    ``SGD`` and with a subclass that falls back to copy-then-step: the same weights bitwise, the kept
    version intact, a frozen bias carried into the new storage, and ``SGD.step`` never called on the
    out-of-place stage; with every parameter trained, in the stage's order or in groups of another
    order. Guards against the fast path drifting from the copy path it replaces, and against a
    gradient or storage handed to another parameter's slot of the optimizer."""
    stages = [_stashing_stage(torch.optim.SGD, frozen, reverse), _stashing_stage(_MySGD, frozen, reverse)]
    assert stages[0].optimizer is not None
    stages[0].optimizer.step = None  # the out-of-place path must not call it
    x = torch.randn(3, 4)
    for step in range(6):
        for weights in stages:
            leaves = weights.leaves(step)
            kept = {name: leaf.detach().clone() for name, leaf in leaves.items()}
            out = weights.forward(leaves, x)
            weights.backward(step, leaves, [out.square().sum()], None, [])
            weights.update(step, keep={step})
            assert all(torch.equal(weights.leaves(step)[name], value) for name, value in kept.items())
            assert torch.equal(weights.module[2].bias, kept["2.bias"]) or not frozen
            assert len(weights.weight_storages()) == 2
    for ours, theirs in zip(stages[0].params, stages[1].params, strict=True):
        assert torch.equal(ours, theirs)
        states = [weights.optimizer.state.get(p, {}) for weights, p in zip(stages, (ours, theirs), strict=True)]
        assert states[0].keys() == states[1].keys()  # a momentum buffer under the parameter it belongs to
        assert all(torch.equal(states[0][key], states[1][key]) for key in states[0])
    assert not torch.equal(stages[0].params[0], _stashing_stage(torch.optim.SGD, frozen, reverse).params[0])


def test_an_optimizer_holding_a_tensor_of_its_own_keeps_torchs_step() -> None:
    """An optimizer built over more than the stage's parameters (here one extra tensor, which gets no
    gradient from the stage) cannot be matched parameter by parameter to the stage's storages: the
    stage falls back to copy-then-step, calls ``step()`` on every update, leaves the extra tensor
    alone and trains as a stage whose optimizer holds only its parameters."""

    def stage(extra: list[nn.Parameter]) -> StageWeights:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        return StageWeights(
            module, lambda params: torch.optim.SGD([*params, *extra], lr=0.1, momentum=0.9), snapshots=True
        )

    extra = nn.Parameter(torch.ones(3))
    mixed, reference = stage([extra]), stage([])
    calls = []
    step = mixed.optimizer.step
    mixed.optimizer.step = lambda: calls.append(step())
    x = torch.randn(3, 4)
    for version in range(3):
        for weights in (mixed, reference):
            leaves = weights.leaves(version)
            weights.backward(version, leaves, [weights.forward(leaves, x).square().sum()], None, [])
            weights.update(version, keep={version})
    assert len(calls) == 3
    for ours, theirs in zip(mixed.params, reference.params, strict=True):
        assert torch.equal(ours, theirs)
    assert torch.equal(extra, torch.ones(3))
