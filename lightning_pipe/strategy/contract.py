"""The model contract: a LightningModule runs unchanged; the pipeline splits its ``forward``.

The step code (``training_step``, ``validation_step``, ...) calls ``self(...)`` (or
``self.forward(...)``) once. The strategy stands in for ``forward`` while the step runs:

- :meth:`Entry.capture` on the first stage: the step runs until it calls ``forward``, whose arguments
  are taken (:class:`Call`) and the step abandoned (the code before the call must treat samples
  independently, since the arguments are cut into micro-batches after it);
- :meth:`Entry.inject` on the last stage: ``forward`` returns the pipeline's output for the
  micro-batch, so the step computes its loss, metrics and logs from it.

What the pipeline runs is ``forward`` itself, captured as a graph of layers
(:mod:`lightning_pipe.capture`): any number of positional and keyword arguments, tensors or not,
nested containers, a loss computed inside. A module may instead define ``configure_pipeline(self)``
returning the ordered layers whose chain computes ``forward`` (one input); the chain is verified
against ``forward`` like a captured graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_pipe.capture import CapturedForward, GraphLayer, capture
from lightning_pipe.capture.compiled import uncompiled
from lightning_pipe.capture.layer_order import branches, searched_order
from lightning_pipe.cost.records import ChainCosts
from lightning_pipe.errors import PipelineRuntimeError, PlanningError
from lightning_pipe.runtime.failure import add_note
from lightning_pipe.util.nested import flatten, tensors

__all__ = ["ELSEWHERE_NOTE", "HOOK", "Call", "Entry", "PipelineModel", "modules_run_whole", "pipeline_model"]

HOOK = "configure_pipeline"

ELSEWHERE_NOTE = (
    "(lightning_pipe) this rank holds only its own stages; the other ranks' weights are on the meta device "
    "here. The step's own code may run the model only through forward (`self(x)`): a submodule called "
    "directly or `model.generate(...)` cannot run in a pipeline. To generate, gather the whole model after "
    "fit (PipelineStrategy(gather_after_fit=True), or `lightning-pipe consolidate` on a checkpoint) and run "
    "it on one device."
)
"""The note an error the step raises carries where the module holds other ranks' stages on the meta device."""


@dataclass
class Call:
    """The arguments a step gave ``forward``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def same(self, other: Call) -> bool:
        """Whether ``other`` holds the same values (the same tensors, or equal ones)."""
        skeleton, found = flatten((self.args, self.kwargs))
        other_skeleton, other_found = flatten((other.args, other.kwargs))
        return skeleton == other_skeleton and same_values(found, other_found)


def same_values(tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> bool:
    """Whether two sequences of tensors hold equal values, pairwise (views of the same memory are
    equal without reading it)."""
    return len(tensors) == len(others) and all(
        a.shape == b.shape
        and (a is b or (a.data_ptr() == b.data_ptr() and a.stride() == b.stride()) or torch.equal(a, b))
        for a, b in zip(tensors, others, strict=True)
    )


ROWS_MIXED = (
    "training_step gave forward an input for a micro-batch that is not that micro-batch's rows of what it gives "
    "forward for the whole batch: under a pipeline the step runs once per micro-batch on the last stage, on the "
    "micro-batch's rows, so its code before forward must treat each row of the batch alone. Rows joined or "
    "reordered across the batch (two views joined with torch.cat, a batch sorted by length) are not: keep a "
    "sample's views next to each other (`z = self(torch.stack([x1, x2], 1).flatten(0, 1))`, then "
    "`z1, z2 = z.unflatten(0, (-1, 2)).unbind(1)`), and reorder or mix rows in on_after_batch_transfer or the "
    "DataLoader's collate_fn"
)
"""Said when a micro-batch's rerun of the step gives ``forward`` other values than the pipeline ran."""


class _Captured(BaseException):
    """Raised by the stand-in ``forward`` to abandon a step once its arguments are taken."""

    def __init__(self, call: Call) -> None:
        super().__init__()
        self.call = call


