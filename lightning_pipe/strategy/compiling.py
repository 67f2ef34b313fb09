"""Each stage compiled: what a rank runs, with the settings the user gave ``torch.compile``.

A model holding compiled modules (:mod:`lightning_pipe.capture.compiled`) is captured uncompiled;
each stage is then compiled as a whole: the forward of its layers, chained, is one function that
``torch.compile`` compiles with the model's settings (:class:`StageFunction`; the backward follows it,
through AOTAutograd for backends that use it). The stage's module (:class:`CompiledStage`) calls that
function, so every way the runtime computes a stage runs it compiled: the live weights, a kept weight
version of a delayed-weight schedule, recomputation in the backward (the same graphs, under the
forward's random state) and evaluation.

- A kept weight version computes through ``functional_call`` on the stage itself (the runtime's way for
  a module it cannot copy: :class:`CompiledStage` refuses to be copied), not through a copy of the
  stage: a copy's ``GraphModule`` code would be of new classes, which dynamo's guards tell apart, so
  every copy (made again after each drain) would be compiled anew. Dynamo guards a parameter's shape,
  not which tensor it is: a version's weights run the stage's graphs.
- Each stage's function has a code object of its own, named after the stage (``stage_1``): dynamo
  keeps compiled graphs per code object, so one stage's graphs (train and eval code, with and without
  autograd, the smaller last micro-batch) never count against another's ``recompile_limit``. With
  ``dynamic=None`` (the default) a stage is compiled for the first micro-batch's shapes and once more,
  with the changed sizes dynamic, at the first other shape.
- A stage whose compilation fails runs eagerly from then on, with a warning naming the error. While a
  stage's forward records autograd, AOTAutograd compiles the backward with the forward (not at the
  first backward, where nothing could run eagerly instead), so a backward that fails is found there.
- Not compiled, and said at set-up: a stage with batch norm layers in training (their running
  statistics move once per step through hooks, :mod:`lightning_pipe.runtime.batch_norm`, whose
  per-micro-batch state a compiled graph would be compiled again for at every micro-batch), and a
  stage whose backward zero bubble splits into input and weight gradients (the split resumes autograd's
  nodes, and a compiled stage is one node: its backward would run twice). For the same reason a
  flushing schedule's cool-down backwards are not split when stages are compiled (``early_gradients``
  off: the same arithmetic, in the order of a plain backward).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pipe.capture.compiled import CompileSettings
from lightning_pipe.runtime.batch_norm import batch_norms
from lightning_pipe.schedule.ir import Kind, Schedule

__all__ = ["CompiledStage", "StageCompilation", "StageFunction"]

_BATCH_NORM = (
    "its batch norm layers move their running statistics once per step through hooks whose per-micro-batch "
    "state a compiled graph would be compiled again for at every micro-batch"
)
_SPLIT = (
    "zero bubble splits its backward into input and weight gradients by resuming autograd's nodes, and a "
    "compiled stage is one node, whose backward would run twice"
)


def _chain(stage: nn.Module, carried: Any) -> Any:
    for layer in stage:
        carried = layer(carried)
    return carried


class StageFunction:
    """The forward of one stage's layers, compiled with ``settings``; eager once compiling failed."""

    def __init__(self, stage: int, settings: CompileSettings) -> None:
        self.stage, self.settings = stage, settings
        # a code object of its own: dynamo keeps the stage's compiled graphs apart from other stages'
        self.eager: Callable[[nn.Module, Any], Any] = types.FunctionType(
            _chain.__code__.replace(co_name=f"stage_{stage}"), _chain.__globals__, f"stage_{stage}"
        )
        self.compiled: Callable[[nn.Module, Any], Any] | None = None
        try:
            self.compiled = settings.compile(self.eager)
        except Exception as error:  # an unknown backend, a mode and options together
            self._give_up(error)

    def __call__(self, stage: nn.Module, carried: Any) -> Any:
        if self.compiled is None:
            return self.eager(stage, carried)
        try:
            with _backward_with_forward():
                return self.compiled(stage, carried)
        except Exception as error:
            result = self.eager(stage, carried)  # the model's own error, if it fails eagerly too
            self._give_up(error)
            return result

    def _give_up(self, error: Exception) -> None:
        self.compiled = None
        warnings.warn(
            f"stage {self.stage} runs eagerly: compiling it with {self.settings} failed with {_named(error)}",
            stacklevel=3,
        )


