"""Memory of a stage under a pipeline schedule.

Beaumont et al. §3.2: a worker holding layers ``L_p`` needs ``Σ_{l∈L_p} W_l + NCA_l · a_l`` where
``NCA_l`` (number of concurrent activations) depends on the schedule. Here ``W_l`` is the parameter
bytes times (weight versions + extra copies for gradients and optimizer state, ZeRO's accounting:
1 for plain SGD, 2 for SGD with momentum, 3 for Adam), and ``a_l`` is what autograd keeps for the
backward pass (``saved_bytes``).

Closed forms of NCA per schedule, for a stage followed (itself included) by ``k`` workers and
replicated ``r`` times, with ``m`` micro-batches per step:

- ``gpipe``: every micro-batch's forward runs before any backward: ``m``.
- ``1f1b`` (PipeDream-Flush): ``min(⌈k/r⌉, m)``; for a straight pipeline stage ``s`` (0-based) of
  ``P`` has ``k = P - s``, which is docs/design.md's ``min(P - s, m)``; ``⌈k/r⌉`` is PipeDream's
  NOAM for the stage's replicas under 1F1B-RR.
- ``pipedream`` (asynchronous, weight stashing): ``⌈k/r⌉`` in flight, and as many weight versions.
- ``2bw`` (PipeDream-2BW): ``⌈k/r⌉`` in flight, two weight versions.

Families whose workers hold several stages, or whose stages keep more than these forms (a looped
pipeline, interleaved virtual stages, Rahimi's replicated families), are planned with the counts of
their own schedule instead (``counts``, :mod:`lightning_pipe.schedule.in_flight`): 1F1B's form
under-counted a breadth-first looped pipeline's stages by up to 2.7x (``m = 8`` on 2 workers).

A stage after the first of a flushing schedule runs its cool-down backwards in two halves (input
gradient first, sent upstream, then the weight gradients: :mod:`lightning_pipe.schedule.early`), one
at a time; between the halves it keeps the gradients the weight half resumes from, one micro-batch's
``kept_gradient_bytes`` on top of its activations (``split_backward``: the ``γ`` of
:meth:`MemoryModel.kept_coefficient`).

With more than one micro-batch per step, each micro-batch's weight gradient is added into the one
already there (autograd's ``grad += new``): for a moment a parameter's new gradient exists beside it,
one parameter at a time, added as soon as it is made. A stage holds that transient on top, the bytes
of its largest parameter (:meth:`MemoryModel.accumulating_bytes`,
:attr:`~lightning_pipe.cost.records.LayerCost.largest_param_bytes`): on a 16 x Linear(4096, 4096) MLP
64 MiB per stage, a twelfth of a 4-layer stage's weights, gradients and momentum.

While a layer runs its backward, the stage also holds the gradient of the layer's output, that of
its input as it is made and what the backward computes in between, less the saved activations it
frees: the layer's ``backward_bytes`` (:mod:`lightning_pipe.cost.backward_bytes`), one layer at a
time. With the accumulated gradient above, a stage holds at most the largest of its layers'
:meth:`MemoryModel.transient_bytes` on top of what it keeps.

A stage that recomputes its forward in the backward (GPipe's re-materialisation, Huang et al. 2019,
§2.3: ``recompute``) keeps only its input per micro-batch in flight, ``NCA · input_bytes``, and
re-creates one micro-batch's ``a_l`` at a time in its backward: ``NCA · input + Σ a_l`` instead of
``NCA · Σ a_l``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_pipe.errors import PlanningError, check_whole

__all__ = ["EXTRA_COPIES", "SCHEDULES", "MemoryModel"]

#: Extra parameter-sized copies per optimizer: gradient + optimizer states (ZeRO §3).
EXTRA_COPIES: dict[str, int] = {"sgd": 1, "momentum": 2, "adam": 3}
SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "pipedream", "2bw")


@dataclass(frozen=True)
class MemoryModel:
    """How much memory a stage needs under a schedule.

    Attributes:
        schedule: one of :data:`SCHEDULES`.
        microbatches: ``m``; ``None`` means unbounded (steady state of a long run), allowed for
            every schedule but ``gpipe``.
        extra_copies: parameter-sized copies besides the weights (see :data:`EXTRA_COPIES`).
        split_backward: stages after the first split a backward in two halves and keep one
            micro-batch's ``kept_gradient_bytes`` between them (flushing schedules' cool-down).
        accumulation: count the gradient a stage adds into the last one (:meth:`accumulating_bytes`),
            as the runtime does it.
        recompute: stages recompute their forward in the backward and keep only their inputs in
            flight (module docstring; :meth:`stage_bytes`' ``input_bytes``).
        counts: each stage's activations in flight as its schedule keeps them, first stage first
            (:func:`~lightning_pipe.schedule.in_flight.stage_in_flight`), in place of the closed form:
            the stage ``downstream`` workers from the end keeps ``counts[-downstream]``. Straight
            stages only (``replicas`` 1).
    """

    schedule: str = "1f1b"
    microbatches: int | None = None
    extra_copies: float = EXTRA_COPIES["momentum"]
    split_backward: bool = False
    accumulation: bool = False
    recompute: bool = False
    counts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise PlanningError(
                f"unknown schedule {self.schedule!r} for memory planning; choose one of {', '.join(SCHEDULES)}"
            )
        check_whole("microbatches", self.microbatches, 1, optional=True)
        if self.schedule == "gpipe" and self.microbatches is None:
            raise PlanningError("gpipe keeps all m micro-batches in flight: give the number of microbatches")
        if not math.isfinite(self.extra_copies) or self.extra_copies < 0:
            raise PlanningError(f"extra_copies must be a finite number >= 0, got {self.extra_copies!r}")
        if self.counts is not None and (
            not self.counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.counts)
        ):
            raise PlanningError(f"counts must list each stage's activations in flight (>= 1), got {self.counts!r}")

    def in_flight(self, downstream: int, replicas: int = 1) -> int:
        """NCA of a stage with ``downstream`` workers from it to the end, replicated ``replicas`` times."""
        if self.counts is not None:
            if replicas != 1 or not 1 <= downstream <= len(self.counts):
                raise PlanningError(
                    f"the in-flight counts of {len(self.counts)} straight stages have no stage {downstream} from the "
                    f"end replicated {replicas} times"
                )
            return self.counts[-downstream]
        if self.schedule == "gpipe":
            return self.microbatches  # type: ignore[return-value]
        depth = -(-downstream // replicas)
        if self.schedule == "1f1b" and self.microbatches is not None:
            return min(depth, self.microbatches)
        return depth

    def weight_versions(self, downstream: int, replicas: int = 1) -> int:
        """Copies of the weights a stage keeps: one, two (2BW) or one per in-flight batch (stashing)."""
        if self.schedule == "pipedream":
            return self.in_flight(downstream, replicas)
        return 2 if self.schedule == "2bw" else 1

    def stage_bytes(
        self,
        param_bytes: float,
        saved_bytes: float,
        downstream: int,
        replicas: int = 1,
        kept_bytes: float = 0.0,
        first: bool = False,
        input_bytes: float = 0.0,
    ) -> float:
        """Memory of one replica of a stage (Beaumont §3.2), plus the gradients a split backward keeps
        (``kept_bytes``) unless it is the ``first`` stage; with :attr:`recompute`, its ``input_bytes``
        per micro-batch in flight and one micro-batch's ``saved_bytes`` (GPipe §2.3)."""
        per_param, _ = self.coefficients(downstream, replicas)
        activations = self.activation_bytes(saved_bytes, downstream, replicas, input_bytes)
        return per_param * param_bytes + activations + self.kept_coefficient(downstream, first) * kept_bytes

    def activation_bytes(
        self, saved_bytes: float, downstream: int, replicas: int = 1, input_bytes: float = 0.0
    ) -> float:
        """The activations part of :meth:`stage_bytes`: ``β·saved_bytes``, or with :attr:`recompute`
        the inputs of the micro-batches in flight and one micro-batch's ``saved_bytes``."""
        per_saved = float(self.in_flight(downstream, replicas))
        return per_saved * input_bytes + saved_bytes if self.recompute else per_saved * saved_bytes

    @property
    def accumulates(self) -> bool:
        """Whether a stage's largest layer's gradient counts (:meth:`accumulating_bytes`): with
        ``accumulation`` and more than one micro-batch per step."""
        return self.accumulation and self.microbatches != 1

    def accumulating_bytes(self, largest_param_bytes: float) -> float:
        """The gradient a stage adds into ``.grad`` at a time (module docstring): its largest
        parameter's bytes (``largest_param_bytes``) when it :attr:`accumulates`."""
        return largest_param_bytes if self.accumulates else 0.0

    def transient_bytes(self, accumulated_bytes: float, backward_bytes: float) -> float:
        """What one layer of a stage holds for the moment of its backward on top of the stage's
        weights, gradients, state and activations (module docstring): its ``backward_bytes``, and
        the new gradient it adds into ``.grad`` when the stage :attr:`accumulates`
        (``accumulated_bytes``: :attr:`~lightning_pipe.cost.records.LayerCost.accumulated_bytes`).
        A stage holds the largest of its layers'."""
        return backward_bytes + self.accumulating_bytes(accumulated_bytes)

    def coefficients(self, downstream: int, replicas: int = 1) -> tuple[float, float]:
        """``(α, β)`` with ``stage_bytes = α·param_bytes + β·saved_bytes`` (+ ``γ·kept_bytes``)."""
        return (
            self.weight_versions(downstream, replicas) + self.extra_copies,
            float(self.in_flight(downstream, replicas)),
        )

    def least_coefficients(self) -> tuple[float, float]:
        """The ``(α, β)`` of the stage keeping the fewest copies (a bound for any stage): the last one,
        unless the schedule's ``counts`` say another."""
        if self.counts is None:
            return self.coefficients(1, 1)
        fewest = min(range(1, len(self.counts) + 1), key=lambda d: self.coefficients(d))
        return self.coefficients(fewest)

    def kept_coefficient(self, downstream: int, first: bool) -> float:
        """``γ``: 1 when the stage splits its cool-down backwards, which it does (one at a time) when
        it is not the ``first`` (whose input takes no gradient) and its cool-down is no longer than
        its distance to the end, ``downstream`` (always under 1F1B; under GPipe, whose cool-down is
        every micro-batch, only when ``m <= downstream``: :mod:`lightning_pipe.schedule.early`)."""
        if not self.split_backward or first:
            return 0.0
        return 0.0 if self.schedule == "gpipe" and self.microbatches > downstream else 1.0  # type: ignore[operator]
