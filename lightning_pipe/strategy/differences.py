"""What a pipeline does differently from plain Lightning for a given module, said at set-up.

Printed with the plan on rank 0 (and returned as lines for tests):

- **shared parameters**: a parameter used by layers of several stages (tied weights) is kept by each
  device holding one of them (under a flushing schedule once, however many of its stages use it) and
  its gradients are summed over them before every update
  (:mod:`~lightning_pipe.runtime.ties`);
- **batch norm**: each layer normalises a micro-batch with the micro-batch's statistics (the
  gradients differ from plain Lightning's, which uses the batch's), while the running statistics move
  once per step by all the batch's rows (:mod:`~lightning_pipe.runtime.batch_norm`);
- **dropout**: masks are drawn from each process's own generator, so they differ from plain
  Lightning's draws (as they do under DDP).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_pipe.runtime.ties import find_ties

__all__ = ["differences"]


def _names(module: nn.Module, parameter: nn.Parameter) -> list[str]:
    return [name for name, p in module.named_parameters(remove_duplicate=False) if p is parameter]


def _shown(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def differences(
    module: nn.Module, stages: Sequence[nn.Module], microbatch_rows: int, batch_rows: int, flush: bool
) -> list[str]:
    """The lines describing how ``module`` split into ``stages`` trains differently from plain
    Lightning, with micro-batches of ``microbatch_rows`` out of ``batch_rows``."""
    lines = []
    for tie in find_ties(dict(enumerate(stages))):
        names = [" = ".join(_names(module, p)) for p in tie.parameters]
        when = "at the end of each step" if flush else "at each stage's update"
        lines.append(
            f"Shared parameters {_shown(names)} are used on stages {', '.join(map(str, tie.stages))}: each device "
            f"holding one of them keeps a copy, and their gradients are summed over those stages {when} before "
            "every update (the copies stay equal; a checkpoint holds the parameter under its names, as plain "
            "Lightning's)"
        )
    norms = [name for name, m in module.named_modules() if isinstance(m, _BatchNorm) and m.training]
    if norms and microbatch_rows < batch_rows:
        lines.append(
            f"Batch norm: {len(norms)} layer{'s' if len(norms) > 1 else ''} ({_shown(norms)}) normalise each "
            f"micro-batch of {microbatch_rows} rows with its own mean and variance (plain Lightning: the batch's "
            f"{batch_rows} rows), so their gradients differ from plain Lightning's; their running statistics move "
            "once per step by all the batch's rows, which evaluation then uses as plain Lightning does"
        )
    dropouts = [name for name, m in module.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    if dropouts:
        lines.append(
            f"Dropout: {len(dropouts)} layer{'s' if len(dropouts) > 1 else ''} ({_shown(dropouts)}) draw their masks "
            "from each process's own generator: the masks differ from plain Lightning's"
        )
    return lines
