"""An order of a graph's nodes that respects its edges, the smallest ready node first (Kahn's
algorithm with a heap): the order a graph gives when its edges allow the nodes' own order, and the
least departure from it where they do not."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["smallest_first"]


def smallest_first(successors: Sequence[Sequence[int]], waiting: Sequence[int]) -> list[int]:
    """Nodes ``0 .. n-1`` in an order respecting the edges (``successors[u]``: the nodes after ``u``;
    ``waiting[v]``: how many edges end at ``v``), the smallest ready node each time. Shorter than
    ``n`` when the edges form a cycle (the nodes on it and after it are left out)."""
    remaining = list(waiting)
    ready = [node for node, count in enumerate(remaining) if count == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        node = heapq.heappop(ready)
        order.append(node)
        for later in successors[node]:
            remaining[later] -= 1
            if remaining[later] == 0:
                heapq.heappush(ready, later)
    return order
