"""Save and load profiles: lightning_pipe's JSON format, and PipeDream's ``graph.txt``.

The JSON format (``"format": "lightning_pipe.profile"``, ``"version": 1``)::

    {
      "format": "lightning_pipe.profile",
      "version": 1,
      "name": "vgg19",
      "layers": [
        {"name": "features.0:Conv2d", "forward_seconds": 0.0123, "backward_seconds": 0.0251,
         "activation_bytes": 25690112, "saved_bytes": 602112, "param_bytes": 7168,
         "flops": 2774532096, "kept_gradient_bytes": 0, "shared_saved_bytes": 0,
         "backward_bytes": 51380224},
        ...
      ],
      "boundary_bytes": [25690112, ...],
      "shared": [{"layers": [0, 13], "param_bytes": 8388608}],
      "notes": ["..."],
      "meta": {"batch_size": 8, "device": "cpu", "warmup": 1, "repeats": 5, "torch": "2.14.1"}
    }

Times are seconds and sizes bytes, for one micro-batch of ``meta.batch_size``. ``flops`` may be
``null``; ``kept_gradient_bytes`` (what a backward split in two halves keeps between them),
``shared_saved_bytes`` (the input a layer saves that the layer before saved too) and
``backward_bytes`` (what the layer's backward holds at its peak beyond its saved activations and
its parameters' gradients) are 0 when absent, as in profiles written before they were measured;
``largest_param_bytes`` and ``first_backward_bytes`` (what a step's first backward holds beyond the
gradients it leaves) are ``null`` when not measured; ``boundary_bytes`` (bytes crossing the cut
after each layer, ``L - 1`` entries), ``shared`` (the parameters several layers use, counted in each
one's ``param_bytes``: tied weights), ``notes`` and ``meta`` are optional.
"""

from __future__ import annotations

import json
from pathlib import Path

from lightning_pipe.cost.pipedream_graph import parse_pipedream_graph
from lightning_pipe.cost.records import ChainCosts, LayerCost, SharedParameters
from lightning_pipe.errors import PlanningError
from lightning_pipe.util.files import json_kind, parse_json, read_text

__all__ = ["FORMAT", "load_profile", "profile_from_dict", "profile_to_dict", "save_profile"]

FORMAT = "lightning_pipe.profile"
VERSION = 1
_LAYER_FIELDS = ("forward_seconds", "backward_seconds", "activation_bytes", "saved_bytes", "param_bytes")


def profile_to_dict(costs: ChainCosts) -> dict[str, object]:
    """The JSON document of a profile."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "name": costs.name,
        "layers": [
            {
                "name": layer.name,
                **{key: getattr(layer, key) for key in _LAYER_FIELDS},
                "flops": layer.flops,
                "kept_gradient_bytes": layer.kept_gradient_bytes,
                "shared_saved_bytes": layer.shared_saved_bytes,
                "backward_bytes": layer.backward_bytes,
                "largest_param_bytes": layer.largest_param_bytes,
                "first_backward_bytes": layer.first_backward_bytes,
            }
            for layer in costs.layers
        ],
        "boundary_bytes": list(costs.boundary_bytes),
        "shared": [{"layers": list(group.layers), "param_bytes": group.param_bytes} for group in costs.shared],
        "notes": list(costs.notes),
        "meta": dict(costs.meta),
    }


def _layer(entry: object, index: int, source: str) -> LayerCost:
    if not isinstance(entry, dict):
        raise PlanningError(f"{source}: layers[{index}] must be an object, got {json_kind(entry)} {entry!r}")
    missing = [key for key in _LAYER_FIELDS if key not in entry]
    if missing:
        raise PlanningError(f"{source}: layers[{index}] lacks {', '.join(missing)}")
    name = entry.get("name", f"layer{index}")
    if not isinstance(name, str):
        raise PlanningError(f"{source}: layers[{index}] name must be a string, got {json_kind(name)} {name!r}")
    try:
        return LayerCost(
            name=name,
            flops=entry.get("flops"),
            kept_gradient_bytes=entry.get("kept_gradient_bytes", 0.0),
            shared_saved_bytes=entry.get("shared_saved_bytes", 0.0),
            backward_bytes=entry.get("backward_bytes", 0.0),
            largest_param_bytes=entry.get("largest_param_bytes"),
            first_backward_bytes=entry.get("first_backward_bytes"),
            **{key: entry[key] for key in _LAYER_FIELDS},
        )
    except PlanningError as error:
        raise PlanningError(f"{source}: layers[{index}]: {error}") from None


def _shared(entry: object, index: int, source: str) -> SharedParameters:
    if not isinstance(entry, dict) or not isinstance(entry.get("layers"), list):
        raise PlanningError(f'{source}: shared[{index}] must be an object with "layers" and "param_bytes": {entry!r}')
    try:
        return SharedParameters(tuple(entry["layers"]), entry.get("param_bytes", 0.0))
    except (PlanningError, TypeError) as error:
        raise PlanningError(f"{source}: shared[{index}]: {error}") from None


def profile_from_dict(document: object, source: str = "profile") -> ChainCosts:
    """Read a JSON document written by :func:`profile_to_dict`."""
    if not isinstance(document, dict):
        raise PlanningError(
            f"{source}: not a lightning_pipe profile: a profile is a JSON object (lightning-pipe plan --save-profile "
            f"writes one), got a JSON {json_kind(document)}"
        )
    if document.get("format") != FORMAT:
        raise PlanningError(f'{source}: not a lightning_pipe profile (missing "format": "{FORMAT}")')
    if document.get("version") != VERSION:
        raise PlanningError(f"{source}: profile version {document.get('version')!r}; this release reads {VERSION}")
    layers = document.get("layers")
    if not isinstance(layers, list):
        raise PlanningError(f'{source}: "layers" must be a list of layer objects, got {json_kind(layers)}')
    optional = (("boundary_bytes", list, []), ("shared", list, []), ("notes", list, []), ("meta", dict, {}))
    for key, kind, empty in (*optional, ("name", str, "")):
        if not isinstance(document.get(key, empty), kind):
            raise PlanningError(
                f'{source}: "{key}" must be a JSON {json_kind(empty)}, got {json_kind(document[key])} {document[key]!r}'
            )
    try:
        return ChainCosts(
            layers=tuple(_layer(entry, i, source) for i, entry in enumerate(layers)),
            boundary_bytes=tuple(document.get("boundary_bytes", ())),
            shared=tuple(_shared(entry, i, source) for i, entry in enumerate(document.get("shared", []))),
            name=document.get("name", ""),
            notes=tuple(map(str, document.get("notes", ()))),
            meta=document.get("meta", {}),
        )
    except PlanningError as error:
        message = str(error)
        raise PlanningError(message if message.startswith(source) else f"{source}: {message}") from None


def save_profile(costs: ChainCosts, path: str | Path) -> None:
    """Write a profile as JSON."""
    Path(path).write_text(json.dumps(profile_to_dict(costs), indent=1) + "\n")


def load_profile(path: str | Path) -> ChainCosts:
    """Load a JSON profile or a PipeDream ``graph.txt`` (recognised by content: JSON, or text that
    starts as a JSON object or list does, is a JSON profile)."""
    text = read_text(path, "profile")
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        if text.lstrip().startswith(("{", "[")):
            parse_json(text, path, "profile")  # raises, naming the line
        return parse_pipedream_graph(text, source=str(path))
    return profile_from_dict(document, source=str(path))
