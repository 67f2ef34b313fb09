"""CPU training: resident memory that follows what is allocated (glibc's mmap threshold).

glibc serves a block below its *mmap threshold* from its heap and keeps it there when it is freed,
for the next allocation. The threshold starts at 128 KiB and rises to the size of each large block
freed (up to 32 MiB), so after the first step a stage's activations all come from the heap, and the
heap keeps the free space between them: on the ResNet-18 of ``docs/measurements.md`` each rank's
resident peak rose 98-370 MB above its allocated and shared bytes (``bench/memory.py``'s ``other``),
30-68 MB with the threshold fixed. With a fixed threshold,
every block of at least that size is mapped on its own and unmapped when freed: resident memory
follows the allocated bytes, which is what a plan predicts (and what
``torch.cuda.max_memory_allocated`` counts on a GPU). The price is paid in time: each such block's
pages are faulted in (and zeroed) again when it is next allocated.

Without a fixed threshold, what a block of a few MiB costs depends on the heap's history: until a
block near glibc's largest dynamic threshold (32 MiB) has been freed, the heap's free top is trimmed
back to the system at twice the threshold reached so far, and a layer whose gradients are a few MiB
faults its pages in at every backward. A run reaches the settled state within its first steps; a
profile measured before it did not: torchvision's ResNet-18 at 32x32, its ``layer4`` at 4 rows a
micro-batch, profiled at 31-35 ms a backward on one thread of a 2-core machine and ran at 12-13 ms in
the pipeline (11.5-13 ms alone once settled; ``docs/measurements.md``, *The heap settled before the
profile*). :func:`settle_heap` puts a process in the state a run settles in, before anything is
timed.
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["RELEASE_THRESHOLD", "SETTLED_THRESHOLD", "MallInfo", "mallinfo", "release_freed_memory", "settle_heap"]

RELEASE_THRESHOLD = 4 * 1024 * 1024
"""Blocks of this many bytes or more go back to the system when freed (activations, gradients)."""

SETTLED_THRESHOLD = (32 << 20) - (1 << 20)
"""Bytes of the block :func:`settle_heap` maps and frees: below glibc's largest dynamic mmap
threshold (``DEFAULT_MMAP_THRESHOLD_MAX``, 32 MiB on 64-bit systems), above anything it starts from."""

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()  # noqa: SIM905


class MallInfo(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc >= 2.33): ``uordblks + hblkhd`` are the bytes handed out
    and not given back (heap blocks in use, blocks mapped on their own), ``hblks`` the blocks mapped."""

    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]

    @property
    def in_use(self) -> int:
        return self.uordblks + self.hblkhd


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (another libc's ``mallopt`` takes other numbers)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version"):
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = MallInfo
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def mallinfo() -> MallInfo | None:
    """glibc's allocation statistics now (``None`` elsewhere, or before glibc 2.33)."""
    libc = _glibc()
    return libc.mallinfo2() if libc is not None and hasattr(libc, "mallinfo2") else None


def release_freed_memory(threshold: int = RELEASE_THRESHOLD) -> bool:
    """Have glibc map every block of ``threshold`` bytes or more on its own, so that freeing it
    gives its memory back to the system, for the rest of the process. Returns whether it did (glibc
    only: elsewhere nothing changes)."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))


def settle_heap() -> bool:
    """Raise glibc's dynamic mmap threshold to about :data:`SETTLED_THRESHOLD` (and its trim threshold
    to twice that), as a run's first steps do when they free a large block: blocks below it then come
    from the heap and are reused without faulting their pages in again. Maps and frees one block of
    that size, touching none of its pages. Returns whether it could (glibc only). After
    :func:`release_freed_memory` (a fixed threshold) it changes nothing: glibc no longer adjusts."""
    libc = _glibc()
    if libc is None:
        return False
    block = libc.malloc(SETTLED_THRESHOLD)
    if not block:
        return False
    libc.free(block)
    return True
