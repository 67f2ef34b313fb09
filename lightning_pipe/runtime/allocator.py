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
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["RELEASE_THRESHOLD", "MallInfo", "mallinfo", "release_freed_memory"]

RELEASE_THRESHOLD = 4 * 1024 * 1024
"""Blocks of this many bytes or more go back to the system when freed (activations, gradients)."""

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
