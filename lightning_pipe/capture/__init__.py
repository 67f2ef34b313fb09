"""Capture a LightningModule's ``forward`` as a graph and cut it into layers a pipeline can split.

:func:`capture` is the whole step: trace (:mod:`.graph`, :mod:`.tracer`), group into layers and build
them (:mod:`.layers`). The strategy then profiles the layers, partitions them into stages and
verifies the chain (:mod:`.verify`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_pipe.capture.generation_cache import generation_cache_off
from lightning_pipe.capture.graph import CapturedGraph, UntraceableForward, capture_graph
from lightning_pipe.capture.layers import GraphLayer, LayerSpec, build_layers, group_nodes, layer_specs
from lightning_pipe.capture.tracer import pipe_split

__all__ = ["CapturedForward", "GraphLayer", "UntraceableForward", "capture", "pipe_split"]


@dataclass
class CapturedForward:
    """``forward`` as layers: what :func:`capture` returns."""

    graph: CapturedGraph
    specs: list[LayerSpec]
    layers: list[GraphLayer]
    cache_off: list[str]  # modules whose transformers generation cache was off (.generation_cache)


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
