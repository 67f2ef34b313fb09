"""An SGD step that writes the new weights into other tensors, leaving the old ones where they are.

Weight stashing keeps the outgoing version of a stage's weights for the micro-batches still in flight
(PipeDream-2BW, Narayanan et al. 2021, §3.1). With an in-place optimizer that costs a copy of the
weights per update: the live parameters first move to other storage holding the same values, then the
optimizer overwrites them there. Writing ``θ_{t+1} = θ_t - lr·d_t`` straight into the other storage
reads and writes as much memory as the in-place update alone, so the copy disappears.

:func:`steps_out_of_place` says when :func:`step_into` may stand in for ``optimizer.step()``: a plain
``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay, maximize: the operations of torch's
per-tensor implementation, in its order, so the weights and momentum buffers are bitwise those of
``optimizer.step()``) that would itself loop over its tensors one by one. Where torch's SGD runs
multi-tensor kernels (``foreach``, the default on GPUs) or fused ones, one multi-tensor copy plus its
own step is cheaper than a Python loop of small kernels, and the caller keeps that path; so it does for
any other optimizer, for step hooks, and for sparse gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

__all__ = ["step_into", "steps_out_of_place"]


def steps_out_of_place(optimizer: torch.optim.Optimizer, grads: Sequence[torch.Tensor | None]) -> bool:
    """Whether :func:`step_into` computes exactly what ``optimizer.step()`` would, at no extra cost, with
    gradients ``grads`` (entry ``k``: the ``k``-th parameter of the optimizer's groups, in order).

    Torch's SGD loops over a group's tensors one by one unless told otherwise or unless every
    parameter with a gradient is on a device with multi-tensor kernels, which the CPU is not; the
    gradients tell, as each is on its parameter's device (and were read last, so this reads no
    parameter the step is about to evict from the caches)."""
    if type(optimizer) is not torch.optim.SGD or getattr(optimizer, "grad_scale", None) is not None:
        return False
    hooks = (
        optimizer._optimizer_step_pre_hooks,
        optimizer._optimizer_step_post_hooks,
        _global_optimizer_pre_hooks,
        _global_optimizer_post_hooks,
    )
    if any(hooks):
        return False
    start = 0
    for group in optimizer.param_groups:
        end = start + len(group["params"])
        present = [grad for grad in grads[start:end] if grad is not None]
        start = end
        per_tensor = group["foreach"] is False or (group["foreach"] is None and any(g.is_cpu for g in present))
        traced = any(isinstance(group[k], torch.Tensor) and group[k].requires_grad for k in ("lr", "weight_decay"))
        if (present and not per_tensor) or group["fused"] or group["differentiable"] or traced:
            return False
        if any(grad.is_sparse for grad in present):
            return False
    return True


def step_into(
    optimizer: torch.optim.SGD,
    grads: Sequence[torch.Tensor | None],
    sources: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
) -> None:
    """One SGD step of ``optimizer`` with gradients ``grads`` from the weights ``sources`` into
    ``targets``: entry ``k`` of each belongs to the ``k``-th parameter of the optimizer's groups, in
    order. ``sources[k]`` holds that parameter's values and, like the gradient, does not require grad
    (a detached view of the parameter: nothing here is recorded by autograd, with no ``no_grad``
    context to enter); it is only read, and copied unchanged where the gradient is ``None``, as the
    optimizer skips such a parameter. The parameters themselves are neither read nor written: they
    only key the momentum buffers in ``optimizer.state``, which advance as ``optimizer.step()`` would
    advance them."""
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if not len(grads) == len(sources) == len(targets) == count:
        raise ValueError(
            f"step_into: {len(grads)} gradients, {len(sources)} sources and {len(targets)} targets for an "
            f"optimizer of {count} parameters"
        )
    slots = zip(grads, sources, targets, strict=True)
    for group in optimizer.param_groups:
        lr, decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
        if isinstance(lr, torch.Tensor):
            lr = lr.item()
        for param in group["params"]:
            grad, source, target = next(slots)
            if grad is None:
                target.copy_(source)
                continue
            direction = -grad if group["maximize"] else grad
            if decay != 0:
                direction = direction.add(source, alpha=decay)
            if momentum != 0:
                state = optimizer.state[param]
                buffer = state.get("momentum_buffer")
                if buffer is None:
                    buffer = state["momentum_buffer"] = direction.detach().clone()
                else:
                    buffer.mul_(momentum).add_(direction, alpha=1 - group["dampening"])
                direction = direction.add(buffer, alpha=momentum) if group["nesterov"] else buffer
            torch.add(source, direction, alpha=-lr, out=target)
