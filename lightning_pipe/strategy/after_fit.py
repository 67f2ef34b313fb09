"""The module after ``fit``: each rank holds only its stages, as under FSDP, unless the user asks for
the whole model back.

Once the split is made, a rank releases the tensors of the stages it does not run to the meta device
(:mod:`.ownership`), and they stay there after ``fit``. Code that then calls the module, or reads its
values, would meet PyTorch's errors about meta tensors, which say nothing of why. So:

- at the end of ``fit`` global rank 0 says once how to get the full model (:data:`HOW_TO_GET_IT`);
- a module left holding meta tensors refuses to run its ``forward`` outside a trainer with that
  explanation, and so do its direct children (a ``transformers`` model's ``generate`` calls the model
  held by the LightningModule, not the LightningModule: :func:`guard`; the strategy lifts the guard
  when it sets up again);
- a later ``fit`` of the same module under a new strategy (a new ``Trainer``) gathers the other ranks'
  tensors back into it before capturing and splitting it anew (``whole_again`` in
  :mod:`.checkpointing`; each rank held the whole model when the first fit set up), and a checkpoint
  it resumes from keeps its values;
- ``PipelineStrategy(gather_after_fit=True)`` gathers the full model into the module on every rank
  (:func:`fill`), as DDP leaves it: every rank then runs the user's code after ``fit`` with the whole
  model, at the cost of holding it, which a model that needed a pipeline to fit may not afford. The
  buffers the state dict leaves out (registered with ``persistent=False``: a rotary embedding's
  ``inv_freq``) are gathered with it (:func:`named_tensors`), from a rank that holds them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from lightning_pipe.strategy.ownership import as_parameter_like, replace

__all__ = ["HOW_TO_GET_IT", "fill", "guard", "lift_guard", "named_tensors", "unsaved_buffers"]

HOW_TO_GET_IT = (
    "each rank's module holds only the stages the rank ran (the others' weights are on the meta device, as under "
    "FSDP). For the full model: trainer.save_checkpoint(path), called on every rank, writes it (then "
    "MyModule.load_from_checkpoint(path)); `lightning-pipe consolidate DIR FILE` turns a sharded checkpoint into one "
    "file; PipelineStrategy(gather_after_fit=True) gathers it into the module on every rank, as DDP leaves it"
)
_GUARD = "_lightning_pipe_guard"  # the module's attribute holding the guard's hook handle


def unsaved_buffers(module: nn.Module) -> dict[str, Tensor]:
    """The buffers of ``module`` its state dict leaves out (registered with ``persistent=False``), by name."""
    saved = module.state_dict(keep_vars=True).keys()
    return {name: b for name, b in module.named_buffers(remove_duplicate=False) if name not in saved}


def named_tensors(module: nn.Module) -> dict[str, Tensor]:
    """Every tensor ``module`` computes with, by name: its state dict's entries and
    :func:`unsaved_buffers`."""
    named = dict(module.state_dict(keep_vars=True))
    for name, buffer in module.named_buffers(remove_duplicate=False):
        named.setdefault(name, buffer)
    return named


def fill(
    roots: Iterable[nn.Module],
    module: nn.Module,
    full: Mapping[str, Tensor],
    optimizers: Iterable[torch.optim.Optimizer] = (),
) -> None:
    """Give every meta tensor of ``module`` (and of the modules under ``roots`` sharing it, ties kept,
    and of ``optimizers``' parameter groups) its value in ``full`` (by :func:`named_tensors`' names),
    on the device of the module's other tensors; one ``full`` lacks stays on the meta device."""
    held = named_tensors(module)
    device = next((t.device for t in held.values() if not t.is_meta), torch.device("cpu"))
    real: dict[int, Tensor] = {}
    for name, tensor in held.items():
        if tensor.is_meta and id(tensor) not in real and name in full:
            real[id(tensor)] = as_parameter_like(tensor, full[name].detach().to(device).clone())
    replace(roots, real, optimizers)


def guard(module: nn.Module) -> None:
    """Make the ``forward`` of ``module`` and of its direct children refuse to run, saying why, while
    they hold meta tensors."""
    lift_guard(module)
    trained = type(module).__name__

    def refuse(target: nn.Module, args: object) -> None:
        released = [name for name, t in named_tensors(target).items() if t.is_meta]
        if released:
            raise RuntimeError(
                f"{trained} was trained by PipelineStrategy, and after fit {HOW_TO_GET_IT}. This rank holds "
                f"{len(released)} entries of {type(target).__name__} on the meta device (e.g. {released[0]})"
            )

    for target in (module, *module.children()):
        setattr(target, _GUARD, target.register_forward_pre_hook(refuse))


def lift_guard(module: nn.Module) -> bool:
    """Remove :func:`guard`'s hooks, if any (the strategy runs the module itself again); whether
    there were (the module holds only the stages an earlier fit left this rank)."""
    lifted = False
    for target in (module, *module.children()):
        handle = target.__dict__.pop(_GUARD, None)
        if handle is not None:
            handle.remove()
            lifted = True
    return lifted
