"""Profile a real model layer by layer into :class:`~lightning_pipe.cost.records.ChainCosts`.

Each layer of a chain is run on its own, on a detached copy of the input it receives in the full
model, and measured for:

* forward and backward time: median of ``repeats`` timed runs after ``warmup`` untimed ones, read with
  :func:`time.perf_counter`, the device synchronised (:func:`torch.accelerator.synchronize`) before
  every clock read. The timed runs are spread over ``repeats`` passes through the chain (each layer
  timed once a pass, on the output of the previous layer's timed run), not made one layer after the
  other: a burst of load from elsewhere (another process, the other ranks starting up) then slows
  one run of several layers instead of every run of one layer, and the median discards it, so the
  split does not move with it. Backward time is :func:`torch.autograd.backward` alone, with random output
  gradients; it is 0 when no output requires grad.
* ``activation_bytes``: bytes of every tensor in the (possibly nested) output.
* ``param_bytes``: bytes of the layer's distinct parameters (buffers are not counted).
* ``saved_bytes``: bytes autograd keeps for backward, seen by
  :class:`torch.autograd.graph.saved_tensors_hooks`. Saved tensors are deduplicated by storage
  (``untyped_storage().data_ptr()``) and each distinct storage counts its full ``nbytes()``: a saved
  view keeps its whole storage alive. Storages of the layer's parameters and buffers are excluded
  (Linear saves ``weight.t()``, BatchNorm its running stats: model state, not activation memory).
  Tensors a custom ``autograd.Function`` stashes on ``ctx`` outside ``save_for_backward`` are invisible.
* ``shared_saved_bytes``: of ``saved_bytes``, the input the layer saves that the previous layer saved
  as its output (a ReLU's output, then a convolution's input): in a stage running both, one storage
  (:meth:`~lightning_pipe.cost.records.ChainCosts.saved_between` counts it once; each layer profiled
  on its own copy of its input counts it in both).
* ``kept_gradient_bytes``: bytes of the gradients a backward split in two halves (zero-bubble's ``I``
  and ``W``; a cool-down backward of a stage after the first) keeps between them, measured by running
  the layer's first backward as :class:`~lightning_pipe.runtime.split_backward.SplitBackward`; 0 for
  a layer whose input takes no gradient (the first).
* ``backward_bytes``: bytes the layer's backward holds at its peak beyond its saved activations and
  its parameters' gradients (its output's gradient, its input's, what it computes in between:
  :mod:`lightning_pipe.cost.backward_bytes`), measured in the first warm-up run (after the timed
  run with ``warmup=0``).
* ``flops``: forward + backward FLOPs from :class:`torch.utils.flop_counter.FlopCounterMode` (only
  ops with a registered formula, such as matmul and convolution, count).

A model on the meta device (built with ``init_module(empty_init=True)``, not yet materialised) has
shapes but no values: it is profiled for everything but time, which is estimated from its FLOPs
(forward and backward apart) at the rate a square matmul of the model's dtype reaches on the device
that will run it (``rate_device``; :func:`~lightning_pipe.cost.flop_rate.flop_rate`), so the
``time`` partitioner balances FLOPs there and the prediction is in that device's seconds. On one
thread of this package's 2-processor machine an MLP of 1024-wide layers at 128 rows profiled this way
is 0.6-1.0x its real profile's time (``tests/test_flop_rate.py``, ``bench/estimates.py``), one of
4096-wide layers at 16 rows 0.2-0.3x (its thin products are bound by memory, not by the matmul's
rate); layers without counted FLOPs (element-wise ones) estimate at 0.

On the CPU, glibc's heap is first settled (:func:`~lightning_pipe.runtime.allocator.settle_heap`): a
fresh process faults in the pages of every block of a few MiB (a layer's gradients) at each backward
until its mmap threshold has risen, a run does so only in its first steps, so the profile is
measured as the steps will run.

Every run feeds the layer a fresh ``clone()`` of its input, so in-place layers (``ReLU(inplace=True)``)
work and never corrupt the input of later runs. A layer's input takes a gradient where the previous
layer's output did, as the model computes it and as a pipeline's stage receives it
(:func:`~lightning_pipe.runtime.forward_backward.as_received`: the runtime's own rule); the first layer's
input keeps ``requires_grad`` as given. So the first layer with weights after layers without any (an
MLP's ``Linear`` after its ``Flatten``) computes no input gradient, nor does a layer for a tensor made
from constants (an attention mask), and the layers' FLOPs sum to the model's own
(``tests/test_profiler.py``). A profile that gave every later input a gradient timed an MLP's first
``Linear`` with an input gradient, a product as large as its weight gradient's, that its backward
never computes.

Profiling leaves the model as it found it: train/eval modes, device, buffers (BatchNorm running
statistics), parameter ``.grad`` and the global random number generator state are restored.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_pipe.cost.backward_bytes import backward_peak, backward_roots
from lightning_pipe.cost.flop_rate import flop_rate, synchronize
from lightning_pipe.cost.records import ChainCosts, LayerCost, SharedParameters
from lightning_pipe.cost.saved_bytes import saved_bytes, storage_key
from lightning_pipe.errors import PlanningError
from lightning_pipe.runtime.allocator import settle_heap
from lightning_pipe.runtime.forward_backward import as_received
from lightning_pipe.runtime.split_backward import SplitBackward
from lightning_pipe.util.nested import map_tensors, nbytes, tensors

__all__ = ["chain_seconds", "given_names", "profile_layers", "shared_parameters"]


def profile_layers(
    model: nn.Module | Sequence[nn.Module],
    sample: Any,
    *,
    device: str | torch.device | None = None,
    warmup: int = 1,
    repeats: int = 5,
    count_flops: bool = True,
    name: str | None = None,
    layer_names: Sequence[str] | None = None,
    rate_device: str | torch.device | None = None,
) -> ChainCosts:
    """Measure every layer of a chain for one micro-batch.

    Args:
        model: an ``nn.Sequential`` (its children are the layers) or an ordered list, tuple or
            ``nn.ModuleList`` of modules. The output of layer ``l`` is passed as-is to layer ``l + 1``
            (a tuple is one positional argument).
        sample: one micro-batch input for the first layer: a tensor, or a tuple/list/dict of tensors.
        device: where to profile; default: where the first parameter lives, else the CPU.
        warmup: untimed runs before timing.
        repeats: timed runs per layer, one per pass through the chain; the median is kept.
        count_flops: count FLOPs with ``torch.utils.flop_counter`` (``flops`` is None otherwise).
        name: name of the profile; default: the model's class name.
        layer_names: a name per layer for the profile (default: the layers' class names); layer
            ``i`` of the profile is then named ``i:name`` (:func:`given_names` reads them back).
        rate_device: for a model on the meta device, the device that will run it, whose measured
            FLOP rate turns the layers' FLOPs into seconds (``meta.flops_per_second`` of the profile);
            default: the current accelerator where there is one, else the CPU. Not used otherwise.

    Raises:
        PlanningError: the model is not a non-empty chain, the sample holds no tensor, the counts
            are invalid, the device or the rate device is unusable, or a layer fails on the input it
            receives.
    """
    named = _named_layers(model)
    if layer_names is not None:
        if len(layer_names) != len(named):
            raise PlanningError(f"{len(layer_names)} layer names for {len(named)} layers")
        named = [(f"{i}:{label}", layer) for i, (label, (_, layer)) in enumerate(zip(layer_names, named, strict=True))]
    if warmup < 0 or repeats < 1:
        raise PlanningError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    target = _resolve_device(device, named)
    batch_size = _batch_size(sample)
    meta: dict[str, object] = {}
    rate = None
    if target.type == "meta":
        runs_on = _rate_device(rate_device, named)
        rate = flop_rate(runs_on, _compute_dtype(named, sample))
        meta = {"flops_per_second": rate, "rate_device": str(runs_on)}
    if target.type == "cpu":
        settle_heap()  # as the steps will find glibc's heap (:mod:`lightning_pipe.runtime.allocator`)
    costs = []
    with _profiling_session(model, [layer for _, layer in named], target):
        first = map_tensors(lambda t: t.detach().to(target).requires_grad_(t.requires_grad), sample)
        x, saved_outputs = first, frozenset()
        for index, (label, layer) in enumerate(named):
            last = index == len(named) - 1
            cost, x, saved_outputs = _profile_layer(
                label, layer, x, target, warmup, count_flops, rate, saved_outputs, last
            )
            costs.append(cost)
        times = [[(cost.forward_seconds, cost.backward_seconds)] for cost in costs]
        for _ in range(0 if target.type == "meta" else repeats - 1):  # the other passes: timing only
            x = first  # each run feeds a layer a copy of its input
            for index, (_, layer) in enumerate(named):
                *timed, x = _timed_run(layer, x, target, index == len(named) - 1)
                times[index].append(tuple(timed))
    if target.type != "meta":
        costs = [
            replace(
                cost,
                forward_seconds=statistics.median(f for f, _ in runs),
                backward_seconds=statistics.median(b for _, b in runs),
            )
            for cost, runs in zip(costs, times, strict=True)
        ]
    meta = {
        "batch_size": batch_size,
        "device": str(target),
        "warmup": warmup,
        "repeats": repeats,
        "torch": torch.__version__,
        **meta,
    }
    shared = shared_parameters([layer for _, layer in named])
    return ChainCosts(layers=tuple(costs), name=name or _default_name(model), meta=meta, shared=shared)


def shared_parameters(layers: Sequence[nn.Module]) -> tuple[SharedParameters, ...]:
    """The parameters several of ``layers`` use (tied weights), grouped by the layers using them."""
    users: dict[int, list[int]] = {}
    sizes: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for param in layer.parameters():
            users.setdefault(id(param), []).append(index)
            sizes[id(param)] = param.numel() * param.element_size()
    groups: dict[tuple[int, ...], int] = {}
    for key, indices in users.items():
        if len(indices) > 1:
            groups[tuple(indices)] = groups.get(tuple(indices), 0) + sizes[key]
    return tuple(SharedParameters(layers, size) for layers, size in sorted(groups.items()))


def given_names(costs: ChainCosts) -> list[str] | None:
    """The ``layer_names`` a profile of :func:`profile_layers` was given (its layers named ``i:name``),
    or ``None`` for a profile whose layers are named otherwise (a module's children, PipeDream's nodes)."""
    parts = [layer.name.partition(":") for layer in costs.layers]
    if all(index == str(i) and colon for i, (index, colon, _) in enumerate(parts)):
        return [name for _, _, name in parts]
    return None


def chain_seconds(
    layers: Sequence[nn.Module], sample: Any, *, device: torch.device, warmup: int = 1, repeats: int = 3
) -> tuple[float, float]:
    """Forward and backward seconds of the whole chain on one micro-batch ``sample``, run as one
    module (as a pipeline stage holding every layer runs them): the medians of ``repeats`` runs after
    ``warmup``. A profile taken layer by layer pays, per layer, what a stage pays once (a backward
    call, the timers): on a CPU with small micro-batches this sum can be far below the layers'
    (:meth:`~lightning_pipe.cost.records.ChainCosts.rescaled` brings a profile to it)."""
    if device.type == "meta":
        raise PlanningError("a chain on the meta device has no time to measure: profile it from its FLOPs")
    if warmup < 0 or repeats < 1:
        raise PlanningError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    chain = nn.Sequential(*layers)
    with _profiling_session(chain, list(layers), device):
        first = map_tensors(lambda t: t.detach().to(device).requires_grad_(t.requires_grad), sample)
        for _ in range(warmup):
            _timed_run(chain, first, device, last=True)
        runs = [_timed_run(chain, first, device, last=True)[:2] for _ in range(repeats)]
    return statistics.median(f for f, _ in runs), statistics.median(b for _, b in runs)


def _named_layers(model: nn.Module | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The layers of the chain with their labels (``"3:Conv2d"``), or a PlanningError."""
    if isinstance(model, nn.Sequential):
        pairs = list(model.named_children())
    elif isinstance(model, list | tuple | nn.ModuleList):
        pairs = [(str(i), layer) for i, layer in enumerate(model)]
    else:
        raise PlanningError(
            f"cannot profile a {type(model).__name__} layer by layer: its forward is not a chain. Give the "
            "model as an nn.Sequential or an ordered list of layers whose outputs feed the next layer "
            "(for torchvision models use lightning_pipe.zoo.models.torchvision_chain)"
        )
    if not pairs:
        raise PlanningError("the model has no layers: give a non-empty nn.Sequential or list of modules")
    for label, layer in pairs:
        if not isinstance(layer, nn.Module):
            raise PlanningError(
                f"layer {label} is a {type(layer).__name__}, not an nn.Module: wrap plain functions in "
                "an nn.Module whose forward calls them"
            )
    return [(f"{label}:{type(layer).__name__}", layer) for label, layer in pairs]


def _default_name(model: nn.Module | Sequence[nn.Module]) -> str:
    return type(model).__name__ if isinstance(model, nn.Module) else "layers"


def _resolve_device(device: str | torch.device | None, named: list[tuple[str, nn.Module]]) -> torch.device:
    """The requested device, checked to be usable, or where the first parameter lives."""
    if device is None:
        first = next((p for _, layer in named for p in layer.parameters()), None)
        return first.device if first is not None else torch.device("cpu")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise PlanningError(f"unknown device {device!r}: use e.g. 'cpu' or 'cuda:0' ({exc})") from exc
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if target.type not in ("cpu", "meta") and (accelerator is None or accelerator.type != target.type):
        usable = "'cpu'" + (f" or '{accelerator.type}'" if accelerator is not None else "")
        raise PlanningError(f"device {device!r} is not available here: profile on {usable}")
    return target


def _rate_device(rate_device: str | torch.device | None, named: list[tuple[str, nn.Module]]) -> torch.device:
    """The device whose FLOP rate times a meta-device model: ``rate_device`` checked, or the current
    accelerator, else the CPU."""
    if rate_device is None:
        return torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    try:
        runs_on = _resolve_device(rate_device, named)
    except PlanningError as error:
        raise PlanningError(f"rate_device: {error}") from None
    if runs_on.type == "meta":
        raise PlanningError(
            "rate_device='meta': the meta device computes nothing; give the device the layers will run on "
            "('cpu', 'cuda'), whose FLOP rate times them"
        )
    return runs_on


def _compute_dtype(named: list[tuple[str, nn.Module]], sample: Any) -> torch.dtype:
    """The dtype the layers compute in: their first floating point parameter's, else the sample's
    first floating point tensor's, else torch's default."""
    candidates = [*(p for _, layer in named for p in layer.parameters()), *tensors(sample)]
    return next((t.dtype for t in candidates if t.is_floating_point()), torch.get_default_dtype())


def _batch_size(sample: Any) -> int | None:
    """First dimension of the first tensor of the sample (None for a 0-d tensor)."""
    first = next(iter(tensors(sample)), None)
    if first is None:
        raise PlanningError(
            f"the sample is a {type(sample).__name__} holding no tensor: give one micro-batch as a "
            "tensor or a tuple/list/dict of tensors"
        )
    return first.shape[0] if first.dim() > 0 else None


@contextmanager
def _profiling_session(
    model: nn.Module | Sequence[nn.Module], layers: list[nn.Module], device: torch.device
) -> Iterator[None]:
    """Train mode, layers on ``device``, grad enabled and forked RNG; everything restored on exit."""
    roots = ([model] if isinstance(model, nn.Module) else []) + layers
    modes = [(m, m.training) for root in roots for m in root.modules()]
    rng_devices = [] if device.type == "cpu" else [device]
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=rng_devices, device_type=device.type))
        for layer in layers:
            stack.enter_context(_layer_state(layer, device))
        stack.enter_context(torch.enable_grad())
        for root in roots:
            root.train()
        try:
            yield
        finally:
            for module, training in modes:
                module.training = training


