"""The layers of a branching ``forward`` in the order that splits best, against the recorded order.

Run: ``python bench/layer_order.py [--repeats N]``. For torchvision's GoogLeNet (96x96), Inception-v3
(299x299) and ResNet-18 (32x32), all without auxiliary heads, and a two-tower model (a ResNet-18
image tower and a four-layer transformer text tower joined by a linear head, the shape of a
multimodal classifier), each captured for 2, 4 and 8 stages, the table gives:

- ``layers``, ``branching``: the captured layers, and the adjacent pairs of them with no edge between
  (0: the layers form a chain, and there is no other order);
- ``states``: the downsets of the layer graph the search walks;
- ``FLOP rec``/``FLOP best``: with layers weighed by FLOPs, the bottleneck of the best straight split
  of the recorded order and of the searched order, over the ideal (total / stages);
- where the layers branch, measured: each order's layers profiled (``profile_layers``, CPU, median of
  ``--repeats``) and split by the ``pipedream`` partitioner (straight, free links), the slowest stage
  over the ideal: ``rec`` the recorded order, ``FLOP order`` the one :func:`searched_order` picks by
  FLOPs, ``timed order`` the one it picks from the recorded layers' measured times, as the strategy
  does (``-``: the recorded order kept, the gain under ``GAIN``);
- ``ms``: the timed search's time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torchvision.models as tv
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_pipe.capture.graph import CapturedGraph, capture_graph
from lightning_pipe.capture.layer_order import GAIN, MAX_ORDER_STATES, layer_dag, searched_order
from lightning_pipe.capture.layers import build_layers, group_nodes, layer_specs
from lightning_pipe.cost.pipedream_graph import LayerDag
from lightning_pipe.cost.profiler import profile_layers
from lightning_pipe.partition import PlanRequest, partition
from lightning_pipe.partition.antichain import antichain_plan, downsets

STAGES = (2, 4, 8)


class TwoTowers(nn.Module):
    """An image tower (ResNet-18 features) and a text tower (a transformer encoder over tokens)."""

    def __init__(self, vocab: int = 1000, width: int = 256) -> None:
        super().__init__()
        self.image = tv.resnet18(num_classes=width)
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.text = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(2 * width, 10)

    def forward(self, image: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        text = self.text(self.embed(tokens)).mean(dim=1)
        return self.head(torch.cat([self.image(image), text], dim=1))


def _models() -> list[tuple[str, Callable[[], nn.Module], tuple[torch.Tensor, ...]]]:
    return [
        ("GoogLeNet", lambda: tv.googlenet(aux_logits=False, init_weights=False), (torch.randn(8, 3, 96, 96),)),
        ("Inception-v3", lambda: tv.inception_v3(aux_logits=False, init_weights=False), (torch.randn(2, 3, 299, 299),)),
        ("ResNet-18", tv.resnet18, (torch.randn(8, 3, 32, 32),)),
        ("two towers", TwoTowers, (torch.randn(8, 3, 64, 64), torch.randint(0, 1000, (8, 64)))),
    ]


def _measured(graph: CapturedGraph, grouped: list, sample: tuple, stages: int, repeats: int) -> tuple[float, list]:
    """The slowest stage of the best straight split of these layers, profiled, over the ideal; and
    each layer's (forward, backward) seconds."""
    layers = build_layers(graph, layer_specs(graph, grouped))
    costs = profile_layers(layers, sample, repeats=repeats, count_flops=False)
    plan = partition(PlanRequest(costs, stages, straight=True), "pipedream")
    seconds = [(layer.forward_seconds, layer.backward_seconds) for layer in costs.layers]
    return plan.bottleneck_seconds / (sum(layer.seconds for layer in costs.layers) / stages), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per layer in each profile")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(
        "| model | stages | layers | branching | states | FLOP rec | FLOP best | rec | FLOP order | timed order | ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, build, sample in _models():
        model = build().train()
        graph = capture_graph(model, sample, {})
        for stages in STAGES:
            grouped = group_nodes(graph, min_layers=4 * stages, max_share=1.0 / (2 * stages))
            dag = layer_dag(graph, grouped)
            chain = LayerDag(dag.layers, (*dag.edges, *((i, i + 1) for i in range(len(grouped) - 1))))
            branching = len(set(chain.edges)) - len(set(dag.edges))
            ideal = sum(layer.seconds for layer in dag.layers) / stages
            states = len(downsets(dag, MAX_ORDER_STATES))
            flops = (antichain_plan(g, stages, straight=True).bottleneck_seconds / ideal for g in (chain, dag))
            row = [name, stages, len(grouped), branching, states, *(f"{r:.3f}" for r in flops)]
            took = 0.0
            if branching:
                recorded, seconds = _measured(graph, grouped, sample, stages, args.repeats)
                start = time.perf_counter()
                timed = searched_order(graph, grouped, stages, seconds)
                took = 1e3 * (time.perf_counter() - start)
                row.append(f"{recorded:.3f}")
                for order in (searched_order(graph, grouped, stages), timed):
                    if order is None:
                        row.append("-")
                        continue
                    ratio = _measured(graph, [grouped[i] for i in order], sample, stages, args.repeats)[0]
                    row.append(f"{ratio:.3f}")
            else:
                row += ["", "", ""]
            print("| " + " | ".join(str(cell) for cell in [*row, f"{took:.0f}"]) + " |")
    print(f"\nan order is used when its bottleneck is at least {GAIN:.0%} below the recorded order's")


if __name__ == "__main__":
    main()
