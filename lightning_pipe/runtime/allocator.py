"""CPU training: resident memory that follows what is allocated (glibc's mmap threshold).

glibc serves a block below its *mmap threshold* from its heap and keeps it there when it is freed,
for the next allocation. The threshold starts at 128 KiB and rises to the size of each large block
freed (up to 32 MiB), so after the first step a stage's activations all come from the heap, and the
heap keeps the free space between them: on the ResNet-18 of ``docs/measurements.md`` a process's
resident peak rose up to 36% above the bytes it had allocated at its peak. With a fixed threshold,
every block of at least that size is mapped on its own and unmapped when freed: resident memory
follows the allocated bytes, which is what a plan predicts (and what
``torch.cuda.max_memory_allocated`` counts on a GPU). The price is paid in time: each such block's
pages are faulted in (and zeroed) again when it is next allocated.
"""

from __future__ import annotations

import ctypes

__all__ = ["RELEASE_THRESHOLD", "release_freed_memory"]

RELEASE_THRESHOLD = 4 * 1024 * 1024
"""Blocks of this many bytes or more go back to the system when freed (activations, gradients)."""

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def release_freed_memory(threshold: int = RELEASE_THRESHOLD) -> bool:
    """Have glibc map every block of ``threshold`` bytes or more on its own, so that freeing it
    gives its memory back to the system, for the rest of the process. Returns whether it did (glibc
    only: elsewhere nothing changes)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc's: another libc's mallopt takes other numbers)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
