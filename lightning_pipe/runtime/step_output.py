"""What a call of the executor returns: the micro-batches' losses, each finished step's loss and, when
asked, the last stage's outputs; shared with every rank when asked.

A step's loss is the sum of its micro-batches' weighted losses (each weighted by its share of the
mini-batch, ``n_i / n``: their sum is the mini-batch mean of the unsplit model), in the order they
ran; under a non-flushing schedule a step's micro-batches run over several calls.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.util.nested import map_tensors

__all__ = ["LossSums", "StepOutput", "share"]


@dataclass
class StepOutput:
    """What one call produced on this rank.

    Attributes:
        losses: loss of each step completed on this rank during the call (sum of its weighted
            micro-batch losses), on the rank that runs the last stage.
        microbatch_losses: ``(step, micro-batch) -> weighted loss`` computed during the call.
        outputs: ``(step, micro-batch) -> last stage output`` when asked for.
    """

    losses: dict[int, float] = field(default_factory=dict)
    microbatch_losses: dict[tuple[int, int], float] = field(default_factory=dict)
    outputs: dict[tuple[int, int], Any] = field(default_factory=dict)


class LossSums:
    """The losses of the steps whose micro-batches ran in part, summed as they come in.

    Args:
        microbatches: the micro-batches of a step.
    """

    def __init__(self, microbatches: int) -> None:
        self.microbatches = microbatches
        self._parts: dict[int, dict[int, float]] = defaultdict(dict)  # step -> micro-batch -> loss so far

    def as_floats(self, output: StepOutput) -> StepOutput:
        """``output`` with the micro-batch losses, kept as tensors while the call ran, read as floats
        (on a GPU in one transfer: one synchronisation per call instead of one per micro-batch), and
        the loss of each step whose last micro-batch ran: the sum of its micro-batches' losses, in
        float64, in the order they ran (some may have run in earlier calls)."""
        if not output.microbatch_losses:
            return output
        values = list(output.microbatch_losses.values())
        on_cpu = values[0].device.type == "cpu"  # no transfer to save: each read on its own is cheaper
        numbers = [value.item() for value in values] if on_cpu else torch.stack([v.double() for v in values]).tolist()
        output.microbatch_losses = dict(zip(output.microbatch_losses, numbers, strict=True))
        for (step, mb), number in output.microbatch_losses.items():
            parts = self._parts[step]
            parts[mb] = number
            if len(parts) == self.microbatches:
                output.losses[step] = sum(self._parts.pop(step).values())
        return output


def share(output: StepOutput, world: int, group: dist.ProcessGroup) -> StepOutput:
    """Every rank of ``group`` (``world`` of them) gets every rank's losses (and outputs, when they
    were asked for)."""
    outputs = {key: map_tensors(torch.Tensor.cpu, value) for key, value in output.outputs.items()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (output.losses, output.microbatch_losses, outputs), group=group)
    for losses, microbatch_losses, shared_outputs in gathered:
        output.losses.update(losses)
        output.microbatch_losses.update(microbatch_losses)
        output.outputs.update(shared_outputs)
    return output