@contextmanager
def _layer_state(layer: nn.Module, device: torch.device) -> Iterator[None]:
    """Move ``layer`` to ``device`` with no ``.grad``; on exit move it back, restore buffers and ``.grad``.

    The original ``.grad`` tensors are set aside rather than accumulated into, so they stay untouched.
    """
    grads = {name: p.grad for name, p in layer.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in layer.named_buffers()}
    home = next((t.device for t in (*layer.parameters(), *layer.buffers())), device)
    layer.to(device)
    for param in layer.parameters():
        param.grad = None
    try:
        yield
    finally:
        layer.to(home)
        with torch.no_grad():
            for name, value in buffers.items():
                layer.get_buffer(name).copy_(value)
        for name, grad in grads.items():
            layer.get_parameter(name).grad = grad


def _profile_layer(
    label: str,
    layer: nn.Module,
    leaf: Any,
    device: torch.device,
    warmup: int,
    count_flops: bool,
    rate: float | None,
    before: frozenset[int] = frozenset(),
    last: bool = False,
) -> tuple[LayerCost, Any, frozenset[int]]:
    """Cost of one layer on its input ``leaf`` (its time: the first timed run, after ``warmup``; on
    the meta device, its FLOPs at ``rate`` a second), the layer's detached output, and which of its
    output tensors (positions among :func:`tensors`) it saved. ``before``: those the previous layer
    saved; the bytes of those this layer saves as its input are its ``shared_saved_bytes``. ``last``:
    the model's last layer, whose backward starts from its loss where it returns one
    (:func:`~lightning_pipe.cost.backward_bytes.backward_roots`)."""
    estimated = rate is not None  # the meta device: nothing to time, the FLOPs (forward and backward apart) give it
    forward = FlopCounterMode(display=False) if count_flops or estimated else None
    backward = FlopCounterMode(display=False) if count_flops or estimated else None
    with forward or nullcontext():
        saved, output, saved_inputs, saved_outputs = _forward_saving(label, layer, leaf)
    with backward or nullcontext():
        kept = _split_backward(layer, leaf, output, last)
    _clear_grads(leaf)
    first = warmup > 0 or estimated  # measured in the first warm-up run, or with nothing timed after it
    transient, first_transient = _backward_bytes(layer, leaf, last) if first else (0, 0)
    if rate is not None:
        assert forward is not None and backward is not None
        forward_seconds = forward.get_total_flops() / rate
        backward_seconds = backward.get_total_flops() / rate
    else:
        for _ in range(warmup - 1):
            _timed_run(layer, leaf, device, last)
        forward_seconds, backward_seconds, _ = _timed_run(layer, leaf, device, last)
    if not first:  # no warm-up asked: after the timed run, which stays the layer's first
        transient, first_transient = _backward_bytes(layer, leaf, last)
    _free_gradients(layer)
    cost = LayerCost(
        name=label,
        forward_seconds=forward_seconds,
        backward_seconds=backward_seconds,
        activation_bytes=nbytes(output),
        saved_bytes=saved,
        param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
        flops=_total(forward, backward) if count_flops else None,
        kept_gradient_bytes=kept,
        shared_saved_bytes=min(saved, sum(nbytes for position, nbytes in saved_inputs.items() if position in before)),
        backward_bytes=transient,
        first_backward_bytes=first_transient,
        largest_param_bytes=max(
            (p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad), default=0
        ),
    )
    return cost, as_received(output), saved_outputs


