"""The captured ``forward`` in words: its layers, what crosses each cut, which modules run whole."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_pipe.capture import CapturedForward
from lightning_pipe.util.units import format_bytes

__all__ = ["describe", "value_text"]


def value_text(value: Any) -> str:
    """A value crossing a cut, briefly: ``4x8x16 float32`` for a tensor, the value otherwise."""
    if isinstance(value, torch.Tensor):
        shape = "x".join(str(d) for d in value.shape) or "scalar"
        return f"{shape} {str(value.dtype).removeprefix('torch.')}"
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


def _bytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def describe(captured: CapturedForward, bounds: Sequence[tuple[int, int]] | None = None) -> str:
    """A table of the layers (name, graph nodes, what crosses the cut after each: the sizes are the
    first micro-batch's), the stage cuts of ``bounds``, and the modules run whole with the reason."""
    nodes = list(captured.graph.graph.nodes)
    shadows = captured.graph.shadows
    cuts = {last for _, last in bounds[:-1]} if bounds else set()
    lines = [f"===== Captured forward: {len(captured.layers)} layers from {len(nodes)} graph nodes ====="]
    width = max(len(spec.name) for spec in captured.specs)
    lines.append(f"{'layer':>5}  {'name':<{width}}  {'nodes':>5}  crosses the cut after it")
    for index, spec in enumerate(captured.specs):
        values = [(nodes[i].name, shadows[nodes[i]].value) for i in spec.carried]
        total = sum(_bytes(value) for _, value in values)
        crossing = ", ".join(f"{name} {value_text(value)}" for name, value in values) if values else "(the output)"
        if values:
            crossing += f" = {format_bytes(total)}"
        marker = "  <- stage cut" if index in cuts else ""
        lines.append(f"{index:>5}  {spec.name:<{width}}  {len(spec.nodes):>5}  {crossing}{marker}")
    for path, reason in captured.graph.leaves.items():
        lines.append(f"runs whole (one layer's part): {path}, as its forward cannot be traced: {reason}")
    return "\n".join(lines)
