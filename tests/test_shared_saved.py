"""A storage two neighbouring layers both save (a ReLU's output, then the next layer's input) counts
once in a stage that runs both (``LayerCost.shared_saved_bytes``, ``ChainCosts.saved_between``).

The oracle: the stage's layers run together as one ``nn.Sequential`` under the same saved-tensor count
the profiler uses (each storage once, parameters and buffers left out), on a received input that
takes a gradient (the first stage: the sample as given). Hypothesis draws chains of layers that save
their output (activations), their input (``Linear``), both, or neither, and splits them at random.
Without the correction a stage's saved bytes were the sum of its layers', which counts such a storage
twice: a ResNet-50's blocks end in a ReLU whose output the next block's convolutions save, and the
per-layer sum came to 1.25 times the stages' real saved bytes at 64x64 on the CPU."""

from __future__ import annotations

import itertools

import torch
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.cost.profile_file import profile_from_dict, profile_to_dict
from lightning_pipe.cost.profiler import profile_layers
from lightning_pipe.cost.saved_bytes import saved_bytes
from lightning_pipe.partition import evaluate

WIDTH = 6
KINDS = {
    "linear": lambda: nn.Linear(WIDTH, WIDTH),  # saves its input
    "tanh": nn.Tanh,  # saves its output
    "relu": nn.ReLU,  # saves its output
    "relu_in_place": lambda: nn.ReLU(inplace=True),  # saves its output, its input's storage
    "sigmoid_linear": lambda: nn.Sequential(nn.Sigmoid(), nn.Linear(WIDTH, WIDTH)),  # saves inside only
    "linear_tanh": lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),  # input and output
    "scale": lambda: _Scale(),  # saves nothing of its input or output
}


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


def _measured(layers: list[nn.Module], sample: torch.Tensor) -> int:
    """What the layers save run together, each storage once (the profiler's count)."""
    stage = nn.Sequential(*layers)
    with saved_bytes((*stage.parameters(), *stage.buffers())) as counted:
        stage(sample.clone())
    return counted()


@settings(max_examples=40, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(sorted(KINDS)), min_size=2, max_size=7),
    cuts=st.sets(st.integers(1, 7), max_size=3),
    data=st.booleans(),
)
def test_a_stage_saves_what_its_layers_save_together(kinds: list[str], cuts: set[int], data: bool) -> None:
    """The chain starts with a ``Linear``, as models do (a layer without weights before any would
    take no gradient at all on data that takes none)."""
    torch.manual_seed(0)
    kinds = ["linear", *kinds]
    layers = [KINDS[kind]() for kind in kinds]
    sample = torch.randn(5, WIDTH).requires_grad_(data)
    costs = profile_layers(layers, sample, repeats=1, count_flops=False)
    assert costs.layers[0].shared_saved_bytes == 0
    assert profile_from_dict(profile_to_dict(costs)) == costs  # kept in the profile file
    bounds = [0, *sorted(c for c in cuts if c < len(layers)), len(layers)]
    groups = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
    plan = evaluate(costs, groups, partitioner="hand", devices=len(groups))
    x = sample
    for group, stage in zip(groups, plan.stages, strict=True):
        received = x if group[0] == 0 else x.detach().requires_grad_()
        # the last stage also holds the model's output per micro-batch in flight (ChainCosts.held_between)
        output = costs.layers[-1].activation_bytes if group[-1] == len(layers) - 1 else 0
        assert stage.saved_bytes == _measured([layers[i] for i in group], received) + output, (kinds, groups)
        assert stage.saved_bytes == costs.held_between(group[0], group[-1])
        with torch.no_grad():
            x = nn.Sequential(*[layers[i] for i in group])(received.clone())


def test_a_resnet_stage_keeps_each_block_boundary_once() -> None:
    """torchvision's ResNet-18 by blocks: each block ends in a ReLU whose output the next block's
    first convolution (and downsampling one) saves; one stage of all the blocks saves what the
    whole model saves, not the blocks' sum."""
    torch.manual_seed(0)
    m = torchvision.models.resnet18()
    blocks = [nn.Sequential(m.conv1, m.bn1, m.relu, m.maxpool), *m.layer1, *m.layer2, *m.layer3, *m.layer4]
    sample = torch.randn(2, 3, 32, 32)
    costs = profile_layers(blocks, sample, repeats=1, count_flops=False)
    whole = _measured(blocks, sample)
    assert costs.saved_between(0, len(blocks) - 1) == whole
    assert sum(layer.saved_bytes for layer in costs.layers) > whole  # the sum counts each boundary twice
    # the stem ends in a max pool, which saves its input, not its output; every block ends in a ReLU
    assert costs.layers[1].shared_saved_bytes == 0
    assert all(layer.shared_saved_bytes > 0 for layer in costs.layers[2:])