class Entry:
    """``forward`` of the LightningModule, stood in for while the step code runs."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @contextmanager
    def _standing_in(self, forward: Callable[..., Any]) -> Iterator[None]:
        """``forward`` in place of the module's while the step runs; an error the step raises itself
        reaches the caller as itself, with a note where the module holds other ranks' stages on the
        meta device (:data:`ELSEWHERE_NOTE`)."""
        had_own = "forward" in vars(self.module)
        previous = vars(self.module).get("forward")
        self.module.forward = forward
        try:
            yield
        except Exception as error:
            on_meta = {p.is_meta for p in self.module.parameters()}
            if not isinstance(error, PipelineRuntimeError) and on_meta == {True, False}:  # released, not built on meta
                add_note(error, ELSEWHERE_NOTE)
            raise
        finally:
            if had_own:
                self.module.forward = previous
            else:
                del self.module.forward

    def capture(self, step_code: Callable[..., Any], *args: Any) -> Call:
        """The arguments ``step_code(*args)`` (``training_step``, ``validation_step``, ...) gives
        ``forward`` (the step is abandoned there)."""

        def forward(*inputs: Any, **kwargs: Any) -> Any:
            raise _Captured(Call(inputs, kwargs))

        try:
            with self._standing_in(forward):
                step_code(*args)
        except _Captured as captured:
            return captured.call
        name = getattr(step_code, "__name__", "the step")
        raise PipelineRuntimeError(
            f"{name} never called forward: the pipeline splits the module's forward, so {name} must call it "
            f"(`self(x)` or `self.forward(x)`; code that calls submodules directly, e.g. `self.encoder(x)`, cannot "
            f"be pipelined), or define {HOOK}(self) returning the layers to chain"
        )

    def inject(self, output: Any, check: Callable[[Call], None] | None = None) -> Any:
        """A context in which ``forward`` returns ``output`` instead of computing it. The step may call
        it again with the same arguments (e.g. once for the loss, once for a metric) and gets the same
        output; other arguments are refused (their output is not what the pipeline computed), and
        ``check(call)`` may refuse the first (:meth:`PipelineModel.check_rows`)."""
        seen: list[Call] = []

        def forward(*inputs: Any, **kwargs: Any) -> Any:
            call = Call(inputs, kwargs)
            if not seen:
                if check is not None:
                    check(call)
                seen.append(call)
            elif not seen[0].same(call):
                raise PipelineRuntimeError(
                    "the step called forward with two different inputs: a pipeline runs each micro-batch through "
                    "the layers once per step; pass the inputs in one call, each sample's next to each other (two "
                    "views x1, x2: `z = self(torch.stack([x1, x2], 1).flatten(0, 1))`, then "
                    "`z1, z2 = z.unflatten(0, (-1, 2)).unbind(1)`)"
                )
            return output

        return self._standing_in(forward)


@dataclass
class PipelineModel:
    """The layers a pipeline runs and how a step's :class:`Call` becomes the first layer's input.

    Attributes:
        layers: the ordered layers (each a unit the profiler and partitioners see).
        names: a name per layer, for the plan.
        captured: the captured graph (``None`` for ``configure_pipeline``'s chain).
    """

    layers: list[nn.Module]
    names: list[str]
    captured: CapturedForward | None = None

    def inputs(self, call: Call) -> Any:
        """The first layer's input for ``call``: its tensors in order (a captured graph), or its one
        argument (a ``configure_pipeline`` chain)."""
        if self.captured is None:
            return _single_input(call)
        skeleton, found = flatten((call.args, call.kwargs))
        if skeleton != self.captured.graph.skeleton:
            raise PipelineRuntimeError(
                "forward was called with other non-tensor arguments than it was captured with (the graph holds "
                "them as constants): call it with the same arguments in every step, passing changing values as "
                "tensors"
            )
        return tuple(found)

    def check_rows(self, expected: Any, call: Call) -> None:
        """Refuse, saying why (:data:`ROWS_MIXED`), a micro-batch's ``call`` of ``forward`` whose first
        layer's input (:meth:`inputs`) is not ``expected``: the micro-batch's rows of the batch's, which
        the pipeline ran."""
        if not same_values(tensors(self.inputs(call)), tensors(expected)):
            raise PipelineRuntimeError(ROWS_MIXED)

    @property
    def run_whole(self) -> dict[str, str]:
        """The modules run whole, each inside one layer, as their forward cannot be traced, with why
        (:func:`modules_run_whole`; none for ``configure_pipeline``'s chain)."""
        return {} if self.captured is None else modules_run_whole(self.captured)

    def branches(self) -> bool:
        """Whether the captured layers could run in another order (:mod:`~lightning_pipe.capture.layer_order`)."""
        return self.captured is not None and branches(self.captured.graph, self.captured.grouped)

    def order_for(self, costs: ChainCosts, stages: int) -> tuple[int, ...] | None:
        """The order of the branching layers whose best split into ``stages`` stages is fastest with
        the layers' times in ``costs`` (their profile in the recorded order); None to keep that order."""
        assert self.captured is not None
        seconds = [(layer.forward_seconds, layer.backward_seconds) for layer in costs.layers]
        return searched_order(self.captured.graph, self.captured.grouped, stages, seconds)

    def reordered(self, order: Sequence[int]) -> PipelineModel:
        """The captured layers run in ``order`` (:meth:`~lightning_pipe.capture.CapturedForward.reordered`)."""
        assert self.captured is not None
        captured = self.captured.reordered(order)
        return PipelineModel(list(captured.layers), [spec.name for spec in captured.specs], captured)

    def refuse_changed_attributes(self) -> None:
        """Raise if user code changed a module attribute whose value the captured graph holds (an int,
        bool or string ``forward`` reads, or a float it takes a Python decision on): the layers would
        go on with the old value. Floats ``forward`` computes with are read when the layers run."""
        changed = self.captured.graph.changed_attributes() if self.captured is not None else []
        if changed:
            entry = changed[0]
            now = vars(entry.module).get(entry.name)
            where = f"{entry.path}.{entry.name}" if entry.path else entry.name
            raise PipelineRuntimeError(
                f"{where} changed from {entry.value!r} to {now!r} since the pipeline captured forward, which "
                f"holds its value as a constant (read at {entry.line}): the layers would go on with "
                f"{entry.value!r}. A float that forward computes with is read when the layers run; one it takes a "
                "Python decision on (if, range, a shape), or an int, bool or string, is fixed at capture. Keep it "
                "fixed during training, or make it a tensor (a buffer) and compute with it (torch.where instead "
                "of if)"
            )

    def follow_mode(self, training: bool) -> None:
        """Captured layers run their train or eval code as the LightningModule is in train or eval mode
        (set on the layers only: the user's modules keep the modes the user gave them)."""
        for layer in self.layers:
            if isinstance(layer, GraphLayer):
                layer.training = training

    @property
    def batch_reduced(self) -> bool:
        """Whether ``forward`` returns a reduction over the micro-batch (a 0-d tensor such as a loss):
        outputs of micro-batches cannot then be joined into the batch's."""
        if self.captured is None:
            return False
        graph = self.captured.graph
        output = next(n for n in graph.graph.nodes if n.op == "output")
        values = [graph.shadows[n].value for n in output.all_input_nodes if n in graph.shadows]
        return any(t.dim() == 0 for value in values for t in tensors(value))


def pipeline_model(module: nn.Module, call: Call, stages: int) -> PipelineModel:
    """The layers of ``module`` for a pipeline of ``stages`` stages: ``configure_pipeline``'s, or
    ``forward`` captured on ``call`` (one micro-batch). Compiled modules are taken uncompiled, as the
    code is written (:func:`~lightning_pipe.capture.compiled.uncompiled`): the layers hold the originals."""
    hook = getattr(module, HOOK, None)
    if callable(hook):
        with uncompiled(module):
            layers = _as_layers(hook(), f"{type(module).__name__}.{HOOK}()")
        _refuse_untrained(module, layers)
        return PipelineModel(layers, [type(layer).__name__ for layer in layers])
    with uncompiled(module):
        captured = capture(module, call.args, call.kwargs, stages=stages)
    return PipelineModel(list(captured.layers), [spec.name for spec in captured.specs], captured)


def modules_run_whole(captured: CapturedForward) -> dict[str, str]:
    """The modules of ``captured`` whose forward could not be traced, each run whole inside one layer,
    with why: the outermost of them (a module inside one runs whole with it)."""
    leaves = captured.graph.leaves
    return {path: why for path, why in leaves.items() if not any(path.startswith(f"{other}.") for other in leaves)}


def _single_input(call: Call) -> Any:
    if len(call.args) != 1 or call.kwargs:
        raise PlanningError(
            f"forward was called with {len(call.args)} positional and {len(call.kwargs)} keyword arguments: the "
            f"first layer of a {HOOK}() chain takes one input (a tensor, or a tuple/list/dict of tensors); without "
            f"{HOOK} the pipeline captures forward with any arguments"
        )
    return call.args[0]


def _as_layers(value: object, source: str) -> list[nn.Module]:
    modules = isinstance(value, Sequence) and all(isinstance(layer, nn.Module) for layer in value)
    if not (isinstance(value, nn.Sequential | nn.ModuleList) or modules):
        raise PlanningError(f"{source} must return an nn.Sequential or a list of modules; got {type(value).__name__}")
    layers = list(value)
    if not layers:
        raise PlanningError(f"{source} returned no layers")
    return layers


def _refuse_untrained(module: nn.Module, layers: list[nn.Module]) -> None:
    inside = {id(p) for layer in layers for p in layer.parameters()}
    outside = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        shown = ", ".join(outside[:5]) + (", ..." if len(outside) > 5 else "")
        raise PlanningError(
            f"trainable parameters outside the layers of {HOOK}() would not be trained by the pipeline: {shown}; "
            f"return layers that include their modules (or remove {HOOK} to let the pipeline capture forward)"
        )
