"""Python's garbage collector in a pipeline: collections at the same call on every rank.

A collection of Python's oldest generation walks every object it tracks: with torch imported, some
two hundred thousand, about 0.1 s on a CPU here (``bench/gc_pause.py``). Python starts one whenever
enough objects have survived, at a moment of its own on each rank, and in a pipeline a pause on one
rank stalls the ranks that wait for its messages: the pipeline loses the pauses of every rank, one
after the other. As Megatron-LM (``--manual-gc``) and torchtitan (``gc_freq``) do for the same
reason, the executor turns automatic collection off while it runs and collects on every rank at the
start of every ``every``-th call, so the pauses coincide (and on a drain, which every rank reaches
together). The objects alive when the executor starts (imports, the model, the programs) are frozen
(:func:`gc.freeze`): no collection walks them again, so a full collection, which frees every cycle
however old, costs only what was made since. A process forked from this package's forkserver starts
with the server's imports frozen already (:mod:`.frozen_preload`): those stay as they are, and the
executor neither freezes more nor lets them go, so its first collection walks only what the process
made itself (about 0.3 s less per fit on 2 CPU processes, where the imports are some 500,000 objects).
"""

from __future__ import annotations

import gc

from lightning_pipe.errors import check_whole

__all__ = ["AlignedCollection"]


class AlignedCollection:
    """Garbage collection of one worker, aligned on the executor's calls.

    Args:
        every: collect every this many calls (``None``: leave Python's automatic collector alone).

    Automatic collection stays off while any executor of the process holds it, and comes back (if it
    was on) when the last one closes.
    """

    _holders = 0
    _resume = False
    _freezing = False  # whether the holders freeze (and unfreeze at the end): nothing was frozen before them

    def __init__(self, every: int | None) -> None:
        check_whole("gc_every", every, 1, "calls", optional=True)
        self.every = every
        self.calls = 0
        self._holding = every is not None
        if self._holding:
            if AlignedCollection._holders == 0:
                AlignedCollection._resume = gc.isenabled()
                AlignedCollection._freezing = gc.get_freeze_count() == 0
            AlignedCollection._holders += 1
            gc.collect()
            if AlignedCollection._freezing:
                gc.freeze()
            gc.disable()

    def call(self) -> None:
        """A call starts: every ``every`` calls, collect."""
        if self.every is not None:
            self.calls += 1
            if self.calls % self.every == 0:
                self.full()

    def full(self) -> None:
        """Collect every generation (at a point every rank reaches together, e.g. a drain)."""
        if self.every is not None:
            gc.collect()

    def close(self) -> None:
        """Let go (once). When the last executor closes, the frozen objects are unfrozen: what a fit
        left behind (its strategy, model and optimizer, often in reference cycles, and the process
        groups whose threads those hold) must be collectable once the user drops it, or every fit of
        a sweep run in one process would keep its predecessors alive to the end."""
        if self._holding:
            self._holding = False
            AlignedCollection._holders -= 1
            if AlignedCollection._holders == 0:
                if AlignedCollection._freezing:
                    gc.unfreeze()
                if AlignedCollection._resume:
                    gc.enable()
