"""A backward pass in two halves without recomputation: input gradients now, weight gradients later.

Zero-bubble schedules (Qi et al., ICLR 2024, §2) split a stage's backward into ``I`` (the gradient of
its input, on the pipeline's critical path) and ``W`` (the gradients of its weights, needed only by
the update). Running ``I`` as an input-only backward and ``W`` as a second backward from the outputs
would redo most of the work. Instead ``I`` records, at every autograd node it runs, the gradient that
flowed into it (node pre-hooks), and ``W`` resumes from those nodes towards the weights only
(:class:`torch.autograd.graph.GradientEdge`), each node asked only for the weights it reaches without
passing through another node ``I`` already ran — so no gradient is computed twice. Weights that no
such node reaches alone (unused on the input path, or also reached through another recorded node, as
a weight used in two places can be) are differentiated from the outputs directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["SplitBackward"]


def _nodes(roots: list[torch.Tensor]) -> list[Node]:
    """Every autograd node reachable from ``roots``."""
    seen: dict[Node, None] = {}
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen[node] = None
        stack.extend(child for child, _ in node.next_functions)
    return list(seen)


class SplitBackward:
    """The two halves of one micro-batch's backward on one stage.

    Args:
        roots: the stage's outputs (or its loss).
        root_grads: gradients of ``roots`` (``None`` for a scalar loss).
        inputs: the stage's inputs that need a gradient.
        params: the weight leaves the forward used.
    """

    def __init__(
        self,
        roots: list[torch.Tensor],
        root_grads: list[torch.Tensor] | None,
        inputs: list[torch.Tensor],
        params: list[torch.Tensor],
    ) -> None:
        self.roots, self.root_grads, self.inputs, self.params = roots, root_grads, inputs, params
        self.captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def input_gradients(self) -> list[torch.Tensor | None]:
        """``I``: the input gradients; remembers what reached each node on the way."""
        if not self.roots or not self.inputs:  # no output needs a gradient, or no input takes one
            return [None] * len(self.inputs)
        hooks = [
            node.register_prehook(lambda grads, node=node: self.captured.__setitem__(node, grads))
            for node in _nodes(self.roots)
        ]
        try:
            return list(
                torch.autograd.grad(self.roots, self.inputs, self.root_grads, retain_graph=True, allow_unused=True)
            )
        finally:
            for hook in hooks:
                hook.remove()

    def weight_gradients(self, add: Callable[[int, torch.Tensor], None]) -> None:
        """``W``: the weight gradients, resumed from the nodes ``I`` ran; ``add(i, gradient)`` takes
        each one (of ``params[i]``; some may come in parts) as soon as it is computed, so that no
        more than one node's gradients exist at a time besides what ``add`` keeps."""
        if not self.roots or not self.params:
            return
        accumulators = {get_gradient_edge(p).node: i for i, p in enumerate(self.params)}
        self._memo: dict[Node, set[int]] = {}
        regions = {node: self._region(node, accumulators) for node in self.captured}
        # a weight also reachable from a node through another node I ran would be counted twice
        shared = {i for own, beyond in regions.values() for i in own & beyond}
        for node, incoming in self.captured.items():
            own = sorted(regions[node][0] - shared)
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(incoming) if g is not None]
            if not own or not edges:
                continue
            results = torch.autograd.grad(
                [e for e, _ in edges],
                [self.params[i] for i in own],
                [g for _, g in edges],
                retain_graph=True,
                allow_unused=True,
            )
            for index, grad in zip(own, results, strict=True):
                if grad is not None:
                    add(index, grad)
        covered = {i for own, _ in regions.values() for i in own} - shared
        rest = [i for i in range(len(self.params)) if i not in covered]
        if rest:  # weights no recorded node reaches alone: from the outputs, every path counted once
            results = torch.autograd.grad(
                self.roots, [self.params[i] for i in rest], self.root_grads, allow_unused=True, retain_graph=True
            )
            for index, grad in zip(rest, results, strict=True):
                if grad is not None:
                    add(index, grad)
        self.captured.clear()

    def _region(self, start: Node, accumulators: dict[Node, int]) -> tuple[set[int], set[int]]:
        """Weights reached from ``start`` without passing another node ``I`` ran, and weights reached
        through such a node."""
        own: set[int] = set()
        beyond: set[int] = set()
        stack = [child for child, _ in start.next_functions]
        seen: set[Node] = set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if node in accumulators:
                own.add(accumulators[node])
            elif node in self.captured:
                beyond |= self._reachable(node, accumulators)
            else:
                stack.extend(child for child, _ in node.next_functions)
        return own, beyond

    def _reachable(self, start: Node, accumulators: dict[Node, int]) -> set[int]:
        """Every weight reachable from ``start`` (memoised per ``W``; iterative, graphs can be deep)."""
        stack: list[tuple[Node, bool]] = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if node in self._memo:
                continue
            children = [child for child, _ in node.next_functions if child is not None]
            if not expanded:
                stack.append((node, True))
                stack.extend((child, False) for child in children if child not in self._memo)
                continue
            found: set[int] = set()
            for child in children:
                found |= {accumulators[child]} if child in accumulators else self._memo.get(child, set())
            self._memo[node] = found
        return self._memo[start]
