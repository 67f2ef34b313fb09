"""What each action of a stage costs a simulation, and what moving its bytes costs.

:class:`StageCosts` prices one micro-batch per stage: forward, backward (or its input and weight
halves), update, the extra pass of a backward that adds into its step's weight gradients
(:func:`adds_gradients` says which do), the bytes it sends, keeps and holds, and the network: a message
takes ``latency + bytes / bandwidth`` and costs the processors at both ends ``overhead`` seconds of
their own time (the *o* of the LogP model, Culler et al. 1993). ``contention`` says how much workers
sharing one machine slow each other (processor sharing, :mod:`lightning_pipe.schedule.simulate`), and
``reduce_overlap`` how much of an all-reduce of gradients runs beside their compute.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_pipe.errors import PlanningError
from lightning_pipe.schedule.ir import Action, Kind

__all__ = ["StageCosts", "adds_gradients", "check_contention", "check_reduce_overlap"]


_SCALARS = ("bandwidth", "latency", "overhead", "contention", "reduce_overlap")
_PLAN_FIELDS = ("forward_seconds", "backward_seconds", "output_bytes", "saved_bytes", "param_bytes")


@dataclass(frozen=True)
class StageCosts:
    """Per-stage costs for one micro-batch (lists of length ``P``; scalars broadcast).

    Attributes:
        forward, backward: ``F`` and full ``B`` seconds.
        input_grad, weight_grad: the halves of a split backward (default: half of ``backward`` each).
        update: optimizer step seconds.
        accumulate: seconds a backward (or its weight half) takes on top of ``backward`` (or
            ``weight_grad``) when it adds its weight gradients into those its step already has on the
            worker, over the step's first one there, which keeps what autograd made: gradient
            accumulation's extra pass over the stage's gradients (default 0; ``backward`` is then the
            first one's seconds). Negative where measured so (beside fewer busy workers than the
            first), never below ``-backward`` or the weight half's seconds.
        activation_bytes: bytes of the stage's output (and of the gradient sent back to it).
        saved_bytes: activation bytes kept from a forward until its last backward half.
        weight_bytes: bytes of the stage's parameters (a fetched or reduced copy).
        bandwidth: bytes per second between workers (``inf``: transfers are free).
        latency: seconds every message takes on top of ``bytes / bandwidth`` (wake-ups, handshakes).
        overhead: seconds of processor time a message costs its sender and, again, its receiver.
        overlap: transfers overlap compute (else the sender is busy while sending).
        contention: how many times longer an action takes while every worker computes at once than
            alone: the workers share one machine's cores and memory bandwidth (1: they do not, e.g.
            one GPU each). With ``n`` of ``W`` workers computing, each runs ``1 + (contention - 1)
            (n - 1) / (W - 1)`` times slower than alone; an action's cost is its time alone.
        reduce_overlap: the share of an all-reduce of a stage's gradients (a message to an update)
            that runs beside the workers' compute, from 1 (all of it: a GPU's collectives on a stream
            of their own, the default) to 0 (none: the collective's threads take the processors the
            compute runs on, as on CPU processes filling a machine's cores). The rest of its
            seconds keeps each worker that sends it busy after the backward that made the gradient
            (:func:`~lightning_pipe.runtime.link_speed.allreduce_overlap` measures it).
    """

    forward: Sequence[float]
    backward: Sequence[float]
    input_grad: Sequence[float] | None = None
    weight_grad: Sequence[float] | None = None
    update: Sequence[float] | None = None
    accumulate: Sequence[float] | None = None
    activation_bytes: Sequence[float] | None = None
    saved_bytes: Sequence[float] | None = None
    weight_bytes: Sequence[float] | None = None
    bandwidth: float = math.inf
    latency: float = 0.0
    overhead: float = 0.0
    overlap: bool = True
    contention: float = 1.0
    reduce_overlap: float = 1.0

    @classmethod
    def uniform(cls, stages: int, forward: float = 1.0, backward: float = 2.0, **kwargs: object) -> StageCosts:
        """Identical stages (the papers' unit-cost examples)."""
        return cls(forward=[forward] * stages, backward=[backward] * stages, **kwargs)

    @classmethod
    def from_dict(cls, document: object, source: str = "costs") -> StageCosts:
        """Costs from JSON: ``{"forward": [...], "backward": [...]}`` plus any optional per-stage list
        (``input_grad``, ``weight_grad``, ``update``, ``accumulate``, ``activation_bytes``,
        ``saved_bytes``, ``weight_bytes``) and ``bandwidth``/``latency``/``overhead``/``contention``/
        ``reduce_overlap``/``overlap``."""
        if not isinstance(document, dict) or "forward" not in document or "backward" not in document:
            raise PlanningError(f'{source}: a costs file is a JSON object with "forward" and "backward" lists')
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(document) - known)
        if unknown:
            raise PlanningError(f"{source}: unknown keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**{key: float(v) if key in _SCALARS else v for key, v in document.items()})
        except (TypeError, ValueError) as error:  # StageCosts' own checks say "costs: ..."
            raise PlanningError(f"{source}: {str(error).removeprefix('costs: ')}") from None

    @classmethod
    def from_plan(cls, document: object, source: str = "plan", replicated: bool = False) -> StageCosts:
        """Per-stage costs of a ``lightning-pipe plan --json`` document (contiguous stages). A stage
        replicated ``r`` times is simulated as one worker ``r`` times faster, unless ``replicated``:
        the schedule then places the replicas itself (``1f1b_rr``)."""
        if not isinstance(document, dict) or not isinstance(document.get("stages"), list):
            raise PlanningError(f"{source}: not a plan (run lightning-pipe plan --json to make one)")
        stages = document["stages"]
        for i, stage in enumerate(stages):
            missing = [key for key in _PLAN_FIELDS if key not in stage] if isinstance(stage, dict) else _PLAN_FIELDS
            if missing:
                raise PlanningError(
                    f"{source}: stages[{i}] lacks {', '.join(missing)}: re-create the plan with this version"
                )
            for key in _PLAN_FIELDS:
                if isinstance(stage[key], bool) or not isinstance(stage[key], int | float):
                    raise PlanningError(f"{source}: stages[{i}] {key} must be a number, got {stage[key]!r}")
        replicas = [1 if replicated else stage.get("replicas", 1) for stage in stages]
        bandwidth = document.get("bandwidth_bytes_per_second") or math.inf
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, int | float):
            raise PlanningError(
                f"{source}: bandwidth_bytes_per_second must be bytes per second or null (free), got {bandwidth!r}"
            )
        return cls(
            forward=[stage["forward_seconds"] / r for stage, r in zip(stages, replicas, strict=True)],
            backward=[stage["backward_seconds"] / r for stage, r in zip(stages, replicas, strict=True)],
            activation_bytes=[stage["output_bytes"] for stage in stages],
            saved_bytes=[stage["saved_bytes"] for stage in stages],
            weight_bytes=[stage["param_bytes"] for stage in stages],
            bandwidth=float(bandwidth),
        )

    def __post_init__(self) -> None:
        stages = len(self.forward)
        for name in (
            "forward",
            "backward",
            "input_grad",
            "weight_grad",
            "update",
            "accumulate",
            "activation_bytes",
            "saved_bytes",
            "weight_bytes",
        ):
            values = getattr(self, name)
            if values is not None and len(values) != stages:
                raise PlanningError(f"costs: {name} has {len(values)} entries, forward has {stages}")
            for value in (values or ()) if name != "accumulate" else ():  # may be negative: _check_accumulate
                if not math.isfinite(value) or value < 0:
                    raise PlanningError(f"costs: {name} must hold finite numbers >= 0, got {value!r}")
        self._check_accumulate()
        if math.isnan(self.bandwidth) or self.bandwidth <= 0:
            raise PlanningError(f"costs: bandwidth must be > 0 (or inf), got {self.bandwidth!r}")
        for name in ("latency", "overhead"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise PlanningError(f"costs: {name} must be a finite number of seconds >= 0, got {value!r}")
        check_contention(self.contention, "costs: ")
        check_reduce_overlap(self.reduce_overlap, "costs: ")

    def _check_accumulate(self) -> None:
        """:attr:`accumulate` may be negative (measured beside fewer busy workers), never below the
        whole backward or weight half it adds to."""
        for s, extra in enumerate(self.accumulate or ()):
            floor = min(self.duration(Action(Kind.B, s)), self.duration(Action(Kind.W, s)))
            if not math.isfinite(extra) or floor + extra < 0:
                raise PlanningError(
                    f"costs: accumulate[{s}] must be a finite number of seconds >= -{floor!r} (a backward adding "
                    f"its gradients cannot take less than no time), got {extra!r}"
                )

    @property
    def stages(self) -> int:
        return len(self.forward)

    def duration(self, action: Action, accumulating: bool = False) -> float:
        """Seconds of ``action``; ``accumulating``: a ``B`` or ``W`` that adds into its step's weight
        gradients on the worker (:attr:`accumulate`)."""
        s = action.stage
        extra = self.accumulate[s] if accumulating and self.accumulate is not None else 0.0
        if action.kind is Kind.F:
            return self.forward[s]
        if action.kind is Kind.B:
            return self.backward[s] + extra
        if action.kind is Kind.I:
            return self.input_grad[s] if self.input_grad is not None else self.backward[s] / 2
        if action.kind is Kind.W:
            if self.weight_grad is not None:
                return self.weight_grad[s] + extra
            half = self.input_grad[s] if self.input_grad is not None else self.backward[s] / 2
            return self.backward[s] - half + extra
        if action.kind is Kind.UPDATE:
            return self.update[s] if self.update is not None else 0.0
        return 0.0

    def transfer(self, nbytes: float) -> float:
        """Seconds one message of ``nbytes`` takes."""
        return self.latency + (0.0 if math.isinf(self.bandwidth) else nbytes / self.bandwidth)

    def stage_bytes(self, name: str, stage: int) -> float:
        """Bytes of ``stage`` in the per-stage list ``name`` (``activation_bytes``, ``saved_bytes`` or
        ``weight_bytes``); 0 where it is not given."""
        values = getattr(self, name)
        return 0.0 if values is None else float(values[stage])


def check_contention(value: float, prefix: str = "") -> None:
    """Refuse a :attr:`StageCosts.contention` below 1 or not finite."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value < math.inf:
        raise PlanningError(f"{prefix}contention must be a finite factor >= 1 (1: no sharing), got {value!r}")


def check_reduce_overlap(value: float, prefix: str = "") -> None:
    """Refuse a :attr:`StageCosts.reduce_overlap` outside 0..1."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise PlanningError(
            f"{prefix}reduce_overlap must be a share from 0 (all-reduces keep the workers busy) to 1 (they run "
            f"beside the compute), got {value!r}"
        )


def adds_gradients(actions: Iterable[Action]) -> list[bool]:
    """For each of one worker's ``actions``, in the order it runs them: whether it is a ``B`` or ``W``
    that adds its weight gradients into those its step already has on the worker (each but the first
    of a stage and step: the first keeps what autograd made)."""
    started: set[tuple[int, int]] = set()
    adds = []
    for action in actions:
        gradient = action.kind in (Kind.B, Kind.W)
        key = (action.stage, action.step)
        adds.append(gradient and key in started)
        if gradient:
            started.add(key)
    return adds
