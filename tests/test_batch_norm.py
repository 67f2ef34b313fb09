"""The deferred batch norm statistics (``lightning_pipe/runtime/batch_norm.py``) against a reference
computed directly: when a step commits, each layer's running mean and variance move once, as
``torch.var_mean`` over all the rows its forwards of that step saw (unbiased) moves them with the
layer's momentum (the cumulative average for ``momentum=None``), and ``num_batches_tracked`` by one;
the micro-batch forwards leave the layer's own statistics untouched until then. Hypothesis draws the
micro-batch sizes (uneven ones too), the momenta and two steps' forwards interleaved, as a
non-flushing schedule runs them."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_pipe.runtime.batch_norm import DeferredNorms, running_forward


class _Stage(nn.Module):
    """Batch norms of two widths and ranks: 2-d over 3 channels, 2-d over 5, 1-d over 5."""

    def __init__(self, momenta: tuple[float | None, ...] = (0.1, 0.1, 0.1)) -> None:
        super().__init__()
        self.first = nn.BatchNorm2d(3, momentum=momenta[0])
        self.conv = nn.Conv2d(3, 5, 1)
        self.second = nn.BatchNorm2d(5, momentum=momenta[1])
        self.last = nn.BatchNorm1d(5, momentum=momenta[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.second(self.conv(self.first(x))).mean(dim=(2, 3)))

    def norms(self) -> tuple[_BatchNorm, ...]:
        return self.first, self.second, self.last


class _Reference:
    """Each layer's statistics as the unsplit model moves them, once per step by all its rows."""

    def __init__(self, layer: _BatchNorm) -> None:
        self.momentum = layer.momentum
        self.mean, self.var = layer.running_mean.clone(), layer.running_var.clone()
        self.count = int(layer.num_batches_tracked)

    def move(self, rows: torch.Tensor) -> None:
        variance, mean = torch.var_mean(rows, dim=[d for d in range(rows.dim()) if d != 1], correction=1)
        self.count += 1
        momentum = self.momentum if self.momentum is not None else 1.0 / self.count
        self.mean = self.mean * (1 - momentum) + mean * momentum
        self.var = self.var * (1 - momentum) + variance * momentum


momentum = st.sampled_from([0.1, 0.5, None])


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(2, 5), min_size=1, max_size=4), min_size=1, max_size=3),
    momenta=st.tuples(momentum, momentum, momentum),
    interleave=st.booleans(),
)
def test_running_statistics_move_once_per_step_by_all_its_rows(
    sizes: list[list[int]], momenta: tuple[float | None, ...], interleave: bool
) -> None:
    """``sizes[s]`` are the rows of step ``s``'s micro-batches; with ``interleave`` the forwards of
    consecutive steps alternate and each step commits after its last forward."""
    torch.manual_seed(0)
    stage = _Stage(momenta).train()
    norms = DeferredNorms(stage)
    own = {layer: (layer.running_mean, layer.running_var, layer.num_batches_tracked) for layer in stage.norms()}
    references = {layer: _Reference(layer) for layer in stage.norms()}
    seen: dict[tuple[_BatchNorm, int], list[torch.Tensor]] = {}
    current = [0]
    for layer in stage.norms():
        layer.register_forward_pre_hook(
            lambda m, args: seen.setdefault((m, current[0]), []).append(args[0].detach().clone())
        )
    batches = [[torch.randn(n, 3, 2, 2) * (1 + s) + s for n in step] for s, step in enumerate(sizes)]
    order = [(s, k) for s, step in enumerate(batches) for k in range(len(step))]
    if interleave:
        order.sort(key=lambda sk: (sk[0] + sk[1], sk[0]))
    left = {s: len(step) for s, step in enumerate(batches)}
    for s, k in order:
        before = {layer: (layer.running_mean.clone(), layer.running_var.clone()) for layer in stage.norms()}
        current[0] = s
        with running_forward(s, k):
            output = stage(batches[s][k])
        output.square().sum().backward()  # the backward nodes hold the scratch rows, unchanged since
        for layer in stage.norms():
            assert (layer.running_mean, layer.running_var, layer.num_batches_tracked) == own[layer]
            assert torch.equal(layer.running_mean, before[layer][0]) and torch.equal(
                layer.running_var, before[layer][1]
            )
        left[s] -= 1
        if left[s] == 0:
            norms.commit(s)
            for layer in stage.norms():
                references[layer].move(torch.cat(seen[(layer, s)]))
    for layer, reference in references.items():
        torch.testing.assert_close(layer.running_mean, reference.mean)
        torch.testing.assert_close(layer.running_var, reference.var)
        assert int(layer.num_batches_tracked) == reference.count
        assert layer.momentum == reference.momentum
    assert not norms.pending


def test_a_layer_called_twice_in_one_forward_trains() -> None:
    """A batch norm used twice in one forward: each call's backward holds rows of its own (the
    second call does not write into the rows the first call's backward checks)."""
    layer = nn.BatchNorm1d(4)
    norms = DeferredNorms(layer)
    with running_forward(0, 0):
        output = layer(layer(torch.randn(6, 4)))
    output.square().sum().backward()
    norms.commit(0)
    assert int(layer.num_batches_tracked) == 1 and torch.isfinite(layer.running_var).all()


def test_a_forward_that_fails_half_way_leaves_nothing_behind() -> None:
    """A batch norm forward that raises after its pre-hook (a wrong width) leaves the layer swapped;
    the next forward puts its statistics back first, and the step commits the good forward alone."""
    layer = nn.BatchNorm1d(4)
    own = layer.running_mean
    norms = DeferredNorms(layer)
    with pytest.raises(RuntimeError), running_forward(0, 0):
        layer(torch.randn(6, 3))
    rows = torch.randn(6, 4) * 3 + 1
    with running_forward(0, 0):
        layer(rows)
    norms.commit(0)
    reference = _Reference(nn.BatchNorm1d(4))
    reference.move(rows)
    assert layer.running_mean is own and layer.momentum == 0.1
    torch.testing.assert_close(layer.running_mean, reference.mean)
    torch.testing.assert_close(layer.running_var, reference.var)


def test_forwards_outside_a_running_forward_leave_batch_norm_as_it_is() -> None:
    """Evaluation and forwards outside :func:`running_forward` (profiling, verification) are plain."""
    layer, plain = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    DeferredNorms(layer)
    x = torch.randn(6, 4)
    torch.testing.assert_close(layer(x), plain(x))
    torch.testing.assert_close(layer.running_mean, plain.running_mean)
    assert int(layer.num_batches_tracked) == 1


def test_a_copy_of_the_stage_runs_the_hooks_on_its_own_layers() -> None:
    """A kept weight version's replica (``copy.deepcopy`` of the stage, its hooks copied with it,
    ``lightning_pipe/runtime/weights.py``) sharing the stage's buffers: its forward puts back its
    own layer's statistics, not the stage's, and the step's rows still count once."""
    stage = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    norms = DeferredNorms(stage)
    buffers = {id(b): b for b in stage.buffers()}
    replica = copy.deepcopy(stage, {key: value for key, value in buffers.items()})
    rows = torch.randn(6, 4)
    with running_forward(0, 0):
        replica(rows)
    for layer in (stage[1], replica[1]):
        assert layer.num_batches_tracked is stage[1].num_batches_tracked and layer.momentum == 0.1
        assert layer.running_mean is stage[1].running_mean
    norms.commit(0)
    assert int(stage[1].num_batches_tracked) == 1
