"""A model built on the meta device (``Trainer.init_module(empty_init=True)``, ``configure_model``):
each rank materialises and initialises only the tensors of its stages.

The values are those of the whole model materialised at once after seeding: the generator is forked
and seeded with ``torch.initial_seed()`` (what ``seed_everything`` or ``torch.manual_seed`` set), and
every module of the model that defines ``reset_parameters()`` is initialised in module order, as
``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.BatchNorm*``, ``nn.Conv*`` ... do when they are
built. A module whose tensors this rank does not hold is initialised too, on temporary tensors freed
at once (one module at a time), so that the generator advances exactly as for the whole model and
every split gives the same values. For a model built of such modules in the order they are
registered (an ``nn.Sequential``, blocks in a ``ModuleList``), that is also what building it eagerly
after the same seed gives.

A tensor of this rank that no ``reset_parameters()`` sets (a parameter made with ``nn.Parameter`` in a
module without that method, a buffer computed in ``__init__`` such as a causal mask) would hold
uninitialised memory: it is refused by name, with the ways out.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from lightning_pipe.errors import PlanningError
from lightning_pipe.strategy.ownership import as_parameter_like, replace

__all__ = ["MATERIALISED", "materialise", "on_meta"]

MATERIALISED = (
    "The model was built on the meta device: the layers' costs are estimated from their FLOPs and shapes, the "
    "chain is not verified against forward (no values to compare), and each rank materialises and initialises "
    "only its stages (reset_parameters() in module order, seeded with torch.initial_seed())."
)


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def materialise(
    module: nn.Module,
    roots: Iterable[nn.Module],
    keep: set[int],
    device: torch.device,
    optimizers: Iterable[torch.optim.Optimizer] = (),
) -> int:
    """Materialise on ``device`` the meta tensors of ``module`` whose identity is in ``keep``, initialised
    as the module docstring says, in every module under ``roots`` (``module`` among them) and in
    ``optimizers``' parameter groups. Returns the bytes materialised."""
    real: dict[int, Tensor] = {}
    set_by_reset: set[int] = set()
    fork = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=fork, device_type=device.type), torch.no_grad():
        torch.manual_seed(torch.initial_seed())
        for submodule in _unique(module.modules()):
            reset = getattr(submodule, "reset_parameters", None)
            tables = (submodule._parameters, submodule._buffers)
            direct = [(t, k) for t in tables for k, v in t.items() if v is not None and (v.is_meta or id(v) in real)]
            if not callable(reset) or not direct:
                continue
            originals = [table[key] for table, key in direct]
            for table, key in direct:
                tensor = table[key]
                if id(tensor) not in real:  # a kept tensor stays; another is a temporary, freed after the reset
                    fresh = as_parameter_like(tensor, torch.empty_like(tensor, device=device))
                    if id(tensor) in keep:
                        real[id(tensor)] = fresh
                    table[key] = fresh
                else:
                    table[key] = real[id(tensor)]
            reset()
            for (table, key), original in zip(direct, originals, strict=True):
                if id(original) in real:
                    set_by_reset.add(id(original))
                table[key] = original  # the kept ones are put in place everywhere below
    tensors = {id(t): name for name, t in [*module.named_parameters(), *module.named_buffers()]}
    missing = [tensors[k] for k in keep if k in tensors and k not in set_by_reset]
    if missing:
        shown = ", ".join(sorted(missing)[:5]) + (", ..." if len(missing) > 5 else "")
        raise PlanningError(
            f"the model was built on the meta device (init_module(empty_init=True) or configure_model), and no "
            f"reset_parameters() sets {shown}: they would hold uninitialised memory. Give the module that owns them a "
            "reset_parameters() that sets them (a buffer computed in __init__, such as a causal mask, included), or "
            "build the model with real tensors (init_module() without empty_init=True)"
        )
    replace(roots, real, optimizers)
    return sum(t.numel() * t.element_size() for t in real.values())


def _unique(modules: Iterable[nn.Module]) -> list[nn.Module]:
    seen: set[int] = set()
    return [m for m in modules if not (id(m) in seen or seen.add(id(m)))]