def _total(*counters: FlopCounterMode | None) -> int:
    """The FLOPs ``counters`` counted together."""
    return sum(counter.get_total_flops() for counter in counters if counter is not None)


def _forward_saving(label: str, layer: nn.Module, leaf: Any) -> tuple[int, Any, dict[int, int], frozenset[int]]:
    """Run the layer once; return the bytes it saved for backward (:mod:`lightning_pipe.cost.saved_bytes`,
    its parameters and buffers excluded), its output, the bytes of each input tensor it saved (by
    position among :func:`tensors`) and the positions of the output tensors it saved."""
    inputs = map_tensors(torch.Tensor.clone, leaf)
    with saved_bytes((*layer.parameters(), *layer.buffers())) as counted:
        try:
            output = layer(inputs)
        except Exception as exc:
            shapes = [tuple(t.shape) for t in tensors(leaf)]
            raise PlanningError(
                f"layer {label} failed on its input (tensor shapes {shapes}): {exc}. Check that each "
                "layer accepts the previous layer's output and that the sample is one micro-batch"
            ) from exc
    kept = counted.storages
    inputs_kept = [kept.get(storage_key(t)) for t in tensors(inputs)]
    saved_inputs = {i: nbytes for i, nbytes in enumerate(inputs_kept) if nbytes is not None}
    saved_outputs = frozenset(i for i, t in enumerate(tensors(output)) if storage_key(t) in kept)
    return counted(), output, saved_inputs, saved_outputs


