"""Properties of the captured layers on random modules (hypothesis): a ``ModuleList`` of blocks where
each block reads a random earlier value (skip connections), mixes in a second input and ends with
functional code, split for 1 to 4 stages.

- The layers chained give ``forward``'s output, bitwise, in both modes.
- What crosses each cut is exactly the set of values defined before it and used after it (the
  liveness oracle computed here from the graph by brute force), placeholders included, parameters
  never.
- The layers hold every parameter, each layer only the modules its nodes call.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_pipe.capture import capture

WIDTH = 4


class _Skips(nn.Module):
    def __init__(self, sources: list[int], gated: list[bool]) -> None:
        super().__init__()
        self.sources, self.gated = sources, gated
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in sources)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        values = [x]
        for block, source, gated in zip(self.blocks, self.sources, self.gated, strict=True):
            h = block(values[source]) + values[-1]
            values.append(torch.tanh(h) * scale if gated else torch.relu(h))
        return {"out": self.head(values[-1]), "skip": values[len(values) // 2].sum(1)}


@st.composite
def _modules(draw: st.DrawFn) -> tuple[_Skips, int]:
    count = draw(st.integers(2, 7))
    sources = [draw(st.integers(0, i)) for i in range(count)]
    gated = draw(st.lists(st.booleans(), min_size=count, max_size=count))
    torch.manual_seed(draw(st.integers(0, 1000)))
    return _Skips(sources, gated), draw(st.integers(1, 4))


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(case=_modules())
def test_layers_chain_to_forward_and_carry_exactly_the_live_values(case: tuple[_Skips, int]) -> None:
    module, stages = case
    x, scale = torch.randn(3, WIDTH), torch.rand(3, 1)
    captured = capture(module, (x, scale), stages=stages)
    for training in (True, False):
        module.train(training)
        for layer in captured.layers:
            layer.training = training
        with torch.no_grad():
            expected = module(x, scale)
            carried = (x, scale)
            for layer in captured.layers:
                carried = layer(carried)
        assert expected.keys() == carried.keys()
        assert all(torch.equal(expected[key], carried[key]) for key in expected)

    nodes = list(captured.graph.graph.nodes)
    layer_of = {nodes[i]: index for index, spec in enumerate(captured.specs) for i in spec.nodes}
    last = len(captured.specs)
    for index, spec in enumerate(captured.specs[:-1]):
        live = {
            position
            for position, node in enumerate(nodes)
            if node.op not in ("get_attr", "output")
            and layer_of.get(node, -1) <= index
            and any(layer_of.get(user, last) > index for user in node.users)
        }
        assert set(spec.carried) == live, (index, spec.name)

    held = {id(p) for layer in captured.layers for p in layer.parameters()}
    assert held == {id(p) for p in module.parameters()}
    for spec, layer in zip(captured.specs, captured.layers, strict=True):
        called = {str(nodes[i].target) for i in spec.nodes if nodes[i].op == "call_module"}
        installed = {name for name, m in layer.code.named_modules() if not list(m.children()) and name}
        assert installed == called, (spec.name, installed, called)