def _named(error: Exception) -> str:
    """``Type: message``, the message up to its first blank line (dynamo's advice follows it)."""
    lines = []
    for line in str(error).splitlines():
        if not line.strip():
            if lines:
                break
            continue
        lines.append(line.strip())
    return f"{type(error).__name__}: {' '.join(lines)}"


@contextmanager
def _backward_with_forward() -> Iterator[None]:
    """With autograd recording, AOTAutograd compiles a graph's backward together with its forward."""
    if not torch.is_grad_enabled():
        yield
        return
    config = torch._functorch.config
    before = config.force_non_lazy_backward_lowering
    config.force_non_lazy_backward_lowering = True
    try:
        yield
    finally:
        config.force_non_lazy_backward_lowering = before


class CompiledStage(nn.Sequential):
    """A stage's layers (the model's own), run by a :class:`StageFunction`."""

    def __init__(self, layers: nn.Sequential, function: StageFunction) -> None:
        super().__init__(*layers)
        self.function = function

    def forward(self, carried: Any) -> Any:
        return self.function(self, carried)

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledStage:
        raise TypeError(
            "a compiled stage is not copied: a copy's GraphModules would be compiled anew; a weight version "
            "computes through functional_call on the stage itself"
        )

    def extra_repr(self) -> str:
        return f"compiled with {self.function.settings}" if self.function.compiled is not None else "eager"


@dataclass(frozen=True)
class StageCompilation:
    """Which stages run compiled, with which settings (and where they were read), and why the others
    do not.

    Attributes:
        settings: what ``torch.compile`` is given for every stage.
        origin: where the settings come from, for the set-up message.
        eager: stage -> why it runs uncompiled.
        stages: how many stages the pipeline has.
    """

    settings: CompileSettings
    origin: str
    eager: dict[int, str]
    stages: int

    @classmethod
    def of(
        cls, found: Sequence[tuple[str, CompileSettings | None]], stages: Sequence[nn.Module], schedule: Schedule
    ) -> StageCompilation:
        """The compilation of ``stages`` run by ``schedule`` for a model whose compiled modules are
        ``found`` (path, settings; the first one's settings are every stage's)."""
        name, settings = found[0]
        origin = f"those of {name}'s torch.compile"
        if settings is None:
            settings, origin = CompileSettings(), f"torch.compile's defaults: {name}'s compiled call hides its own"
        others = sorted({other for other, theirs in found[1:] if theirs != settings})
        if others:
            origin += f"; {', '.join(others)}, compiled otherwise, run with them too"
        split = {action.stage for _, _, action in schedule.actions() if action.kind is Kind.I}
        eager = {}
        for s, stage in enumerate(stages):
            if batch_norms(stage):
                eager[s] = _BATCH_NORM
            elif s in split:
                eager[s] = _SPLIT
        return cls(settings, origin, eager, len(stages))

    @property
    def compiled(self) -> list[int]:
        """The stages that run compiled."""
        return [s for s in range(self.stages) if s not in self.eager]

    def modules(self, stages: Sequence[nn.Sequential], mine: set[int]) -> list[nn.Module]:
        """``stages`` with this rank's compiled ones (``mine``) as :class:`CompiledStage`."""
        return [
            CompiledStage(stage, StageFunction(s, self.settings)) if s in mine and s not in self.eager else stage
            for s, stage in enumerate(stages)
        ]

    def summary(self) -> str:
        """The set-up message: the settings, the stages compiled and the others with their reason."""
        compiled = self.compiled
        if compiled:
            said = (
                f"Compiled per stage with {self.settings} ({self.origin}): stage{'s' if len(compiled) > 1 else ''} "
                f"{', '.join(map(str, compiled))}, each the forward of its layers as one function"
            )
        else:
            said = f"The model's compiled modules run uncompiled (settings: {self.settings}, {self.origin})"
        reasons = [f"stage {s} runs eagerly: {why}" for s, why in sorted(self.eager.items())]
        return "; ".join([said, *reasons])
