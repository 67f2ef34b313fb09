"""Nested structures of tensors: tuples (named ones included), lists, mappings (dicts, and the
``UserDict`` a ``transformers`` tokenizer or collator returns, ``BatchEncoding``) and dataclasses (a
``transformers`` ``ModelOutput`` is both a dict and a dataclass) with tensors inside.

What a layer or a pipeline stage takes and returns. :func:`flatten` separates a picklable skeleton from
the tensors (how the runtime sends a message), :func:`unflatten` puts them back, and
:func:`map_tensors` / :func:`tensors` are the everyday shortcuts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["concatenate", "flatten", "map_tensors", "nbytes", "tensors", "to_cpu", "unflatten"]


def flatten(obj: Any, leaf: type | tuple[type, ...] = torch.Tensor) -> tuple[Any, list[Any]]:
    """A picklable skeleton of ``obj`` with its tensors (its instances of ``leaf``) replaced by slots,
    and the tensors in order."""
    found: list[Any] = []
    return _walk(obj, found, leaf), found


def _walk(item: Any, found: list[Any], leaf: type | tuple[type, ...]) -> Any:
    """:func:`flatten`'s recursion: a module-level function, not a closure over ``found`` (a recursive
    closure is a reference cycle: the tensors would wait for the garbage collector to be freed)."""
    if isinstance(item, leaf):
        found.append(item)
        return ("tensor", len(found) - 1)
    if isinstance(item, tuple | list):
        return ("sequence", type(item), [_walk(x, found, leaf) for x in item])
    if isinstance(item, Mapping):
        return ("dict", type(item), [(key, _walk(value, found, leaf)) for key, value in item.items()])
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        fields = [f.name for f in dataclasses.fields(item) if f.init]
        return ("dict", type(item), [(name, _walk(getattr(item, name), found, leaf)) for name in fields])
    return ("value", item)


def unflatten(skeleton: Any, values: list[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten`, with ``values`` in the tensors' places."""
    kind = skeleton[0]
    if kind == "tensor":
        return values[skeleton[1]]
    if kind == "sequence":
        kind, cls, children = skeleton
        items = [unflatten(child, values) for child in children]
        return cls(*items) if hasattr(cls, "_fields") else cls(items)
    if kind == "dict":
        _, cls, children = skeleton
        items = {key: unflatten(child, values) for key, child in children}
        return cls(**items) if dataclasses.is_dataclass(cls) else cls(items)
    return skeleton[1]


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``, in order."""
    if isinstance(obj, torch.Tensor):  # the common case, on every micro-batch: no skeleton to build
        return [obj]
    return flatten(obj)[1]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor, its structure kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    skeleton, found = flatten(obj)
    return unflatten(skeleton, [fn(t) for t in found])


def nbytes(obj: Any) -> int:
    """Bytes of every tensor in ``obj``."""
    return sum(t.numel() * t.element_size() for t in tensors(obj))


def concatenate(parts: list[Any], rows: list[int]) -> Any:
    """Micro-batches' predictions joined back into the batch's (``rows``: each part's samples): tensors
    along dim 0 (0-dim ones stacked), a list of one prediction per sample chained (:func:`_per_sample`),
    other lists, tuples, mappings and dataclasses joined element by element into their own type (a list of
    feature maps stays one map per level; a ``transformers`` ``ModelOutput`` stays one, its ``.loss``
    readable), a value every part holds the same kept once (else the parts' values in a list); one
    part is the batch's as it is."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else torch.stack(parts)
    if isinstance(first, list) and _per_sample(parts, rows):
        return [item for part in parts for item in part]
    if isinstance(first, tuple | list | Mapping) or (dataclasses.is_dataclass(first) and not isinstance(first, type)):
        skeleton, _ = flatten(first, leaf=())
        return _joined(skeleton, parts, rows)
    return first if all(_equal(part, first) for part in parts[1:]) else parts


def _per_sample(parts: list[list[Any]], rows: list[int]) -> bool:
    """Whether the parts' lists hold one prediction per sample (a detector's dict of boxes per image:
    chained) rather than one structure per micro-batch (a backbone's feature maps, each with the
    micro-batch's rows, as :func:`~lightning_pipe.runtime.batches.split_batch` splits them: joined
    element by element): their lengths differ, or each is its part's rows long and its items are not
    all tensors with those rows."""
    if len({len(part) for part in parts}) > 1:
        return True
    return all(
        len(part) == n and not all(_has_rows(item, n) for item in part) for part, n in zip(parts, rows, strict=True)
    )


def _has_rows(item: Any, rows: int) -> bool:
    return isinstance(item, torch.Tensor) and item.dim() > 0 and item.shape[0] == rows


def _joined(skeleton: Any, parts: list[Any], rows: list[int]) -> Any:
    """The parts of a list, tuple, dict or dataclass (``skeleton``: the first's, from :func:`flatten`)
    joined element by element, rebuilt as :func:`unflatten` rebuilds its type."""
    kind, cls, children = skeleton
    if kind == "sequence":
        items = [concatenate(list(column), rows) for column in zip(*parts, strict=True)]
        return cls(*items) if hasattr(cls, "_fields") else cls(items)
    fields = {key: concatenate([_field(part, key) for part in parts], rows) for key, _ in children}
    return cls(**fields) if dataclasses.is_dataclass(cls) else cls(fields)


def _field(part: Any, key: str) -> Any:
    return part[key] if isinstance(part, Mapping) else getattr(part, key)


def _equal(one: Any, other: Any) -> bool:
    """Whether two values that are not containers of tensors are the same (``False`` where ``==``
    does not answer with one truth value, as between arrays)."""
    try:
        return one is other or bool(one == other)
    except (TypeError, ValueError, RuntimeError):
        return False


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor detached and on the CPU (for gathering between processes)."""
    return map_tensors(lambda t: t.detach().cpu(), obj)
