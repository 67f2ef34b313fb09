"""Read plan files: what ``lightning-pipe plan --json`` prints and the ``plan.json`` of a run.

A plan is a JSON object whose ``"stages"`` list gives each stage's ``"layers"`` (``[first, last]``
indices into the model's layers, or every layer of a non-contiguous stage) and ``"replicas"``
(workers; 1 when absent), beside the stages' costs and the plan's totals (``Plan.to_dict``). Two
optional keys say which model it was made for: ``"layers"``, the model's layer count (the stages'
last layer + 1 when absent), and ``"layer_names"``, the names the strategy gave them. The costs are
read by :meth:`~lightning_pipe.schedule.StageCosts.from_plan`; :func:`load_plan` reads the rest, and
refuses a file that is not such an object with its path and what is wrong.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lightning_pipe.errors import PlanningError, check_whole
from lightning_pipe.util.files import json_kind, read_json

__all__ = ["PlanFile", "load_plan"]

_MAKE_ONE = "lightning-pipe plan --json prints one, and every run of the strategy writes its plan.json"


@dataclass(frozen=True)
class PlanFile:
    """A plan file's stages and the model it describes.

    Attributes:
        path: the file.
        document: its JSON object.
        stages: each stage's layers as written (``(first, last)`` for a contiguous plan).
        replicas: each stage's workers.
        contiguous: whether each stage is a ``[first, last]`` range.
        layers: the layer count of the model it was made for.
        names: that model's layer names, when the plan records them.
    """

    path: str
    document: dict[str, Any]
    stages: tuple[tuple[int, ...], ...]
    replicas: tuple[int, ...]
    contiguous: bool
    layers: int
    names: tuple[str, ...] | None


def load_plan(path: str | os.PathLike[str]) -> PlanFile:
    """The plan in ``path`` (module docstring), its structure checked."""
    document = read_json(path, "plan")
    if not isinstance(document, dict):
        raise PlanningError(
            f'{path} is not a plan: a plan is a JSON object with a "stages" list ({_MAKE_ONE}); got a JSON '
            f"{json_kind(document)}"
        )
    stages = document.get("stages")
    if not isinstance(stages, list) or not stages:
        found = "has no" if stages is None else f"has a {json_kind(stages)} for its"
        raise PlanningError(
            f'{path} {found} "stages": a plan lists its stages, each with "layers": [first, last] ({_MAKE_ONE})'
        )
    spans = tuple(_layers(stage, i, path) for i, stage in enumerate(stages))
    replicas = tuple(stage.get("replicas", 1) for stage in stages)
    for i, count in enumerate(replicas):
        check_whole(f'{path}: stages[{i}]["replicas"]', count, 1, "workers")
    contiguous = document.get("contiguous", True)
    if not isinstance(contiguous, bool):
        raise PlanningError(f'{path}: "contiguous" must be true or false; got {contiguous!r}')
    count = document.get("layers", max(max(span) for span in spans) + 1)
    check_whole(f'{path}: "layers" (the layer count of the model it was made for)', count, 1, "layers")
    names = document.get("layer_names")
    if names is not None and not (
        isinstance(names, list) and len(names) == count and all(isinstance(n, str) for n in names)
    ):
        raise PlanningError(
            f'{path}: "layer_names" must list the names of its {count} layers as strings; got {names!r}'
        )
    return PlanFile(str(path), document, spans, replicas, contiguous, count, None if names is None else tuple(names))


def _layers(stage: object, index: int, path: str | os.PathLike[str]) -> tuple[int, ...]:
    """Stage ``index``'s ``"layers"``: whole layer indices."""
    if not isinstance(stage, dict):
        raise PlanningError(
            f'{path}: stages[{index}] must be an object with "layers": [first, last]; got a JSON {json_kind(stage)}'
        )
    if "layers" not in stage:
        raise PlanningError(f'{path}: stages[{index}] lacks "layers", the [first, last] indices of its layers')
    layers = stage["layers"]
    if not (isinstance(layers, list) and layers and all(_index(i) for i in layers)):
        raise PlanningError(
            f'{path}: stages[{index}]["layers"] must be the [first, last] indices of its layers (whole numbers '
            f">= 0); got {layers!r}"
        )
    return tuple(layers)


def _index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
