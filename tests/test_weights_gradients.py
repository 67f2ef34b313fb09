"""A stage's gradient buffers when the backwards of two steps and added weight gradients interleave:
each step gets exactly its own micro-batches' gradients, however the buffer was lent to the leaves
and taken back in between; a step carried into the next without an update (gradient accumulation)
adds into the next step's gradient."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.runtime.weights import StageWeights

_OPERATIONS = st.lists(st.tuples(st.sampled_from(["B", "add", "state"]), st.integers(0, 1)), min_size=1, max_size=12)


@given(operations=_OPERATIONS, seed=st.integers(0, 2**16))
def test_interleaved_backwards_accumulate_into_their_own_step(operations: list[tuple[str, int]], seed: int) -> None:
    """Backwards of steps 0 and 1 on the same leaves, weight gradients added from elsewhere (a split
    backward's ``W``) and ``state_dict`` reads, in any order: each step's gradient is the sum of its
    own contributions (computed independently), and no leaf keeps a gradient once taken. Guards the
    buffer lent across consecutive backwards against leaking into another step or being read stale."""
    torch.manual_seed(seed)
    weights = StageWeights(nn.Sequential(nn.Linear(3, 2), nn.Tanh()), None, snapshots=True)
    leaves = weights.leaves(0)
    expected: dict[int, list[torch.Tensor]] = {}
    for kind, step in operations:
        if kind == "state":
            saved = weights.state_dict()["gradients"]
            assert set(saved) == set(expected)
            for s, grads in expected.items():
                for got, want in zip(saved[s], grads, strict=True):
                    torch.testing.assert_close(got, want)
            continue
        x = torch.randn(4, 3)
        reference = [t.detach().clone().requires_grad_() for t in leaves.values()]
        out = torch.func.functional_call(weights.module, dict(zip(leaves, reference, strict=True)), (x,))
        contribution = torch.autograd.grad(out.square().sum(), reference)
        if kind == "B":
            weights.backward(step, leaves, [weights.forward(leaves, x).square().sum()], None, [])
        else:
            weights.add(step, [g.clone() for g in contribution])
        sums = expected.setdefault(step, [torch.zeros_like(g) for g in contribution])
        for total, g in zip(sums, contribution, strict=True):
            total += g
    for step, sums in expected.items():
        for got, want in zip(weights.pop_gradients(step), sums, strict=True):
            torch.testing.assert_close(got, want)
    assert all(leaf.grad is None for leaf in leaves.values())
    assert not weights.gradients


@given(
    steps=st.lists(st.tuples(st.integers(1, 3), st.booleans()), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_steps_carried_without_an_update_are_applied_together(steps: list[tuple[int, bool]], seed: int) -> None:
    """Gradient accumulation over steps (a flushing schedule's live weights): each step runs some
    backwards, then either carries its gradient into the next step or updates (the last one always
    does). Every update applies the sum of the gradients since the last one, computed independently,
    the weights stay put in between, and the version counts every step (each step computes with the
    version of its number). Guards against a carried gradient lost, applied twice, or added to a step
    it does not belong to."""
    torch.manual_seed(seed)
    weights = StageWeights(nn.Linear(3, 2), lambda params: torch.optim.SGD(params, lr=0.5), snapshots=False)
    expected = [p.detach().clone() for p in weights.params]
    pending = [torch.zeros_like(p) for p in expected]
    steps[-1] = (steps[-1][0], True)
    for step, (backwards, updates) in enumerate(steps):
        leaves = weights.leaves(step)
        for _ in range(backwards):
            x = torch.randn(4, 3)
            reference = [t.detach().clone().requires_grad_() for t in expected]
            out = torch.func.functional_call(weights.module, dict(zip(leaves, reference, strict=True)), (x,))
            for total, g in zip(pending, torch.autograd.grad(out.tanh().sum(), reference), strict=True):
                total += g
            weights.backward(step, leaves, [weights.forward(leaves, x).tanh().sum()], None, [])
        if updates:
            weights.update(step, set())
            expected = [p - 0.5 * g for p, g in zip(expected, pending, strict=True)]
            pending = [torch.zeros_like(p) for p in expected]
        else:
            weights.carry(step)
        for got, want in zip(weights.params, expected, strict=True):
            torch.testing.assert_close(got.detach(), want)
    assert weights.version == len(steps)
    assert not weights.gradients and all(p.grad is None for p in weights.params)
