"""Weight versions, gradient accumulation and updates of one stage on one worker.

A stage computes with a *version* of its weights: version ``v`` is the weights after ``v`` updates
(docs/design.md, update rules). A backward always differentiates the weights its forward saw, however many
updates happened in between (weight stashing, Narayanan et al. 2019 §3.3).

- When every use of a version ends before the next update (flushing schedules), the live parameters
  are the leaves the forwards use: no copy.
- Otherwise (non-flushing schedules) forwards run on a :class:`WeightCopy`: detached leaves of the
  stage's weights and a replica of the stage's module computing with them (its buffers, e.g. batch
  norm's running statistics, are the live module's own). The live parameters, which the optimizer
  updates in place, share the storage of the copy of the current version, so taking a version costs
  nothing. Only an update whose outgoing version is still in use moves the live parameters to another
  storage (that of a version no longer used when there is one), leaving the outgoing version's values
  where its micro-batches saw them: an SGD update writes the new weights straight there
  (:mod:`~lightning_pipe.runtime.out_of_place`), other optimizers update a copy in place. A stage therefore holds
  as many copies of its weights as versions are in use at once, plus at most one spare: two for
  PipeDream-2BW (Narayanan et al. 2021, §3.1), and no allocation from one step to the next.

Gradients are accumulated per step (two steps can be in flight): the step's first backward keeps the
gradients autograd made (nothing to zero), later ones are added into them in place. A step that ends
without an update (gradient accumulation over steps, flushing schedules: :meth:`StageWeights.carry`)
hands its gradient on as the start of the next step's. Frozen parameters (``requires_grad=False``)
are never differentiated. An update sums the gradients across the stage's replicas (one all-reduce
per dtype in the stage's own process group), hands them to the optimizer and steps it; a parameter
no micro-batch reached keeps ``grad = None`` and the optimizer skips it, as in single-process training.
Everything that carries over between calls is in :meth:`StageWeights.state_dict`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from lightning_pipe.runtime.out_of_place import step_into, steps_out_of_place

__all__ = ["StageWeights", "WeightCopy"]

_Sum = tuple[dist.Work | None, torch.Tensor, list[tuple[dist.Work, list[torch.Tensor], torch.Tensor]]]
"""A sum over a stage's replicas under way: the presence counts' own all-reduce (``None``: they ride
in a bucket) and counts, then each bucket's all-reduce, gradients and the tensor summed (a flat
buffer, the counts at its end where they ride in it; or the one gradient itself)."""

COUNTS_DTYPES = (torch.float32, torch.float64)
"""Dtypes whose packed bucket carries the presence counts (whole numbers exact far beyond any count
of replicas); otherwise the counts take an all-reduce of their own."""

BUCKET_BYTES = 1 << 20
"""A gradient of this many bytes or more is summed over the replicas where it lies; smaller ones are
packed, in order, into flat buffers of up to this size, one all-reduce each (DDP's buckets, with
large tensors left alone). Packing every gradient of a stage into one buffer copied them all, twice,
and a buffer above glibc's mmap threshold (31 MiB once settled) faulted its pages in at every step:
Rahimi's ``ddp`` on torchvision's ResNet-18 (2 CPU processes, 16 rows a micro-batch) ran the
backward of its last stage, 34 MB of gradients, in 27.8 ms where 1F1B ran the same stage's in 14.4 ms
(``docs/measurements.md``, *The heap settled before the profile*)."""


class WeightCopy(dict[str, torch.Tensor]):
    """One copy of a stage's weights: parameter name -> detached leaf, and :attr:`module`, a replica of
    the stage's module whose parameters are those leaves (``None`` when the module cannot be copied:
    the forward then goes through :func:`torch.func.functional_call`)."""

    module: nn.Module | None = None
    views: list[torch.Tensor]  # detached views of the leaves, in parameter order: what the live parameters point to

    @classmethod
    def of(cls, module: nn.Module, storages: dict[str, torch.Tensor], replica: bool = True) -> WeightCopy:
        """A copy whose leaves are views of ``storages`` (name -> tensor) with their own version
        counters, so in-place changes of the tensors in ``storages`` never fail a backward that saved
        a leaf (the caller makes sure none is in flight then); without ``replica`` the forward goes
        through :func:`torch.func.functional_call` on ``module`` itself (its training mode)."""
        leaves = cls()
        for name, param in module.named_parameters():
            source = storages[name]
            view = torch.empty(0, dtype=source.dtype, device=source.device)
            view.set_(source.untyped_storage(), source.storage_offset(), source.shape, source.stride())
            leaves[name] = nn.Parameter(view, requires_grad=param.requires_grad)
        leaves.views = [leaf.detach() for leaf in leaves.values()]
        if not replica:
            return leaves
        # the replica shares the module's buffers; only the parameters are replaced (deepcopy's memo
        # maps the originals to the replacements)
        memo: dict[int, Any] = {id(p): leaves[name] for name, p in module.named_parameters()}
        memo.update({id(buffer): buffer for buffer in module.buffers()})
        try:
            leaves.module = copy.deepcopy(module, memo)
        except Exception:  # a module holding something deepcopy refuses (a lock, a process group)
            leaves.module = None
        return leaves


class StageWeights:
    """Versions, gradients and optimizer of one stage.

    Args:
        module: the stage's layers (its parameters are the live weights).
        optimizer: builds the stage's optimizer from its parameters; ``None`` for a stage updated elsewhere.
        snapshots: keep versions as snapshots (non-flushing schedules).
        group: process group of the stage's replicas (``None``: not replicated).
        shared: the parameters (by ``id``) this stage shares with an earlier stage of this worker (a
            tied weight, :mod:`~lightning_pipe.runtime.ties`). With ``snapshots`` the stage keeps a
            copy of them with its own versions and optimizer state (taking over any state the
            optimizer gives them), as a stage on a worker of its own does. Otherwise the earlier
            stage updates them: they are left out of this stage's optimizer, and this stage computes
            through leaves of its own (views of the same storage), so that each stage's part of their
            gradient stays its own.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None,
        snapshots: bool,
        group: dist.ProcessGroup | None = None,
        shared: Collection[int] = (),
    ) -> None:
        self.module = module
        self.names = [name for name, _ in module.named_parameters()]
        originals = [p for _, p in module.named_parameters()]
        self.shared = frozenset(shared)
        copies = {id(p): _copy(p) for p in originals if snapshots and id(p) in self.shared}
        self.params = [copies.get(id(p), p) for p in originals]
        self._live = dict(zip(self.names, self.params, strict=True))
        # a parameter's index, without hashing tensors (a copied one's also by the module's own)
        self._position = {id(p): i for ps in (originals, self.params) for i, p in enumerate(ps)}
        self._in_order = list(range(len(self.params)))
        self.trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        # none for a stage without weights, or one computed here but updated by its owner (borrowed)
        stepped = [p for p in originals if snapshots or id(p) not in self.shared]
        self.optimizer = optimizer(stepped) if stepped and optimizer is not None else None
        if self.optimizer is not None and copies:
            _take_over_state(self.optimizer, copies)
        self.snapshots = snapshots
        self.group = group
        self.version = 0
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.gradients: dict[int, list[torch.Tensor]] = {}
        self._summed: set[int] = set()  # steps whose buffer already holds the replicas' sum
        self._summing: dict[int, _Sum] = {}  # sums over the replicas started, by step
        # (step, leaves, their differentiable list) whose .grad holds that step's gradient meanwhile
        self._lent: tuple[int, dict[str, torch.Tensor], list[torch.Tensor]] | None = None
        self._bound: WeightCopy | None = None  # the copy sharing the live parameters' storage
        self._spare: WeightCopy | None = None  # a copy no version uses, whose storage the next move takes
        self._own_leaves: WeightCopy | None = None  # the live weights' views a stage with shared ones computes on

    def leaves(self, version: int) -> dict[str, torch.Tensor]:
        """The tensors to compute with for ``version`` (the current version or a kept copy)."""
        if not self.snapshots:
            if version != self.version:
                raise RuntimeError(f"version {version} asked while the stage is at version {self.version}")
            if not self.shared:
                return self._live
            if self._own_leaves is None:
                self._own_leaves = WeightCopy.of(self.module, self._live, replica=False)
            return self._own_leaves
        if version not in self.versions:
            if version != self.version:
                raise RuntimeError(
                    f"version {version} is gone (the stage is at version {self.version}, keeps "
                    f"{sorted(self.versions)}): the schedule uses a version it did not keep"
                )
            if self._bound is None:
                self._bound = WeightCopy.of(self.module, self._live)
            self.versions[version] = self._bound
        return self.versions[version]

    def differentiable(self, leaves: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The leaves of ``leaves`` to differentiate (the trainable ones), in parameter order."""
        values = list(leaves.values())
        return [values[i] for i in self.trainable]

    def forward(self, leaves: dict[str, torch.Tensor], inputs: Any) -> Any:
        """The stage's forward with ``leaves`` as its weights (a plain call for the live ones and for a
        :class:`WeightCopy` with a replica)."""
        if leaves is self._live:
            return self.module(inputs)
        replica = getattr(leaves, "module", None)
        if replica is not None:
            return replica(inputs)
        return functional_call(self.module, leaves, (inputs,))

    def weight_storages(self) -> set[int]:
        """The storages of the copies of the stage's weights this worker holds (live, kept versions and
        spare), by address: how many copies there are, and whether they are the same from step to step."""
        held = [self._live, *self.versions.values(), *([self._spare] if self._spare is not None else [])]
        return {leaves[self.names[0]].untyped_storage().data_ptr() for leaves in held} if self.names else set()

    def forget_versions(self) -> None:
        """Drop every kept version and spare copy (after a drain: the next fill starts from the live
        weights, with replicas made anew so they follow changes of the module's training mode)."""
        self._reclaim()
        self.versions.clear()
        self._bound = self._spare = self._own_leaves = None

    def _move_live(self, grads: list[torch.Tensor | None] | None = None, order: Collection[int] = ()) -> None:
        """Give the live parameters a storage of their own (the spare copy's, or a new one) so the
        bound copy keeps its values. With ``grads`` (those of the parameters at positions ``order``,
        the optimizer's: :meth:`_optimizer_order`) the optimizer's step fills that storage
        (:mod:`~lightning_pipe.runtime.out_of_place`); otherwise it gets a copy of the values, for the
        caller's in-place update. A parameter the optimizer does not step is copied either way. The
        values are read from the bound copy, so the parameters move first, before the step evicts them
        from the processor's caches (here 18 parameters took 19 us to move after it, 9 before)."""
        target = self._spare
        if target is None:
            target = WeightCopy.of(self.module, {n: torch.empty_like(p) for n, p in self._live.items()})
        self._spare = None
        sources = self._bound.views  # the live parameters' storage: their values, detached
        for param, view in zip(self.params, target.views, strict=True):
            param.data = view
        stepped = order if grads is not None else ()
        if grads is not None:
            step_into(self.optimizer, grads, self._ordered(sources, order), self._ordered(target.views, order))
        if len(stepped) < len(self.params):
            for index in set(range(len(self.params))).difference(stepped):
                target.views[index].copy_(sources[index])
        self._bound = target

    def _ordered(self, values: list[Any], order: list[int]) -> list[Any]:
        """``values`` (one per stage parameter) at positions ``order``: the list itself for the usual
        optimizer, which holds the stage's parameters as given."""
        return values if order == self._in_order else [values[i] for i in order]

    def _optimizer_order(self) -> list[int] | None:
        """The positions among the stage's parameters of the optimizer's, in its groups' order
        (``None`` if it holds a tensor that is not one of them)."""
        position = self._position
        try:
            return [position[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
        except KeyError:
            return None

    def pop_gradients(self, step: int) -> list[torch.Tensor | None]:
        """``step``'s gradients so far, taken out of the stage (``None`` for a weight none reached yet)."""
        self._reclaim()
        return self.gradients.pop(step, None) or [None] * len(self.params)

    def _reclaim(self) -> None:
        """The gradients lent to a version's leaves go back into their step's buffer."""
        if self._lent is not None:
            step, _, weights = self._lent
            self._lent = None
            buffer = self.gradients[step]
            for leaf, index in zip(weights, self.trainable, strict=True):
                buffer[index], leaf.grad = leaf.grad, None

    def add(self, step: int, grads: list[torch.Tensor | None]) -> None:
        """Add weight gradients computed elsewhere (fresh tensors, one per :meth:`differentiable` leaf:
        a borrower's) to ``step``'s buffer."""
        add = self.accumulator(step)
        for leaf, grad in enumerate(grads):
            if grad is not None:
                add(leaf, grad)

    def accumulator(self, step: int) -> Callable[[int, torch.Tensor], None]:
        """``add(leaf, gradient)``: add a fresh gradient of the ``leaf``-th :meth:`differentiable` leaf to
        ``step``'s buffer (kept as is when it is the first)."""
        buffer = self.pop_gradients(step)
        self.gradients[step] = buffer

        def add(leaf: int, grad: torch.Tensor) -> None:
            index = self.trainable[leaf]
            if buffer[index] is None:
                buffer[index] = grad
            else:
                buffer[index].add_(grad)

        return add

    def backward(
        self,
        step: int,
        leaves: dict[str, torch.Tensor],
        roots: list[torch.Tensor],
        root_grads: list[torch.Tensor] | None,
        inputs: list[torch.Tensor],
    ) -> list[torch.Tensor | None]:
        """Backward of one micro-batch: weight gradients accumulate in place into ``step``'s buffer,
        the gradients of ``inputs`` are returned. The buffer is lent to the leaves as their ``.grad``
        (autograd adds into it without allocating; the step's first backward keeps what autograd
        made, with nothing to zero) and stays lent while the backwards of the same step on the same
        leaves follow one another: it comes back when another step's or version's backward, or
        anything reading the gradients, needs it (after a compute, touching every parameter costs
        tens of microseconds of cache misses)."""
        if self._lent is None or self._lent[0] != step or self._lent[1] is not leaves:
            buffer = self.pop_gradients(step)
            weights = self.differentiable(leaves)
            for leaf, index in zip(weights, self.trainable, strict=True):
                leaf.grad = buffer[index]
                buffer[index] = None  # the leaf holds the only reference: autograd accumulates in place
            self.gradients[step] = buffer
            self._lent = (step, leaves, weights)
        differentiated = inputs + self._lent[2]
        if roots and differentiated:
            torch.autograd.backward(roots, root_grads, inputs=differentiated)
        grads = [x.grad for x in inputs]
        for x in inputs:
            x.grad = None
        return grads

    def summed_gradients(self, step: int) -> list[torch.Tensor | None]:
        """``step``'s gradient summed over the stage's replicas (once: :meth:`update` applies it)."""
        buffer = self.pop_gradients(step)
        if step in self._summing:
            self._finish_sum(buffer, self._summing.pop(step))
        elif self.group is not None and self.params and step not in self._summed:
            self._finish_sum(buffer, self._start_sum(buffer))
        self._summed.add(step)
        self.gradients[step] = buffer
        return buffer

    def start_sum(self, step: int) -> None:
        """Start summing ``step``'s gradient over the stage's replicas in the background (this worker
        has computed all of it), so that the transfer overlaps the backwards of the other stages, as
        DDP's buckets do; :meth:`summed_gradients` waits for it."""
        if self.group is None or not self.params or step in self._summed or step in self._summing:
            return
        buffer = self.pop_gradients(step)
        self.gradients[step] = buffer
        self._summing[step] = self._start_sum(buffer)

    def carry(self, step: int) -> None:
        """End ``step`` without an update: its gradient becomes the start of step ``step + 1``'s, which
        adds its own into it (gradient accumulation over steps, flushing schedules: no step runs past
        this one). The weights stay as they are; the version counter advances, as after an update
        (versions count steps)."""
        self.gradients[step + 1] = self.pop_gradients(step)
        self.version += 1

    def update(
        self,
        step: int,
        keep: set[int],
        prepare: Callable[[list[torch.Tensor | None]], None] | None = None,
        skip: bool = False,
    ) -> None:
        """Apply ``step``'s gradient (summed over replicas); versions outside ``keep`` are dropped.
        ``prepare(gradients)`` runs just before the optimizer steps (clipping, hyper-parameters).
        ``skip`` drops the gradient instead (an overflowed float16 step): the weights and the
        optimizer stay as they are, the version counter still advances (versions count steps)."""
        moves = self.snapshots and self._retire(keep)
        buffer = self.summed_gradients(step)
        del self.gradients[step]
        self._summed.discard(step)
        if prepare is not None and not skip:
            prepare(buffer)
        steps = self.optimizer is not None and not skip
        order = self._optimizer_order() if moves and steps else None
        ordered = None if order is None else self._ordered(buffer, order)
        if ordered is not None and steps_out_of_place(self.optimizer, ordered):
            self._move_live(ordered, order)  # the step writes the new weights where they move to
        else:
            if moves:
                self._move_live()
            if steps:
                for param, grad in zip(self.params, buffer, strict=True):
                    param.grad = None if id(param) in self.shared else grad
                self.optimizer.step()
                for param in self.params:
                    param.grad = None
        self.version += 1

    def _retire(self, keep: set[int]) -> bool:
        """Before an update: versions outside ``keep`` are dropped (one copy kept as the spare).
        Whether the live parameters must move away: the outgoing version is kept and shares their
        storage, so the update must leave that storage as it is."""
        for version in [v for v in self.versions if v not in keep]:
            dropped = self.versions.pop(version)
            if dropped is not self._bound:
                self._spare = dropped
        return self.version in keep and self.leaves(self.version) is self._bound

    def _start_sum(self, buffer: list[torch.Tensor | None]) -> _Sum:
        """Start summing ``buffer`` over the stage's replicas in place, not waited for: every
        trainable weight's gradient (zeros where this replica has none), by dtype in the buckets of
        :func:`_buckets`, and with them how many replicas had one, at the end of the first float32
        or float64 dtype's last packed bucket (else in an all-reduce of their own). Each all-reduce
        costs more than its bytes: on 2 gloo processes of one host five small ones in a row took
        4-5 ms where one took 0.2-0.4 ms."""
        device = self.params[0].device
        present = [grad is not None for grad in buffer]
        for index in self.trainable:
            if buffer[index] is None:
                buffer[index] = torch.zeros_like(self.params[index])
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in buffer:
            if grad is not None:
                by_dtype.setdefault(grad.dtype, []).append(grad)
        summing, counts = [], None
        for dtype, grads in by_dtype.items():
            buckets = _buckets(grads, BUCKET_BYTES)
            for bucket in buckets:
                parts = [g.reshape(-1) for g in bucket]
                packed = bucket[0].numel() * bucket[0].element_size() < BUCKET_BYTES  # large ones are alone
                if counts is None and bucket is buckets[-1] and packed and dtype in COUNTS_DTYPES:
                    parts.append(torch.tensor(present, dtype=dtype, device=device))
                summed = bucket[0].contiguous() if len(parts) == 1 else torch.cat(parts)
                if len(parts) > len(bucket):
                    counts = summed[-len(present) :]
                summing.append((dist.all_reduce(summed, group=self.group, async_op=True), bucket, summed))
        if counts is not None:
            return None, counts, summing
        counts = torch.tensor(present, dtype=torch.int32, device=device)
        return dist.all_reduce(counts, group=self.group, async_op=True), counts, summing

    def _finish_sum(self, buffer: list[torch.Tensor | None], started: _Sum) -> None:
        """Wait for a sum :meth:`_start_sum` started; a weight no replica had a gradient for gets
        ``None`` back (the optimizer skips it)."""
        counting, counts, summing = started
        if counting is not None:
            counting.wait()
        for work, grads, summed in summing:
            work.wait()
            if summed is not grads[0]:
                _unflatten(grads, summed)
        for index in (counts == 0).nonzero().flatten().tolist():
            buffer[index] = None

    def hand_over(self) -> dict[str, object]:
        """The stage's whole state, to pass to another worker (:mod:`~lightning_pipe.runtime.stage_relays`):
        :meth:`state_dict` with the live weights and buffers."""
        state = self.state_dict()
        state["live"] = [p.detach() for p in self.params]
        state["buffers"] = list(self.module.buffers())
        return state

    def release(self) -> None:
        """Free the stage's state on this worker (it was passed on): weights, buffers, versions,
        gradients and optimizer state become empty until :meth:`take_over`."""
        self.forget_versions()
        self.gradients.clear()
        self._summed.clear()
        if self.optimizer is not None:
            self.optimizer.state.clear()
        for tensor in [*self.params, *self.module.buffers()]:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)

    def take_over(self, state: dict[str, object]) -> None:
        """Hold the state another worker passed on (:meth:`hand_over`)."""
        for tensor, value in zip(
            [*self.params, *self.module.buffers()], [*state["live"], *state["buffers"]], strict=True
        ):
            tensor.data = value.to(tensor.device, copy=True)
        self.load_state_dict(state)

    def state_dict(self, optimizer: bool = True) -> dict[str, object]:
        """What carries over between calls: version counter, kept versions, pending gradients, and
        (``optimizer``) the optimizer's state."""
        self._reclaim()
        state: dict[str, object] = {
            "version": self.version,
            "versions": {v: {k: t.detach().clone() for k, t in leaves.items()} for v, leaves in self.versions.items()},
            "gradients": {s: [None if g is None else g.clone() for g in grads] for s, grads in self.gradients.items()},
        }
        if optimizer:
            state["optimizer"] = None if self.optimizer is None else self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.version = int(state["version"])
        self.forget_versions()  # the gradients lent to the leaves come back first
        self.versions = {
            int(v): WeightCopy.of(self.module, {k: t.to(self._live[k].device, copy=True) for k, t in leaves.items()})
            for v, leaves in state["versions"].items()
        }
        self.gradients = {
            int(s): [None if g is None else g.to(p.device, copy=True) for g, p in zip(grads, self.params, strict=True)]
            for s, grads in state["gradients"].items()
        }
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])


