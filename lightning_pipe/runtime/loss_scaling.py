"""Dynamic loss scaling shared by the stages of a pipeline (float16 mixed precision).

Float16 gradients underflow unless the loss is multiplied by a large factor before the backward
and the weight gradients divided by it before the update (Micikevicius et al. 2018, "Mixed
Precision Training", §3.2). The factor is *dynamic*: a step whose gradients overflow (``inf`` or
``nan``) is skipped and the factor shrinks; after ``growth_interval`` good steps in a row it grows.
:class:`LossScale` is the rule of ``torch.amp.GradScaler`` with the same state (so Lightning's
checkpoint of the scaler carries it), held outside any one optimizer because in a pipeline:

- the last stage multiplies its micro-batch losses by the factor, and every stage's weight gradient
  carries it;
- whether the step overflowed is a property of *all* stages' gradients: one stage's ``inf`` skips
  every stage's update, as it skips the whole model's in single-device training. The executor
  learns it from the same all-reduce that sums the squared gradient norm for clipping (a non-finite
  sum is an overflow), so it costs no extra collective, and every worker applies the same update to
  the factor.

That needs every stage's gradient of a step before any stage updates: flushing schedules only
(:func:`refuse_without_flush`, which the strategy asks at set-up and the executor when it is made).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule import SUGGESTED_FLUSHING

__all__ = ["LossScale", "refuse_without_flush"]


def refuse_without_flush(
    family: str, flush: bool, asked: str = "float16 mixed precision (loss_scale)", instead: str = "bfloat16"
) -> None:
    """Refuse float16's loss scale (``asked``: as the caller's user asked for it) with a schedule that
    does not flush (``flush``; ``family``: its name), suggesting ``instead``.

    Raises:
        PlanningError: ``flush`` is false.
    """
    if not flush:
        raise PlanningError(
            f"{asked} needs a loss scale that skips an overflowed step on every stage, which a non-flushing "
            f"schedule ({family!r}) cannot do without a flush: use {instead} (no loss scale), or a flushing "
            f"schedule ({SUGGESTED_FLUSHING})"
        )


@dataclass
class LossScale:
    """The loss-scale factor and its update rule (``torch.amp.GradScaler``'s defaults)."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0

    def __post_init__(self) -> None:
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"the loss scale must be a positive finite number; got {self.scale}")
        if not self.growth_factor > 1:
            raise ValueError(f"growth_factor must be above 1; got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1); got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be at least 1 step; got {self.growth_interval}")

    @property
    def inverse(self) -> float:
        """The factor that unscales gradients (in float32, as GradScaler computes it)."""
        return _float32(1.0 / self.scale)

    def update(self, overflowed: bool) -> None:
        """After a step: back off on an overflow, grow after ``growth_interval`` good steps."""
        if overflowed:
            self.scale = _float32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = _float32(self.scale * self.growth_factor)
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """``torch.amp.GradScaler.state_dict()``'s keys and meaning."""
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self.growth_tracker,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> LossScale:
        """From :meth:`state_dict` or a ``GradScaler``'s."""
        return cls(
            float(state["scale"]),
            float(state["growth_factor"]),
            float(state["backoff_factor"]),
            int(state["growth_interval"]),
            int(state["_growth_tracker"]),
        )


def _float32(value: float) -> float:
    """``value`` rounded to float32 (GradScaler keeps its factor in a float32 tensor)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf
