"""Module attributes read by a traced ``forward``: floats read afresh when the layer runs
(:class:`LiveAttributes`, :class:`LiveRead`) and other values the graph holds (:class:`Decided`),
checked on every step for a change (docs/design.md, "The data flow")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["Decided", "LiveAttributes", "LiveRead"]

_MISSING = object()


class LiveAttributes:
    """What a graph node reads a module's float attributes through when the layer runs: the module
    itself, held by reference (a plain object, not a submodule of the layer; copies of the layer, as
    weight versions make, read the same module)."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __getattr__(self, name: str) -> Any:
        own = vars(self.module)  # the instance's own value, as ``module.name`` reads it
        return own[name] if name in own else getattr(self.module, name)

    def __deepcopy__(self, memo: dict[int, Any]) -> LiveAttributes:
        return self


@dataclass(frozen=True)
class LiveRead:
    """An operand read from a module's float attribute when the layer runs (``getattr(holder, name)``,
    ``holder`` the :class:`LiveAttributes` at ``target``); ``value`` is what it was at the capture.
    The graphs hold it as a constant operand (so that the train and eval graphs, and the traces on
    other numbers of rows, keep the same nodes); each layer's code reads it afresh."""

    target: str
    name: str
    value: float


@dataclass(frozen=True)
class Decided:
    """A module attribute whose value the captured graph holds: read by ``forward`` as a constant (an
    int, a bool, a string) or decided on (``if self.scale > 0``), at ``line``."""

    module: nn.Module
    path: str
    name: str
    value: Any
    line: str

    def changed(self) -> bool:
        now = vars(self.module).get(self.name, _MISSING)
        try:
            return bool(now != self.value)
        except Exception:  # a value that cannot say whether it changed: taken as unchanged
            return False
