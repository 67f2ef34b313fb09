"""Each rank holds only its stages: which of the module's tensors a rank keeps, and the release of the
others to the meta device.

Once the stages are placed, a rank keeps the parameters and buffers of the layers of the stages it
runs (a tied parameter, used by layers of several stages, is kept by each of them), and every tensor
of the module that no layer uses (the step code's own: a loss's class weights, a metric's states).
Every other tensor is replaced, in every module that holds it, by a tensor of the same shape and
dtype on the meta device: the module keeps its structure and its names (``state_dict`` lists every
key), the memory is freed, and any use of a released tensor fails loudly instead of computing with
stale values. The user's optimizer (the stages' hyper-parameter template) is rewritten to hold the
replacements too, so that nothing keeps a released tensor alive.

The full model exists again only where it is asked for: gathered by parameter name on global rank 0
when a checkpoint is written (:meth:`Ownership.writer`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["Ownership", "as_parameter_like", "group_names", "parameter_names", "release", "replace", "tensor_ids"]


def tensor_ids(modules: Iterable[nn.Module]) -> set[int]:
    """The identities of every parameter and buffer of ``modules``."""
    return {id(t) for module in modules for t in [*module.parameters(), *module.buffers()]}


def parameter_names(module: nn.Module) -> dict[int, str]:
    """The name of each parameter of ``module`` by the parameter's ``id`` (tensors hash by identity
    only through it), the first name of a parameter held under several."""
    return {id(p): name for name, p in module.named_parameters()}


def group_names(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[str | None]:
    """The name (in ``names``, :func:`parameter_names`) of each parameter of ``optimizer``'s groups, in
    the order of its state dict's positions; ``None`` for a parameter ``names`` lacks."""
    return [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]


@dataclass(frozen=True)
class Ownership:
    """Which state-dict entries each stage holds (``stage_names[s]``) and which no layer holds
    (``outside``: every rank keeps them)."""

    stage_names: tuple[frozenset[str], ...]
    outside: frozenset[str]

    @classmethod
    def of(cls, module: nn.Module, layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]]) -> Ownership:
        state = module.state_dict(keep_vars=True)
        per_stage = []
        for first, last in bounds:
            ids = tensor_ids(layers[first : last + 1])
            per_stage.append(frozenset(name for name, t in state.items() if id(t) in ids))
        inside = frozenset().union(*per_stage)
        return cls(tuple(per_stage), frozenset(state) - inside)

    def names(self, stages: Iterable[int]) -> frozenset[str]:
        """The state-dict entries a rank running ``stages`` holds."""
        return self.outside.union(*(self.stage_names[s] for s in stages))

    def writer(self, name: str, first_owners: Sequence[int], ranks: Sequence[int]) -> int:
        """The global rank that contributes entry ``name`` to a full state: the first worker of the
        first stage holding it (``first_owners[stage]``: :meth:`~lightning_pipe.schedule.ir.Schedule.first_owner`;
        ``ranks``: the global rank of each worker of the first pipeline); rank ``ranks[0]`` for the
        entries outside the layers."""
        for stage, names in enumerate(self.stage_names):
            if name in names:
                return ranks[first_owners[stage]]
        return ranks[0]


def release(roots: Iterable[nn.Module], drop: set[int], optimizers: Iterable[torch.optim.Optimizer] = ()) -> int:
    """Replace every parameter and buffer of the modules under ``roots`` whose identity is in
    ``drop`` by a meta tensor of the same shape (one replacement per tensor, so that a tied parameter
    stays tied), in the modules and in ``optimizers``' parameter groups. Returns the bytes released."""
    found = {id(t): t for root in roots for t in [*root.parameters(), *root.buffers()] if id(t) in drop}
    stand_ins = {
        key: as_parameter_like(tensor, torch.empty_like(tensor, device="meta")) for key, tensor in found.items()
    }
    replace(roots, stand_ins, optimizers)
    return sum(t.numel() * t.element_size() for t in found.values() if not t.is_meta)


def replace(
    roots: Iterable[nn.Module], new: dict[int, Tensor], optimizers: Iterable[torch.optim.Optimizer] = ()
) -> None:
    """Put ``new[id(t)]`` in place of every parameter or buffer ``t`` of the modules under ``roots`` (in
    each module that holds it) and of ``optimizers``' parameter groups; the optimizers' state of a
    replaced parameter is dropped (it belonged to the tensor replaced)."""
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for table in (module._parameters, module._buffers):
                for key, tensor in table.items():
                    if tensor is not None and id(tensor) in new:
                        table[key] = new[id(tensor)]
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [new.get(id(p), p) for p in group["params"]]
        for param in [p for p in optimizer.state if id(p) in new]:
            del optimizer.state[param]


def as_parameter_like(old: Tensor, data: Tensor) -> Tensor:
    """``data`` as a parameter when ``old`` is one (with its ``requires_grad``), else as is."""
    return nn.Parameter(data, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else data
