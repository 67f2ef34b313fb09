"""Per-layer cost records for a chain of layers: the planner's input.

A model is planned as a chain of layers ``l = 0 .. L-1`` (docs/design.md vocabulary; the papers count
from 1). Each layer carries what Beaumont et al. (§3.1) call ``u_F``, ``u_B``, ``a_l`` and ``W_l``,
plus what PipeDream's profiler records (activation and parameter sizes) and the bytes that autograd
really keeps for the backward pass.

All times are seconds, all sizes bytes, per micro-batch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from lightning_pipe.errors import PlanningError

__all__ = ["ChainCosts", "LayerCost", "SharedParameters"]


@dataclass(frozen=True)
class LayerCost:
    """Measured (or loaded) cost of one layer for one micro-batch.

    Attributes:
        name: a human readable name (module path or description).
        forward_seconds: forward time ``u_F``.
        backward_seconds: backward time ``u_B``.
        activation_bytes: bytes of the layer's output ``a_l`` (what crosses a stage boundary).
        saved_bytes: bytes autograd keeps from this layer's forward until its backward.
        param_bytes: bytes of the layer's parameters (one copy of the weights).
        flops: forward + backward floating point operations, when known.
        kept_gradient_bytes: bytes of the gradients a backward split in two halves keeps from the
            input half until the weight half (:class:`~lightning_pipe.runtime.split_backward.SplitBackward`):
            what flows into the layer's weight-owning autograd nodes; 0 when not measured.
        shared_saved_bytes: of ``saved_bytes``, the input this layer saves that the previous layer
            also saved as its output (a ReLU's output, then a convolution's input: one storage). Run
            in one stage, the two keep it once (:meth:`ChainCosts.saved_between`); at a stage
            boundary the input is a received copy, kept apart. 0 for the first layer and when not
            measured.
        backward_bytes: bytes the layer's backward holds at its peak beyond its saved activations and
            its parameters' gradients (its output's gradient, its input's, what it computes in
            between: :mod:`~lightning_pipe.cost.backward_bytes`); a stage holds its largest layer's
            on top of what it keeps (:meth:`~lightning_pipe.cost.memory.MemoryModel.transient_bytes`).
            0 when not measured.
        largest_param_bytes: bytes of its largest parameter that takes a gradient: autograd adds each
            parameter's new gradient into the one an earlier micro-batch made as soon as it is made
            (``grad += new``), one parameter at a time, so a backward adding to a gradient holds at
            most this much more (:meth:`~lightning_pipe.cost.memory.MemoryModel.transient_bytes`);
            ``None`` when not measured (then all of ``param_bytes`` counts: :attr:`accumulated_bytes`).
        first_backward_bytes: what a step's first backward of the layer holds at its peak beyond its
            saved activations and the whole of the gradients it leaves: its peak with those gradients
            counted as they are made, less all of them. The running sum can peak before the weights'
            gradients exist (a language model's loss: the logits' gradients, then the LM head's),
            so this is at most :attr:`backward_bytes`; ``None`` when not measured (then
            :attr:`first_bytes` is :attr:`backward_bytes`).
    """

    name: str
    forward_seconds: float
    backward_seconds: float
    activation_bytes: float
    saved_bytes: float
    param_bytes: float
    flops: float | None = None
    kept_gradient_bytes: float = 0.0
    shared_saved_bytes: float = 0.0
    backward_bytes: float = 0.0
    largest_param_bytes: float | None = None
    first_backward_bytes: float | None = None

    def __post_init__(self) -> None:
        numbers = {
            "forward_seconds": self.forward_seconds,
            "backward_seconds": self.backward_seconds,
            "activation_bytes": self.activation_bytes,
            "saved_bytes": self.saved_bytes,
            "param_bytes": self.param_bytes,
            "kept_gradient_bytes": self.kept_gradient_bytes,
            "shared_saved_bytes": self.shared_saved_bytes,
            "backward_bytes": self.backward_bytes,
        }
        if self.flops is not None:
            numbers["flops"] = self.flops
        if self.largest_param_bytes is not None:
            numbers["largest_param_bytes"] = self.largest_param_bytes
        if self.first_backward_bytes is not None:
            numbers["first_backward_bytes"] = self.first_backward_bytes
        for key, value in numbers.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise PlanningError(f"layer {self.name!r}: {key} must be a finite number >= 0, got {value!r}")
        if self.shared_saved_bytes > self.saved_bytes:
            raise PlanningError(
                f"layer {self.name!r}: shared_saved_bytes ({self.shared_saved_bytes}) is part of saved_bytes "
                f"({self.saved_bytes}) and cannot exceed it"
            )

    @property
    def accumulated_bytes(self) -> float:
        """What a backward adding into an earlier micro-batch's gradient holds for a moment beyond
        :attr:`backward_bytes`: :attr:`largest_param_bytes` (every parameter's bytes where it was not
        measured), and no more than its peak with the new gradients counted as they are made allows
        (:attr:`first_bytes` and the gradients), which also bounds a backward freeing each new
        gradient once added."""
        largest = self.param_bytes if self.largest_param_bytes is None else self.largest_param_bytes
        return max(min(largest, self.first_bytes + self.param_bytes - self.backward_bytes), 0.0)

    @property
    def first_bytes(self) -> float:
        """What a step's first backward holds beyond the gradients it leaves: :attr:`first_backward_bytes`,
        or :attr:`backward_bytes` where it was not measured."""
        return self.backward_bytes if self.first_backward_bytes is None else self.first_backward_bytes

    @property
    def seconds(self) -> float:
        """Forward plus backward time, the layer's share of a stage's time per micro-batch."""
        return self.forward_seconds + self.backward_seconds


@dataclass(frozen=True)
class SharedParameters:
    """Parameters several layers use (tied weights: a GPT's token embedding and its LM head), counted
    in each of those layers' ``param_bytes``. Stages on different workers each keep a copy; stages on
    one worker hold them once under a flushing schedule (:mod:`~lightning_pipe.runtime.ties`).

    Attributes:
        layers: the layers using them, in order (two or more).
        param_bytes: their bytes.
    """

    layers: tuple[int, ...]
    param_bytes: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if len(self.layers) < 2 or list(self.layers) != sorted(set(self.layers)) or self.layers[0] < 0:
            raise PlanningError(f"shared parameters need two or more distinct layers in order, got {self.layers}")
        if not math.isfinite(self.param_bytes) or self.param_bytes < 0:
            raise PlanningError(f"shared parameter bytes must be a finite number >= 0, got {self.param_bytes!r}")


@dataclass(frozen=True)
class ChainCosts:
    """Costs of an ordered chain of layers.

    Attributes:
        layers: the layers in execution order.
        boundary_bytes: for each cut position ``i`` (between layer ``i`` and ``i + 1``), the bytes of
            activations that cross the cut. For a true chain this is ``layers[i].activation_bytes``;
            for a DAG laid out in topological order it also counts skip connections that jump over
            the cut. Defaults to the chain value.
        name: what was profiled.
        notes: remarks about how the costs were obtained (e.g. a DAG linearised into a chain).
        meta: free-form provenance (batch size, device, source file ...).
        shared: the parameters several layers use, each group once.
    """

    layers: tuple[LayerCost, ...]
    boundary_bytes: tuple[float, ...] = ()
    name: str = ""
    notes: tuple[str, ...] = ()
    meta: dict[str, object] = field(default_factory=dict, compare=False)
    shared: tuple[SharedParameters, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            raise PlanningError(
                f"{self.name or 'the model'} has no layers: nothing to partition "
                "(give an nn.Sequential or a non-empty list of modules)"
            )
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.boundary_bytes:
            object.__setattr__(self, "boundary_bytes", tuple(layer.activation_bytes for layer in self.layers[:-1]))
        object.__setattr__(self, "boundary_bytes", tuple(self.boundary_bytes))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "shared", tuple(self.shared))
        for group in self.shared:
            if group.layers[-1] >= len(self.layers):
                raise PlanningError(f"shared parameters name layer {group.layers[-1]} of {len(self.layers)}")
        if len(self.boundary_bytes) != len(self.layers) - 1:
            raise PlanningError(
                f"boundary_bytes has {len(self.boundary_bytes)} entries, expected "
                f"{len(self.layers) - 1} (one per cut between {len(self.layers)} layers)"
            )
        for i, value in enumerate(self.boundary_bytes):
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise PlanningError(f"boundary_bytes[{i}] must be a finite number >= 0, got {value!r}")
        if self.layers[0].shared_saved_bytes:
            raise PlanningError(
                f"layer {self.layers[0].name!r} is the first: it shares no saved storage with a layer before it "
                f"(shared_saved_bytes must be 0, got {self.layers[0].shared_saved_bytes})"
            )
        for before, layer in itertools.pairwise(self.layers):
            if layer.shared_saved_bytes > before.saved_bytes:
                raise PlanningError(
                    f"layer {layer.name!r}: shared_saved_bytes ({layer.shared_saved_bytes}) is saved by the layer "
                    f"before it too, whose saved_bytes ({before.saved_bytes}) cannot be less"
                )

    def __len__(self) -> int:
        return len(self.layers)

    @classmethod
    def from_lists(
        cls,
        forward: Sequence[float],
        backward: Sequence[float] | None = None,
        *,
        activation: Sequence[float] | None = None,
        saved: Sequence[float] | None = None,
        params: Sequence[float] | None = None,
        flops: Sequence[float] | None = None,
        kept: Sequence[float] | None = None,
        shared: Sequence[float] | None = None,
        transient: Sequence[float] | None = None,
        name: str = "chain",
    ) -> ChainCosts:
        """Build a chain from parallel lists (missing lists mean zeros); handy for tests and papers.

        ``saved`` defaults to ``activation``: a layer keeps its output for backward, the usual
        assumption of the papers when nothing was measured.
        """
        n = len(forward)
        zeros = [0.0] * n
        backward = list(backward) if backward is not None else zeros
        activation = list(activation) if activation is not None else zeros
        saved = list(saved) if saved is not None else activation
        params = list(params) if params is not None else zeros
        kept = list(kept) if kept is not None else zeros
        shared = list(shared) if shared is not None else zeros
        transient = list(transient) if transient is not None else zeros
        for label, values in (
            ("backward", backward),
            ("activation", activation),
            ("saved", saved),
            ("params", params),
            ("flops", flops or zeros),
            ("kept", kept),
            ("shared", shared),
            ("transient", transient),
        ):
            if len(values) != n:
                raise PlanningError(f"{label} has {len(values)} entries, forward has {n}")
        layers = tuple(
            LayerCost(
                name=f"layer{i}",
                forward_seconds=forward[i],
                backward_seconds=backward[i],
                activation_bytes=activation[i],
                saved_bytes=saved[i],
                param_bytes=params[i],
                flops=None if flops is None else flops[i],
                kept_gradient_bytes=kept[i],
                shared_saved_bytes=shared[i],
                backward_bytes=transient[i],
            )
            for i in range(n)
        )
        return cls(layers=layers, name=name)

    def scaled(self, factor: float) -> ChainCosts:
        """The costs of a micro-batch ``factor`` times as large, assuming every time and activation
        grows with the rows (no fixed cost per micro-batch): seconds, activation, saved, kept and backward bytes,
        FLOPs and the bytes crossing each cut scale; parameter bytes do not."""
        if not math.isfinite(factor) or factor <= 0:
            raise PlanningError(f"a scale factor must be a finite number > 0, got {factor!r}")
        layers = tuple(
            replace(
                layer,
                forward_seconds=layer.forward_seconds * factor,
                backward_seconds=layer.backward_seconds * factor,
                activation_bytes=layer.activation_bytes * factor,
                saved_bytes=layer.saved_bytes * factor,
                shared_saved_bytes=layer.shared_saved_bytes * factor,
                kept_gradient_bytes=layer.kept_gradient_bytes * factor,
                backward_bytes=layer.backward_bytes * factor,
                first_backward_bytes=None if layer.first_backward_bytes is None else layer.first_bytes * factor,
                flops=None if layer.flops is None else layer.flops * factor,
            )
            for layer in self.layers
        )
        return replace(self, layers=layers, boundary_bytes=tuple(b * factor for b in self.boundary_bytes))

    def slowed(self, factor: float) -> ChainCosts:
        """The costs with every time ``factor`` times as long and nothing else changed (a profile
        corrected by the rate a run measured)."""
        if not math.isfinite(factor) or factor <= 0:
            raise PlanningError(f"a time factor must be a finite number > 0, got {factor!r}")
        layers = tuple(
            replace(
                layer, forward_seconds=layer.forward_seconds * factor, backward_seconds=layer.backward_seconds * factor
            )
            for layer in self.layers
        )
        return replace(self, layers=layers)

    def rescaled(self, forward_seconds: float, backward_seconds: float) -> ChainCosts:
        """The costs with the layers' forward times scaled to sum to ``forward_seconds`` and their
        backward times to ``backward_seconds`` (the chain timed whole), each layer keeping its share."""
        forwards, backwards = self.column("forward_seconds"), self.column("backward_seconds")
        for name, total, parts in (("forward", forward_seconds, forwards), ("backward", backward_seconds, backwards)):
            if not math.isfinite(total) or total <= 0 or sum(parts) <= 0:
                raise PlanningError(f"cannot rescale {name} times summing to {sum(parts)!r} to {total!r} seconds")
        f, b = forward_seconds / sum(forwards), backward_seconds / sum(backwards)
        layers = tuple(
            replace(layer, forward_seconds=layer.forward_seconds * f, backward_seconds=layer.backward_seconds * b)
            for layer in self.layers
        )
        return replace(self, layers=layers)

    def saved_between(self, first: int, last: int) -> float:
        """The bytes layers ``first .. last`` keep for their backward run together, as one stage: each
        layer's ``saved_bytes``, the storages two neighbours both save once (``shared_saved_bytes``
        of every layer after the first)."""
        return sum(self.layers[i].saved_bytes for i in range(first, last + 1)) - sum(
            self.layers[i].shared_saved_bytes for i in range(first + 1, last + 1)
        )

    def held_between(self, first: int, last: int) -> float:
        """What a stage of layers ``first .. last`` holds per micro-batch in flight: what they keep for
        their backward (:meth:`saved_between`) and, where ``last`` is the model's last layer, the
        model's output, which the runtime keeps as the roots of the micro-batch's backward until it
        runs (a language model's logits, which its loss does not save: on one CPU process a
        ``transformers`` GPT-2's last stage allocated two logits' worth per micro-batch, where its
        layers save one)."""
        output = self.layers[-1].activation_bytes if last == len(self.layers) - 1 else 0.0
        return self.saved_between(first, last) + output

    def held_column(self) -> list[float]:
        """Each layer's ``saved_bytes``, the model's output added to the last layer's
        (:meth:`held_between` over a span is ``saved_between`` over this column)."""
        held = self.column("saved_bytes")
        held[-1] += self.layers[-1].activation_bytes
        return held

    def column(self, key: str) -> list[float]:
        """One per-layer quantity as a list: ``seconds``, ``param_bytes``, ``flops``, ..."""
        if key == "flops" and any(layer.flops is None for layer in self.layers):
            raise PlanningError(
                f"{self.name or 'this profile'} has no FLOP counts: profile the model with "
                "lightning_pipe (torch.utils.flop_counter) or balance by 'time' or 'params'"
            )
        return [float(getattr(layer, key)) for layer in self.layers]