def _copy(param: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)


def _take_over_state(optimizer: torch.optim.Optimizer, copies: dict[int, nn.Parameter]) -> None:
    """Make ``optimizer`` step the ``copies`` (original's ``id`` -> copy) instead of the originals,
    with whatever state it holds for them."""
    for group in optimizer.param_groups:
        originals = group["params"]
        group["params"] = [copies.get(id(p), p) for p in originals]
        for original in originals:
            if id(original) in copies and original in optimizer.state:
                optimizer.state[copies[id(original)]] = optimizer.state.pop(original)


def _buckets(grads: list[torch.Tensor], size: int) -> list[list[torch.Tensor]]:
    """``grads`` (of one dtype) in the groups one all-reduce sums each: a gradient of ``size`` bytes
    or more alone, the others packed in order (past the large ones between them) into groups of up to
    ``size`` bytes. The groups depend only on the gradients' sizes, so every replica
    makes the same."""
    buckets: list[list[torch.Tensor]] = []
    packing: list[torch.Tensor] = []
    packed = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if nbytes >= size:
            buckets.append([grad])
            continue
        if packing and packed + nbytes > size:
            buckets.append(packing)
            packing, packed = [], 0
        packing.append(grad)
        packed += nbytes
    if packing:
        buckets.append(packing)
    return buckets


def _unflatten(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy the summed ``flat`` back into the gradients it was made of (it may hold more after them)."""
    sizes = [grad.numel() for grad in grads]
    for grad, summed in zip(grads, flat[: sum(sizes)].split(sizes), strict=True):
        grad.copy_(summed.view_as(grad))
