"""The model contract: where a LightningModule keeps the layers to pipeline, and how the strategy
runs the module's own step code around them.

A module qualifies in one of two ways:

- **one ``nn.Sequential`` attribute** that ``forward`` calls (``self.net = nn.Sequential(...)``), and no
  trainable parameter outside it;
- **the hook** ``configure_pipeline(self) -> nn.Sequential`` (or a list of modules) returning the
  ordered layers whose chained forward equals ``self.forward`` (e.g.
  ``lightning_pipe.models.chain_from_model(self.model)`` for a torchvision ResNet or VGG); the layers
  must hold every trainable parameter of the module.

The step code (``training_step``, ``validation_step``, ...) runs unchanged. The strategy stands in for
the *entry* — the Sequential, or ``self.forward`` under the hook — while it runs:

- :meth:`Entry.capture` on the first stage: the step runs until it calls the entry, whose input is
  taken and the step abandoned (the code before the entry must treat samples independently, since
  the input is cut into micro-batches after it is taken);
- :meth:`Entry.inject` on the last stage: the entry returns the pipeline's output for the
  micro-batch, so the step computes its loss, metrics and logs from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pipe.errors import PlanningError
from lightning_pipe.nested import tensors

__all__ = ["HOOK", "Entry", "find_entry"]

HOOK = "configure_pipeline"


class _Captured(BaseException):
    """Raised by the entry to abandon a step once its input is taken."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


@dataclass
class Entry:
    """The layers to pipeline and the module whose ``forward`` stands for them in the step code.

    Attributes:
        layers: the ordered layers (each one a unit the profiler and partitioners see).
        module: the module whose ``forward`` is intercepted (the Sequential or the LightningModule).
        name: how the user's code names it, for messages (``self.net`` or ``self.forward``).
    """

    layers: list[nn.Module]
    module: nn.Module
    name: str

    @contextmanager
    def _standing_in(self, forward: Callable[..., Any]) -> Iterator[None]:
        had_own = "forward" in vars(self.module)
        previous = vars(self.module).get("forward")
        self.module.forward = forward
        try:
            yield
        finally:
            if had_own:
                self.module.forward = previous
            else:
                del self.module.forward

    def capture(self, step: Callable[..., Any], *args: Any) -> Any:
        """The input ``step(*args)`` gives the entry (the step is abandoned there)."""

        def forward(*inputs: Any, **kwargs: Any) -> Any:
            raise _Captured(self._single_input(inputs, kwargs))

        try:
            with self._standing_in(forward):
                step(*args)
        except _Captured as captured:
            return captured.value
        raise PlanningError(
            f"{getattr(step, '__name__', 'the step')} never called {self.name}: the pipeline runs the layers of "
            f"{self.name}, so the step must call it (e.g. `self(x)` with forward calling {self.name})"
        )

    def inject(self, output: Any) -> Any:
        """A context in which the entry returns ``output`` instead of computing it. The step may call
        it again on the same input (e.g. once for the loss, once for a metric) and gets the same
        output; another input is refused (its output is not what the pipeline computed)."""
        seen: list[Any] = []

        def forward(*inputs: Any, **kwargs: Any) -> Any:
            given = self._single_input(inputs, kwargs)
            if not seen:
                seen.append(given)
            elif not _same(seen[0], given):
                raise PlanningError(
                    f"the step called {self.name} on two different inputs: a pipeline runs each micro-batch "
                    "through the layers once per step"
                )
            return output

        return self._standing_in(forward)

    def _single_input(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if len(inputs) != 1 or kwargs:
            raise PlanningError(
                f"{self.name} was called with {len(inputs)} positional and {len(kwargs)} keyword arguments: the "
                "first layer of a pipeline takes one input (a tensor, or a tuple/list/dict of tensors)"
            )
        return inputs[0]


def _same(first: Any, second: Any) -> bool:
    """Whether two inputs of the entry hold the same tensors (the same objects, or equal values)."""
    a, b = tensors(first), tensors(second)
    if len(a) != len(b):
        return False
    return all(x is y or (x.shape == y.shape and torch.equal(x, y)) for x, y in zip(a, b, strict=True))


def _as_layers(value: object, source: str) -> list[nn.Module]:
    modules = isinstance(value, Sequence) and all(isinstance(layer, nn.Module) for layer in value)
    if not (isinstance(value, nn.Sequential | nn.ModuleList) or modules):
        raise PlanningError(f"{source} must return an nn.Sequential or a list of modules; got {type(value).__name__}")
    layers = list(value)
    if not layers:
        raise PlanningError(f"{source} returned no layers")
    return layers


def find_entry(module: nn.Module) -> Entry:
    """The pipeline's layers of ``module`` and the entry its step code calls (see the module docstring).

    Raises:
        PlanningError: no Sequential and no hook, several Sequentials, or trainable parameters outside
            the layers (they would not be trained).
    """
    hook = getattr(module, HOOK, None)
    if callable(hook):
        entry = Entry(_as_layers(hook(), f"{type(module).__name__}.{HOOK}()"), module, "self.forward")
    else:
        found = [(name, child) for name, child in module.named_children() if isinstance(child, nn.Sequential)]
        if not found:
            raise PlanningError(
                f"{type(module).__name__} holds no nn.Sequential: keep the network in one nn.Sequential attribute "
                f"that forward calls, or define {HOOK}(self) returning the ordered layers whose chain computes forward"
            )
        if len(found) > 1:
            names = ", ".join(f"self.{name}" for name, _ in found)
            raise PlanningError(
                f"{type(module).__name__} holds several nn.Sequential attributes ({names}): define {HOOK}(self) "
                "returning the one chain of layers forward computes"
            )
        name, child = found[0]
        entry = Entry(_as_layers(child, f"self.{name}"), child, f"self.{name}")
    inside = {id(p) for layer in entry.layers for p in layer.parameters()}
    outside = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        shown = ", ".join(outside[:5]) + (", ..." if len(outside) > 5 else "")
        raise PlanningError(
            f"trainable parameters outside {entry.name} would not be trained by the pipeline: {shown}; move their "
            f"modules into the layers (or define {HOOK} to return layers that include them)"
        )
    return entry
