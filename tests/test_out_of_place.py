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
    assert steps_out_of_place(mine)
    for absent in missing:
        for p, q, skip in zip(ours, theirs, absent, strict=True):
            grad = None if skip else torch.randn(p.shape, generator=generator)
            p.grad, q.grad = grad, None if grad is None else grad.clone()
        targets = {p: torch.full_like(p, float("nan")) for p in ours}
        before = [p.detach().clone() for p in ours]
        step_into(mine, targets)
        reference.step()
        for p, q, old in zip(ours, theirs, before, strict=True):
            assert torch.equal(p, old)  # only read
            assert torch.equal(targets[p], q)
            p.data = targets[p]
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
    assert steps_out_of_place(build()) is expected


def test_a_step_hook_or_a_sparse_gradient_keeps_torchs_own_step() -> None:
    optimizer = _sgd()
    handle = optimizer.register_step_pre_hook(lambda *_: None)
    assert not steps_out_of_place(optimizer)
    handle.remove()
    assert steps_out_of_place(optimizer)
    global_handle = register_optimizer_step_post_hook(lambda *_: None)
    try:
        assert not steps_out_of_place(optimizer)
    finally:
        global_handle.remove()
    param = optimizer.param_groups[0]["params"][0]
    param.grad = torch.sparse_coo_tensor([[0]], [1.0], (2,), check_invariants=True)
    assert not steps_out_of_place(optimizer)


def _stashing_stage(optimizer: type[torch.optim.Optimizer]) -> StageWeights:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    module[2].bias.requires_grad_(False)  # frozen: not in the optimizer, copied with the rest
    return StageWeights(
        module,
        lambda params: optimizer([p for p in params if p.requires_grad], lr=0.1, momentum=0.9, weight_decay=0.01),
        snapshots=True,
    )


def test_a_stashing_stage_writes_its_sgd_update_into_the_spare_storage() -> None:
    """Six 2BW-like updates (the outgoing version kept for a micro-batch in flight each time) with
    ``SGD`` and with a subclass that falls back to copy-then-step: the same weights bitwise, the kept
    version intact, the frozen bias carried into the new storage, and ``SGD.step`` never called on the
    out-of-place stage. Guards against the fast path drifting from the copy path it replaces."""
    stages = [_stashing_stage(torch.optim.SGD), _stashing_stage(_MySGD)]
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
            assert torch.equal(weights.module[2].bias, kept["2.bias"])
            assert len(weights.weight_storages()) == 2
    for ours, theirs in zip(stages[0].params, stages[1].params, strict=True):
        assert torch.equal(ours, theirs)
    assert not torch.equal(stages[0].params[0], _stashing_stage(torch.optim.SGD).params[0])
