"""What the pipeline cannot run with in the Trainer's settings, refused when a fit (or validate, test,
predict) sets up: on every rank alike and before the ranks connect, so no process group is opened only
to be closed, and the same processes go on to their next fit at once (``tests/test_tuner.py``).
"""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_pipe.errors import PlanningError
from lightning_pipe.runtime.loss_scaling import refuse_without_flush
from lightning_pipe.schedule import NON_FLUSHING_FAMILIES, SUGGESTED_FLUSHING
from lightning_pipe.strategy.gradient_hooks import gradient_hooks, lightning_class

__all__ = ["PRECISIONS", "WHOLE_MODEL_CALLBACKS", "flushing_only", "refuse_unsupported", "whole_model_callback"]

PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed")
"""The Trainer's ``precision`` values the pipeline runs."""


_AVERAGE = (
    "keeps an average of every parameter of the module, updated from the module's",
    "average the weights of checkpoints saved along the run instead (each holds the whole model)",
)
WHOLE_MODEL_CALLBACKS = {
    "StochasticWeightAveraging": _AVERAGE,
    "WeightAveraging": _AVERAGE,
    "BaseFinetuning": (
        "freezes and unfreezes parameters during the fit and adds them to the optimizer, comparing them with the "
        "optimizer's",
        "fit with the parameters to freeze set requires_grad_(False) before fit, then fit the same module again "
        "with a new Trainer once they are unfrozen",
    ),
    "ModelPruning": (
        "prunes the layers' parameters during the fit, replacing them with masked copies",
        "prune the model after the fit (gather_after_fit=True gives every rank the whole model)",
    ),
}
"""Lightning's callbacks that act on every parameter of the module on every process during a fit, by
the Lightning class they derive from: what they do, and what works instead."""


def whole_model_callback(trainer: Trainer) -> tuple[str, str] | None:
    """The first of ``trainer``'s callbacks that acts on every parameter during a fit
    (:data:`WHOLE_MODEL_CALLBACKS`, from either Lightning package): its class's name and the Lightning
    class it derives from."""
    if trainer.state.fn != TrainerFn.FITTING:
        return None
    for callback in trainer.callbacks:
        for base in WHOLE_MODEL_CALLBACKS:
            if lightning_class(callback, base) is not None:
                return type(callback).__name__, base
    return None


def flushing_only(trainer: Trainer) -> str | None:
    """Why ``schedule="auto"`` may choose among the flushing families only under ``trainer``'s
    settings (``None``: it may choose any)."""
    hooks = gradient_hooks(trainer.lightning_module, trainer)
    if hooks:
        return ", ".join(hooks)
    if trainer.accumulate_grad_batches != 1:
        return f"accumulate_grad_batches={trainer.accumulate_grad_batches}"
    if str(trainer.precision) == "16-mixed":
        return "precision='16-mixed'"
    return None


def refuse_unsupported(
    module: LightningModule, trainer: Trainer, family: str, microbatches: int, processes: int
) -> None:
    """Raise :class:`~lightning_pipe.errors.PlanningError`, saying what would work, where ``module``
    and ``trainer`` ask for what a pipeline of the schedule ``family`` on ``microbatches`` micro-batches
    and ``processes`` processes cannot run."""
    if not module.automatic_optimization:
        raise PlanningError(
            "manual optimization (automatic_optimization = False) is not supported: the pipeline runs forward, "
            "backward and the update of every stage itself"
        )
    accumulate, precision = trainer.accumulate_grad_batches, str(trainer.precision)
    if accumulate != 1 and family in NON_FLUSHING_FAMILIES:
        raise PlanningError(
            f"accumulate_grad_batches={accumulate} with a non-flushing schedule ({family!r}): "
            "its steps overlap from batch to batch and its update rule applies each step's gradient to weights "
            "of the steps before, so no batch can end without an update; use batches "
            f"{accumulate}x larger with microbatches={accumulate * microbatches} (the same gradient per "
            f"update), or a flushing schedule ({SUGGESTED_FLUSHING})"
        )
    hooks = gradient_hooks(module, trainer)
    if hooks and family in NON_FLUSHING_FAMILIES:
        raise PlanningError(
            f"{', '.join(hooks)} reads each step's gradients before its update, but a non-flushing schedule "
            f"({family!r}) updates each stage inside the pipeline while later steps run, so no moment holds one "
            f"step's gradients: use a flushing schedule ({SUGGESTED_FLUSHING}), under which these hooks see the "
            "gradients of the rank's stages, or remove the hook"
        )
    whole = whole_model_callback(trainer)
    if whole is not None and processes > 1:
        name, base = whole
        does, instead = WHOLE_MODEL_CALLBACKS[base]
        raise PlanningError(
            f"the {name} callback {does}, but each rank of a pipeline holds only the parameters of its stages: "
            f"{instead}"
        )
    if processes > 1 and any(isinstance(callback, BatchSizeFinder) for callback in trainer.callbacks):
        raise PlanningError(
            "Lightning's batch size finder (Tuner.scale_batch_size, BatchSizeFinder) runs on one process only: "
            "each process names its own temporary checkpoint, and Lightning refuses it under DDP too; choose the "
            "batch size from the memory the plan predicts per device (printed at set-up; `lightning-pipe plan`), "
            "or find it with plain Lightning on one device"
        )
    if is_overridden("configure_gradient_clipping", module, LightningModule):
        raise PlanningError(
            "configure_gradient_clipping is overridden: the pipeline clips inside each stage's update; set "
            "Trainer(gradient_clip_val=..., gradient_clip_algorithm='norm'|'value') instead"
        )
    if precision not in PRECISIONS:
        raise PlanningError(
            f"precision={precision!r} is not supported by the pipeline: use '32-true', 'bf16-mixed', "
            "'bf16-true' or '16-mixed'"
        )
    if precision == "16-mixed":
        refuse_without_flush(
            family, family not in NON_FLUSHING_FAMILIES, "precision='16-mixed'", "precision='bf16-mixed'"
        )
