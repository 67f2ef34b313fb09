"""Check, before any update, that the layers chained together compute ``forward``.

:func:`verify_chain` runs the module's own ``forward`` and the chain of layers on the same micro-batch,
in eval mode and, when asked, in train mode (the same random state for both runs, so dropout draws the
same masks), and compares the outputs: their structure (the same types, keys and constants: a
``ModelOutput`` must not come back as a plain ``dict``), then every tensor. On a mismatch it runs both
again, recording every module call, and names the first call whose output differs between the two runs (both call the
model's own modules, so forward hooks see the same calls in the same order) and the layer that makes
it; when every module call agrees, the difference is in code after the last one
(``configure_pipeline`` returning ``chain_from_model(self.model)`` without the ``F.log_softmax`` that
``forward`` applies, for instance). Nothing is left changed: modes, buffers and the random number
generators are restored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from lightning_pipe.errors import PlanningError
from lightning_pipe.util.nested import flatten

__all__ = ["ChainMismatch", "verify_chain"]


class ChainMismatch(PlanningError):
    """The chained layers do not compute ``forward``."""


def verify_chain(
    module: nn.Module,
    layers: Sequence[nn.Module],
    forward: Callable[[], Any],
    first_input: Any,
    names: Sequence[str],
    tolerance: float = 1e-5,
    modes: Sequence[bool] = (False, True),
) -> None:
    """Refuse the chain unless ``layers`` applied one after the other to ``first_input`` give what
    ``forward()`` (the module's own forward on the same micro-batch) gives, in each of ``modes``
    (``False``: eval, ``True``: train; a captured graph whose code is the same in both modes needs
    eval only: every difference between the modes is then inside the modules, which run as they are).

    Raises:
        ChainMismatch: with the largest difference, the mode, the first differing module call and its
            layer.
    """
    for training in modes:
        expected, got, _, _ = _both(module, layers, forward, first_input, training, record=False)
        difference = _difference(expected, got, tolerance)
        if difference is not None:  # run again, recording every module call, to say where
            _, _, expected_calls, chained_calls = _both(module, layers, forward, first_input, training, record=True)
            raise ChainMismatch(_explain(difference, training, expected_calls, chained_calls, layers, names))


def _both(
    module: nn.Module,
    layers: Sequence[nn.Module],
    forward: Callable[[], Any],
    first_input: Any,
    training: bool,
    record: bool,
) -> tuple[Any, Any, list[tuple[nn.Module, Any]], list[tuple[nn.Module, Any]]]:
    """``forward()`` and the chain on ``first_input`` in one mode, from the same random state, and
    (with ``record``) every module call each made."""
    with _restored(module, layers):
        module.train(training)
        for layer in layers:
            layer.training = training  # the layer's choice of code only: its submodules follow `module`
        torch.manual_seed(0)  # every device's generator: the same dropout masks in both runs
        with torch.no_grad(), _calls(module, record) as expected_calls:
            expected = forward()
        torch.manual_seed(0)
        with torch.no_grad(), _calls(module, record) as chained_calls:
            got = first_input
            for layer in layers:
                got = layer(got)
    return expected, got, expected_calls, chained_calls


def _difference(expected: Any, got: Any, tolerance: float) -> str | None:
    """Why ``got`` is not ``expected`` (``None``: equal within ``tolerance``, relative to the values):
    their structures (types, keys, constants), then their tensors."""
    (want_structure, want), (have_structure, have) = flatten(expected), flatten(got)
    structure = _structure_difference(want_structure, have_structure, "the output")
    if structure is not None:
        return structure
    if len(want) != len(have):
        return f"forward returns {len(want)} tensors, the chain {len(have)}"
    for index, (a, b) in enumerate(zip(want, have, strict=True)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return (
                f"output tensor {index}: forward gives {tuple(a.shape)} {a.dtype}, the chain {tuple(b.shape)} {b.dtype}"
            )
        if not a.is_floating_point():
            if not torch.equal(a, b):
                return f"output tensor {index} differs"
            continue
        if not a.numel() or torch.equal(a, b):
            continue
        gap = float(torch.sub(a, b).abs_().nan_to_num_(nan=float("inf")).max())
        scale = 1.0 + float(a.abs().nan_to_num_(0.0).max())
        if gap > tolerance * scale:
            return f"output tensor {index} differs by up to {gap:.3g} (values up to {scale - 1:.3g})"
    return None


def _structure_difference(want: Any, have: Any, where: str) -> str | None:
    """The first place where two :func:`~lightning_pipe.util.nested.flatten` skeletons differ: a type (a
    ``ModelOutput`` returned as a plain ``dict``), a key, a length or a constant."""
    if want[0] != have[0] or (want[0] in ("sequence", "dict") and want[1] is not have[1]):
        return f"{where} is {_kind(want)} in forward, {_kind(have)} in the chain"
    if want[0] == "value":
        try:
            same = bool(want[1] == have[1])
        except Exception:  # a constant that cannot say (an array): not compared
            same = True
        return None if same else f"{where} is {want[1]!r} in forward, {have[1]!r} in the chain"
    if want[0] == "sequence":
        if len(want[2]) != len(have[2]):
            return f"{where} holds {len(want[2])} items in forward, {len(have[2])} in the chain"
        children = [(f"{where}[{i}]", a, b) for i, (a, b) in enumerate(zip(want[2], have[2], strict=True))]
    elif want[0] == "dict":
        keys, other_keys = [k for k, _ in want[2]], [k for k, _ in have[2]]
        if keys != other_keys:
            return f"{where} has keys {keys} in forward, {other_keys} in the chain"
        children = [(f"{where}[{k!r}]", a, b) for (k, a), (_, b) in zip(want[2], have[2], strict=True)]
    else:
        return None
    return next((d for d in (_structure_difference(a, b, w) for w, a, b in children) if d is not None), None)


def _kind(skeleton: Any) -> str:
    if skeleton[0] == "tensor":
        return "a tensor"
    if skeleton[0] == "value":
        return f"{skeleton[1]!r}"
    return f"a {skeleton[1].__name__}"


def _explain(
    difference: str,
    training: bool,
    expected_calls: list[tuple[nn.Module, Any]],
    chained_calls: list[tuple[nn.Module, Any]],
    layers: Sequence[nn.Module],
    names: Sequence[str],
) -> str:
    mode = "train" if training else "eval"
    message = f"the layers chained together do not compute forward ({mode} mode, first micro-batch): {difference}"
    by_module: dict[int, list[Any]] = {}
    for module, output in expected_calls:
        by_module.setdefault(id(module), []).append(output)
    seen: dict[int, int] = {}
    for module, have in chained_calls:  # each module's k-th call in the chain against its k-th in forward
        count = seen[id(module)] = seen.get(id(module), 0) + 1
        outputs = by_module.get(id(module), [])
        if count > len(outputs) or _difference(outputs[count - 1], have, 1e-5) is not None:
            layer = next((i for i, layer in enumerate(layers) if any(m is module for m in layer.modules())), None)
            where = f"layer {layer} ({names[layer]})" if layer is not None else "a layer"
            what = "differs" if count <= len(outputs) else "is not made by forward"
            return f"{message}; the first module call that {what} is {type(module).__name__} (call {count}), in {where}"
    missing = [type(m).__name__ for m, _ in expected_calls if id(m) not in seen]
    if missing:
        return f"{message}; forward calls modules the chain does not: {', '.join(dict.fromkeys(missing))}"
    return (
        f"{message}; every module call agrees, so the difference is in code after the last module call: forward "
        f"does something the last layer ({names[-1] if names else '?'}) does not (e.g. F.log_softmax around the "
        "model), or the chain does something forward does not"
    )


@contextmanager
def _calls(module: nn.Module, record: bool = True) -> Iterator[list[tuple[nn.Module, Any]]]:
    """Every call of a module without children under ``module`` (``nn.Identity`` aside: a chain may
    leave it out), with its output, in order."""
    calls: list[tuple[nn.Module, Any]] = []
    if not record:
        yield calls
        return
    handles = [
        leaf.register_forward_hook(lambda m, _, out: calls.append((m, out)))
        for leaf in module.modules()
        if not any(True for _ in leaf.children()) and not isinstance(leaf, nn.Identity)
    ]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _restored(module: nn.Module, layers: Sequence[nn.Module]) -> Iterator[None]:
    modes = [(m, m.training) for root in (module, *layers) for m in root.modules()]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    with ExitStack() as stack:
        devices = sorted({b.device for b, _ in buffers} | {p.device for p in module.parameters()}, key=str)
        accelerated = [d for d in devices if d.type != "cpu"]
        stack.enter_context(torch.random.fork_rng(devices=accelerated, device_type=_type(accelerated)))
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training
            with torch.no_grad():
                for buffer, value in buffers:
                    buffer.copy_(value)


def _type(devices: list[torch.device]) -> str:
    return devices[0].type if devices else "cuda"
