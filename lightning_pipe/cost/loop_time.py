"""The training loop's own time per step, kept per machine: what a model's first fit adds to its prediction.

A step of :class:`~lightning_pipe.strategy.PipelineStrategy` is the executor's call, whose actions the
prediction simulates from the layer profile, and the training loop's work around it: Lightning's loop
(the batch fetched and moved, its hooks), the strategy's capture of ``training_step`` and its log relay.
Once a fit of a model ran, its calibration holds that time (``Calibration.per_step``,
:mod:`lightning_pipe.cost.calibrated`); the model's first fit had the profile alone, and came out short
by it where steps are short: on 2 CPU processes an MLP's steps of 3.5 ms spent 1.2-1.3 ms outside the
executor's calls (``python bench/loop_time.py``), and its first fit was predicted 41% short
(``bench/auto_plan.py``).

That time depends on the machine and the loop more than on the model: 1.9-2.5 ms a step on this
package's 2-core machine for two ResNet-18s, a transformer and GPT-2, 1.2-1.3 ms for the MLP
(``python bench/loop_time.py``); the step's own code moves it too (the MLP's first fit, priced with
the others' loop, came out between 1% short, in ``bench/auto_plan.py --pairs 8``, and 28% long, in
``bench/loop_time.py``, against 41% short with the profile alone). So every fit measures it
(:func:`loop_seconds`, on each rank; the smallest rank's, as a rank that ends its call first waits
there for the others) and keeps it beside the profiles, per device kind and number of processes
(:func:`keep_loop_seconds`); a fit of a model with no calibration of its own prices each step with
the median of the last :data:`KEPT_LOOPS` kept (:func:`kept_loop_seconds`).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_pipe.util.files import keep_run, kept_document, kept_number, kept_runs

__all__ = ["KEPT_LOOPS", "LOOP_PREFIX", "keep_loop_seconds", "kept_loop_seconds", "loop_path", "loop_seconds"]

KEPT_LOOPS = 5
"""The fits whose loop time is kept; a prediction takes their median."""

LOOP_PREFIX = "loop-"


def loop_seconds(starts: Sequence[float], executor_seconds: Sequence[float]) -> float | None:
    """The loop's own time per step on this rank: the median, over the steps whose next one started
    (``starts``, each step's start), of the time to the next start less the executor's call in the step
    (``executor_seconds``, in the same order); ``None`` where no step has a next one."""
    spent = [
        max(after - before - inside, 0.0)
        for (before, after), inside in zip(itertools.pairwise(starts), executor_seconds, strict=False)
    ]
    return statistics.median(spent) if spent else None


def loop_path(directory: Path, device: torch.device | str, processes: int) -> Path:
    """The file the loop times of fits on ``processes`` processes of ``device``'s kind are kept in."""
    return directory / f"{LOOP_PREFIX}{torch.device(device).type}-{processes}.json"


def keep_loop_seconds(directory: Path, device: torch.device | str, processes: int, seconds: float) -> Path | None:
    """Keep ``seconds``, a fit's loop time (:func:`loop_seconds`), as the last of the :data:`KEPT_LOOPS`
    kept for ``processes`` processes of ``device``'s kind in ``directory`` (the file replaced
    atomically); the file, or ``None`` where it could not be written or ``seconds`` is no time."""
    if not (math.isfinite(seconds) and seconds >= 0):
        return None
    entry = {"seconds": seconds, "written": time.strftime("%Y-%m-%d %H:%M:%S")}
    return keep_run(loop_path(directory, device, processes), entry, KEPT_LOOPS)


def kept_loop_seconds(directory: Path, device: torch.device | str, processes: int) -> float | None:
    """The median of the loop times kept for ``processes`` processes of ``device``'s kind in
    ``directory`` (:func:`keep_loop_seconds`); ``None`` where none is kept (or none readable)."""
    runs = kept_runs(kept_document(loop_path(directory, device, processes)))
    found = [seconds for run in runs if (seconds := kept_number(run, "seconds")) is not None]
    return statistics.median(found) if found else None
