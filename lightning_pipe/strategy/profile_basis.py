"""The profile a kept calibration's rate is measured against, and the one ``schedule="auto"`` prices with.

A fit of a given family plans from the layer-by-layer profile of its micro-batch. ``schedule="auto"``
plans from that profile brought to the chain timed whole (:meth:`~lightning_pipe.cost.records.ChainCosts.rescaled`:
a layer-by-layer profile pays per layer what a stage pays once), taken on the mini-batch's micro-batch
and a smaller one, each count's micro-batch on the line through both
(:func:`~lightning_pipe.auto.microbatch_costs`). A calibration's ``scale`` is the rate of a run's
actions against the profile it planned with, so one kept by a fit of a given family priced
``schedule="auto"``'s candidates short by what separates the two profiles: on 2 CPU processes
(2026-11-28, ``bench/auto_plan.py``) GPT-2's search predicted 2BW on 4 micro-batches at 94 ms from the
calibration a 2BW fit on 4 micro-batches had kept, which had predicted its own step at 134 ms
(measured: 139 ms). Calibrations are therefore kept against the layer-by-layer profile, and
``schedule="auto"`` converts them, in and out, at each micro-batch count (:class:`ProfileBasis`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lightning_pipe.auto import microbatch_costs
from lightning_pipe.cost.calibrated import Calibration
from lightning_pipe.cost.records import ChainCosts

__all__ = ["ProfileBasis"]


def _seconds(costs: ChainCosts) -> float:
    return math.fsum(layer.forward_seconds + layer.backward_seconds for layer in costs.layers)


@dataclass(frozen=True)
class ProfileBasis:
    """The layer-by-layer profiles of a ``schedule="auto"`` fit (``layers``: the mini-batch's
    micro-batch, one of ``parts``; ``small``: the smaller one's, one of ``small_parts``) and the same
    brought to the chain timed whole (``chain``, ``small_chain``), which the search prices with."""

    layers: ChainCosts
    chain: ChainCosts
    parts: float
    small: ChainCosts | None = None
    small_chain: ChainCosts | None = None
    small_parts: float = 1.0

    def factor(self, microbatches: int) -> float:
        """The chain-timed profile's seconds over the layer-by-layer one's, for one of
        ``microbatches`` micro-batches (forward and backward of every layer)."""
        chain_small = None if self.small_chain is None else (self.small_chain, self.small_parts)
        layers_small = None if self.small is None else (self.small, self.small_parts)
        chain = microbatch_costs(self.chain, self.parts, chain_small, microbatches)
        layers = microbatch_costs(self.layers, self.parts, layers_small, microbatches)
        total = _seconds(layers)
        return _seconds(chain) / total if total > 0 else 1.0

    def to_chain(self, found: Calibration | None, microbatches: int) -> Calibration | None:
        """``found`` (kept against the layer-by-layer profile) as a rate against the chain-timed one."""
        return None if found is None else replace(found, scale=found.scale / self.factor(microbatches))

    def to_layers(self, found: Calibration, microbatches: int) -> Calibration:
        """``found`` (measured against the chain-timed profile) as a rate against the layer-by-layer one."""
        return replace(found, scale=found.scale * self.factor(microbatches))
