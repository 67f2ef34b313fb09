"""The rate of a pipeline's actions against the layer profile on this machine, kept for any model's first fit.

A profile times each layer alone, in one process; in a pipeline every stage computes beside the
others, on caches and memory bandwidth they share, after the other micro-batches' actions have left
the caches cold. A fit measures the rate of its actions against the profile and keeps it for the next
fit of the same model (``Calibration.scale``, :mod:`lightning_pipe.cost.calibrated`); a model's first
fit had none and came out short by it. On 2 CPU processes the first fits of torchvision's ResNet-18, a
CIFAR ResNet-18 chain, a 6-block transformer and GPT-2 kept rates of 1.08-1.16x the profile and were
predicted 10-13% short (``python bench/auto_plan.py --pairs 8``, 2026-11-30).

So every fit also keeps its rate and its fixed cost per action beside the profiles, per device kind and
number of processes, with the family and pinning it ran (:func:`keep_rate`), and a model with no
calibration of its own prices its actions with what the last :data:`PRIOR_FITS` fits of other models
of the same kind of family measured (:meth:`MachineRates.closest`: those on as many micro-batches and
of the same pinning first; each figure their lower median, as
:func:`~lightning_pipe.cost.calibrated.typical` takes a model's own). Kinds are
not mixed: a worker holding several stages, or splitting each backward, runs more and smaller actions
for the same work, and an MLP's rate under interleaved 1F1B was 3.0-3.8x its profile where 1F1B's was
2.1-2.5x (:func:`~lightning_pipe.cost.calibrated.family_kind`). Priced so, the first fits of the chain,
the transformer and GPT-2 came out at a median of -2% each over four runs of ``python
bench/loop_time.py`` (-6% to -6.5% before), and +7%, +1% and -3% in the next run of ``bench/auto_plan.py``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_pipe.cost.calibrated import REPLICATING_FAMILIES, Calibration, family_kind
from lightning_pipe.util.files import keep_run, kept_document, kept_number, kept_runs

__all__ = ["KEPT_RATES", "PRIOR_FITS", "RATE_PREFIX", "MachineRates", "keep_rate", "kept_rates", "rate_path"]

KEPT_RATES = 20
"""The fits whose rates are kept on a machine, of every kind of family."""

PRIOR_FITS = 5
"""The latest fits of a kind whose rates price a first fit: their lower median."""

RATE_PREFIX = "rate-"


def rate_path(directory: Path, device: torch.device | str, processes: int) -> Path:
    """The file the rates of fits on ``processes`` processes of ``device``'s kind are kept in."""
    return directory / f"{RATE_PREFIX}{torch.device(device).type}-{processes}.json"


def keep_rate(
    directory: Path,
    device: torch.device | str,
    processes: int,
    family: str,
    microbatches: int,
    pinned: bool,
    found: Calibration,
    model: str,
) -> Path | None:
    """Keep ``found``'s rate and fixed cost per action, measured by a fit of ``model`` (its key) running
    ``family`` on ``microbatches`` micro-batches with its threads ``pinned`` or not on ``processes``
    processes of ``device``'s kind, as the last of the :data:`KEPT_RATES` kept in ``directory`` (the
    file replaced atomically); the file, or ``None`` where it could not be written."""
    entry = {
        "family": family,
        "microbatches": microbatches,
        "pinned": pinned,
        "scale": found.scale,
        "fixed": found.fixed,
        "model": model,
        "written": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return keep_run(rate_path(directory, device, processes), entry, KEPT_RATES)


@dataclass(frozen=True)
class MachineRates:
    """The rates fits kept on a machine (:func:`kept_rates`), read once."""

    entries: tuple[dict[str, object], ...] = ()

    def closest(self, family: str, microbatches: int, pinned: bool | None, model: str | None) -> Calibration | None:
        """What prices a fit of ``family`` on ``microbatches`` micro-batches, its threads ``pinned`` or
        not (``None``: not known yet), of a model with no calibration of its own: the lower median rate
        and fixed cost of the last :data:`PRIOR_FITS` fits of the same kind of family by other models than
        ``model``, those on as many micro-batches first (a smaller micro-batch runs further from its
        profile), then those of the same pinning; nothing beyond the actions; ``None`` where no fit of
        the kind is kept."""
        kind = family_kind(family)
        alike = [
            (scale, fixed, (entry.get("microbatches") == microbatches, entry.get("pinned") == pinned))
            for entry in self.entries
            if family_kind(entry.get("family")) == kind
            and entry.get("model") != model
            and (scale := kept_number(entry, "scale")) is not None
            and scale > 0
            and (fixed := kept_number(entry, "fixed")) is not None
        ]
        if not alike:
            return None
        closest = max(close for _, _, close in alike)
        fits = [(scale, fixed) for scale, fixed, close in alike if close == closest][-PRIOR_FITS:]
        scale = statistics.median_low(scale for scale, _ in fits)
        fixed = statistics.median_low(fixed for _, fixed in fits)
        said = (
            "the last fit of another model on this machine with this kind of schedule"
            if len(fits) == 1
            else f"the last {len(fits)} fits of other models on this machine with this kind of schedule"
        )
        return Calibration(scale, fixed, 0.0, said, family in REPLICATING_FAMILIES)


def kept_rates(directory: Path, device: torch.device | str, processes: int) -> MachineRates:
    """The rates kept for ``processes`` processes of ``device``'s kind in ``directory`` (:func:`keep_rate`;
    none where none is readable)."""
    return MachineRates(tuple(kept_runs(kept_document(rate_path(directory, device, processes)))))
