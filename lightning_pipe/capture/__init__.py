"""Capture a LightningModule's ``forward`` as a graph and cut it into layers a pipeline can split.

:func:`capture` is the whole step: trace (:mod:`.graph`, :mod:`.tracer`), group into layers and build
them (:mod:`.layers`); where the layers branch, :meth:`CapturedForward.reordered` lays them out in
another topological order (:mod:`.layer_order`). The strategy then profiles the layers, partitions
them into stages and verifies the chain (:mod:`.verify`). Around the trace: :mod:`.compiled` (a
``torch.compile``d module's original modules and settings), :mod:`.generation_cache` (``transformers``'
cache off while capturing), :mod:`.module_attributes` (attributes ``forward`` reads, read live or
checked for a change) and :mod:`.describe` (the captured ``forward`` in words).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn
from torch.fx.node import Node

from lightning_pipe.capture.generation_cache import generation_cache_off
from lightning_pipe.capture.graph import CapturedGraph, UntraceableForward, capture_graph
from lightning_pipe.capture.layer_order import layer_dag
from lightning_pipe.capture.layers import GraphLayer, LayerSpec, build_layers, group_nodes, layer_specs
from lightning_pipe.capture.tracer import pipe_split
from lightning_pipe.errors import PlanningError

__all__ = ["CapturedForward", "GraphLayer", "UntraceableForward", "capture", "pipe_split"]


@dataclass
class CapturedForward:
    """``forward`` as layers: what :func:`capture` returns."""

    graph: CapturedGraph
    specs: list[LayerSpec]
    layers: list[GraphLayer]
    cache_off: list[str]  # modules whose transformers generation cache was off (.generation_cache)

    @property
    def grouped(self) -> list[tuple[list[Node], int]]:
        """The layers' nodes, as :func:`~lightning_pipe.capture.layers.group_nodes` gave them."""
        nodes = list(self.graph.graph.nodes)
        return [([nodes[position] for position in spec.nodes], 0) for spec in self.specs]

    def reordered(self, order: Sequence[int]) -> CapturedForward:
        """The same layers (names, modules, parameters) run in ``order``, a topological order of them
        (:func:`~lightning_pipe.capture.layer_order.searched_order`): what crosses each cut follows.
        An order that is not one (a plan file's, of another model) is refused with the first layer it
        puts too early."""
        grouped = self.grouped
        if sorted(order) != list(range(len(grouped))):
            raise PlanningError(
                f"an order of the {len(grouped)} layers must list each once, got {list(order)}: give the layer "
                "names of a plan of this model"
            )
        position = {layer: place for place, layer in enumerate(order)}
        for producer, consumer in layer_dag(self.graph, grouped).edges:
            if position[consumer] < position[producer]:
                raise PlanningError(
                    f"the layers cannot run in this order: {self.specs[consumer].name} would run before "
                    f"{self.specs[producer].name}, which it must follow (it uses what that one computes, or they "
                    "must keep forward's order); give the layer names of a plan of this model, or leave plan= out"
                )
        specs = layer_specs(self.graph, [grouped[i] for i in order])
        specs = [replace(spec, name=self.specs[i].name) for spec, i in zip(specs, order, strict=True)]
        return CapturedForward(self.graph, specs, build_layers(self.graph, specs), self.cache_off)


def capture(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    stages: int = 2,
    layers_per_stage: int = 4,
) -> CapturedForward:
    """``module.forward(*args, **kwargs)`` (one micro-batch) as a chain of :class:`GraphLayer`.

    There are at least ``layers_per_stage × stages`` layers where the module tree allows, and no
    splittable layer holds more than ``1 / (2 × stages)`` of the forward FLOPs. ``transformers``'
    generation cache is off while tracing (:mod:`.generation_cache`)."""
    with generation_cache_off(module) as cache_off:
        graph = capture_graph(module, args, kwargs or {})
    grouped = group_nodes(graph, min_layers=layers_per_stage * stages, max_share=1.0 / (2 * stages))
    specs = layer_specs(graph, grouped)
    return CapturedForward(graph, specs, build_layers(graph, specs), cache_off)
