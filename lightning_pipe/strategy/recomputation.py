"""The activation checkpointing a model asks for, applied as its stages' recomputation.

A model asks for activation checkpointing in one of three ways the ecosystem knows:

- ``transformers``: ``model.gradient_checkpointing_enable()`` sets ``gradient_checkpointing = True``
  on its blocks (``GradientCheckpointingLayer``; ``every_n_layers`` leaves some off) and on the
  module holding them;
- ``timm``: ``model.set_grad_checkpointing()`` sets ``grad_checkpointing = True`` on the model, whose
  ``forward`` then checkpoints its sequence of blocks;
- PyTorch: a block wrapped in ``checkpoint_wrapper`` (a ``CheckpointWrapper``), as FSDP users do.

The captured layers replay ``forward``'s operations, not the modules' ``forward``, so none of these
checkpoints itself inside a pipeline (the capture traces without autograd, where they run their plain
path). The strategy honours the request at the granularity it has: a stage holding a checkpointed
block runs its forwards without autograd, keeps only its input (and random state) per micro-batch in
flight, and recomputes the forward in its backward (``PipelineExecutor(recompute=...)``, GPipe's
re-materialisation, Huang et al. 2019, §2.3). A stage recomputes its glue layers too (an embedding,
a final norm): one forward more per micro-batch, as the blocks' own checkpointing costs, and no more
memory in flight than the blocks' inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["checkpointed_blocks", "recomputation_note", "recomputed_stages"]

_FLAGS = ("gradient_checkpointing", "grad_checkpointing")  # transformers', timm's


def _wrapped(module: nn.Module) -> bool:
    """Whether ``module`` is PyTorch's ``CheckpointWrapper`` (its import path is private: by name)."""
    return any(cls.__name__ == "CheckpointWrapper" for cls in type(module).__mro__)


def _flagged(module: nn.Module) -> bool:
    return any(getattr(module, flag, False) is True for flag in _FLAGS) or _wrapped(module)


def checkpointed_blocks(module: nn.Module) -> dict[str, nn.Module]:
    """The blocks of ``module``'s tree that ask for activation checkpointing, by path: the innermost
    flagged modules (``transformers`` flags a model as well as its blocks: the blocks are what it
    checkpoints), ``{}`` when none does."""
    flagged = {path: sub for path, sub in module.named_modules() if _flagged(sub)}
    return {
        path or type(module).__name__: sub
        for path, sub in flagged.items()
        if not any(other.startswith(f"{path}.") or (not path and other) for other in flagged if other != path)
    }


def recomputed_stages(blocks: dict[str, nn.Module], stages: Sequence[nn.Module]) -> list[bool]:
    """Per stage, whether it holds a parameter of a checkpointed block (the layers are the model's
    own modules, so the parameters are the blocks' by identity)."""
    wanted = {id(p) for block in blocks.values() for p in block.parameters()}
    return [any(id(p) in wanted for p in stage.parameters()) for stage in stages]


def recomputation_note(blocks: dict[str, nn.Module], recomputed: Sequence[bool]) -> str:
    """What the set-up says about it: which blocks asked, which stages recompute."""
    paths = list(blocks)
    shown = ", ".join(paths[:3]) + (f", ... ({len(paths)} in all)" if len(paths) > 3 else "")
    which = ", ".join(str(s) for s, on in enumerate(recomputed) if on) or "none (no stage holds their parameters)"
    return (
        f"Activation checkpointing asked for by {shown}: applied per stage, stages {which} recompute their "
        "forward in the backward and keep only their inputs per micro-batch in flight (the captured layers do "
        "not checkpoint themselves; PipelineStrategy(recompute=True) recomputes every stage)"
    )