def _clear_grads(leaf: Any) -> None:
    for tensor in tensors(leaf):
        tensor.grad = None


def _free_gradients(layer: nn.Module) -> None:
    """Freed now, not when the session ends: one layer's gradients at a time."""
    for param in layer.parameters():
        param.grad = None


def _timed_run(layer: nn.Module, leaf: Any, device: torch.device, last: bool = False) -> tuple[float, float, Any]:
    """One forward and backward of the layer on a copy of ``leaf`` (``last``: the model's last layer):
    their seconds, and the output as the next layer is fed it
    (:func:`~lightning_pipe.runtime.forward_backward.as_received`)."""
    inputs = map_tensors(torch.Tensor.clone, leaf)
    synchronize(device)
    start = time.perf_counter()
    output = layer(inputs)
    synchronize(device)
    forward = time.perf_counter() - start
    backward = _timed_backward(output, device, last)
    _clear_grads(leaf)
    _free_gradients(layer)
    return forward, backward, as_received(output)


def _backward_bytes(layer: nn.Module, leaf: Any, last: bool) -> tuple[int, int]:
    """One forward and backward of the layer on a copy of ``leaf`` (random output gradients), and
    the bytes its backward holds at its peak beyond the saved activations and the parameters'
    gradients, and a step's first backward beyond the gradients it leaves
    (:func:`~lightning_pipe.cost.backward_bytes.backward_peak`)."""
    parameters = [p for p in layer.parameters() if p.requires_grad]
    transient = backward_peak(layer, map_tensors(torch.Tensor.clone, leaf), parameters, last)
    _clear_grads(leaf)
    _free_gradients(layer)
    return transient


def _split_backward(layer: nn.Module, leaf: Any, output: Any, last: bool = False) -> int:
    """The layer's backward in two halves (random output gradients); the bytes kept between them."""
    outputs = backward_roots(output, last)
    if not outputs:
        return 0
    split = SplitBackward(
        outputs,
        [torch.randn_like(t) for t in outputs],
        [t for t in tensors(leaf) if t.requires_grad],
        [p for p in layer.parameters() if p.requires_grad],
    )
    split.input_gradients()
    kept = split.kept_bytes
    split.weight_gradients(lambda index, grad: None)
    return kept


def _timed_backward(output: Any, device: torch.device, last: bool = False) -> float:
    """Backward from the outputs that require grad (:func:`~lightning_pipe.cost.backward_bytes.backward_roots`),
    with random output gradients; its seconds (0 if none)."""
    outputs = backward_roots(output, last)
    if not outputs:
        return 0.0
    grads = [torch.randn_like(t) for t in outputs]
    synchronize(device)
    start = time.perf_counter()
    torch.autograd.backward(outputs, grads)
    synchronize(device)
    return time.perf_counter() - start
