"""A backward pass in two halves without recomputation: input gradients now, weight gradients later.

Zero-bubble schedules (Qi et al., ICLR 2024, §2) split a stage's backward into ``I`` (the gradient of
its input, on the pipeline's critical path) and ``W`` (the gradients of its weights, needed only by
the update). Running ``I`` as an input-only backward and ``W`` as a second backward from the outputs
would redo most of the work. Instead ``I`` records the gradient that flows into the autograd nodes it
runs (node pre-hooks), and ``W`` resumes from those nodes towards the weights only
(:class:`torch.autograd.graph.GradientEdge`), each node asked only for the weights it reaches without
passing through another node ``I`` runs — so no gradient is computed twice. Weights that no such node
reaches alone (unused on the input path, or also reached through another node ``I`` runs, as a
weight used in two places can be) are differentiated from the outputs directly.

Only the nodes ``W`` resumes from keep their gradient (a convolution's or a linear layer's incoming
gradient, not an activation function's or a sum's): which ones is known before ``I`` runs, from the
nodes autograd will execute (those with an edge on a path to an input), so the memory held between
the halves is those gradients alone (:attr:`SplitBackward.kept_bytes`), and ``W`` frees each as soon
as it is used.
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
        if node not in seen:
            seen[node] = None
            stack.extend(_children(node))
    return list(seen)


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _closure(nodes: list[Node], base: Callable[[Node], set[int]]) -> dict[Node, set[int]]:
    """For every node, the union of ``base`` over the node and its descendants (children first;
    iterative: graphs can be deep)."""
    memo: dict[Node, set[int]] = {}
    for root in nodes:
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in memo:
                continue
            if not expanded:
                stack.append((node, True))
                stack.extend((child, False) for child in _children(node) if child not in memo)
                continue
            found = set(base(node))
            for child in _children(node):
                found |= memo[child]
            memo[node] = found
    return memo


def _executed(nodes: list[Node], inputs: list[torch.Tensor]) -> set[Node]:
    """The nodes ``torch.autograd.grad(roots, inputs)`` runs: those with an edge on a path to an
    input's gradient edge."""
    targets = {get_gradient_edge(x).node for x in inputs}
    leads = _closure(nodes, lambda node: {0} if node in targets else set())
    return {node for node in nodes if any(child in targets or leads[child] for child in _children(node))}


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
        self.resume: dict[Node, list[int]] = {}  # the nodes W resumes from, and the weights each owns
        self.rest: list[int] = list(range(len(params)))  # weights W differentiates from the outputs

    @property
    def kept_bytes(self) -> int:
        """Bytes of the gradients held from ``I`` until ``W`` uses them."""
        return sum(g.numel() * g.element_size() for grads in self.captured.values() for g in grads if g is not None)

    def input_gradients(self) -> list[torch.Tensor | None]:
        """``I``: the input gradients; keeps what reaches each node ``W`` will resume from."""
        if not self.roots or not self.inputs:  # no output needs a gradient, or no input takes one
            return [None] * len(self.inputs)
        self._plan_weights(_nodes(self.roots))
        hooks = [
            node.register_prehook(lambda grads, node=node: self.captured.__setitem__(node, grads))
            for node in self.resume
        ]
        try:
            return list(
                torch.autograd.grad(self.roots, self.inputs, self.root_grads, retain_graph=True, allow_unused=True)
            )
        finally:
            for hook in hooks:
                hook.remove()

    def _plan_weights(self, nodes: list[Node]) -> None:
        """Which node ``W`` asks for which weights. ``I`` runs the nodes with an edge on a path to an
        input (autograd's rule for ``torch.autograd.grad``); a node's own weights are those it reaches
        without passing through another such node; a weight also reached through another such node
        would be counted twice, so it is left to the outputs."""
        runs = _executed(nodes, self.inputs)
        accumulators = {get_gradient_edge(p).node: i for i, p in enumerate(self.params)}
        weights = _closure(nodes, lambda node: {accumulators[node]} if node in accumulators else set())
        regions = {node: self._region(node, runs, accumulators, weights) for node in runs}
        shared = {i for own, beyond in regions.values() for i in own & beyond}
        self.resume = {node: sorted(own - shared) for node, (own, _) in regions.items() if own - shared}
        covered = {i for owned in self.resume.values() for i in owned}
        self.rest = [i for i in range(len(self.params)) if i not in covered]

    @staticmethod
    def _region(
        start: Node, runs: set[Node], accumulators: dict[Node, int], weights: dict[Node, set[int]]
    ) -> tuple[set[int], set[int]]:
        """Weights reached from ``start`` without passing another node of ``runs``, and weights
        reached through such a node."""
        own: set[int] = set()
        beyond: set[int] = set()
        stack = _children(start)
        seen: set[Node] = set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in accumulators:
                own.add(accumulators[node])
            elif node in runs:
                beyond |= weights[node]
            else:
                stack.extend(_children(node))
        return own, beyond

    def weight_gradients(self, add: Callable[[int, torch.Tensor], None]) -> None:
        """``W``: the weight gradients, resumed from the nodes ``I`` ran; ``add(i, gradient)`` takes
        each one (of ``params[i]``; some may come in parts) as soon as it is computed, so that no
        more than one node's gradients exist at a time besides what ``add`` keeps."""
        if not self.roots or not self.params:
            return
        rest = list(self.rest)
        for node, owned in self.resume.items():
            if node not in self.captured:  # autograd did not run it after all: from the outputs
                rest += owned
                continue
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(self.captured.pop(node)) if g is not None]
            if not edges:
                continue
            results = torch.autograd.grad(
                [e for e, _ in edges],
                [self.params[i] for i in owned],
                [g for _, g in edges],
                retain_graph=True,
                allow_unused=True,
            )
            for index, grad in zip(owned, results, strict=True):
                if grad is not None:
                    add(index, grad)
        if rest:  # weights no node I ran reaches alone: from the outputs, every path counted once
            results = torch.autograd.grad(
                self.roots, [self.params[i] for i in rest], self.root_grads, allow_unused=True, retain_graph=True
            )
            for index, grad in zip(rest, results, strict=True):
                if grad is not None:
                    add(index, grad)
        self.captured.clear()
