"""Keeping freed memory in the process for the next step (CPU, glibc).

Each forward pass allocates and frees its large activations afresh (a 2,048-token prefill of
SmolLM2 makes several 6-25 MB tensors a layer). glibc serves blocks that large with mmap, or trims
them off the heap top once freed, so the next step's allocations come back as fresh pages that
the kernel must fault in and zero: 67,000 page faults (270 MB) per prefill step, 12% of its time
under perf. Raising the mmap threshold and the trim threshold keeps those blocks in the heap,
where the next step reuses them (0 faults per step after the first). The cost is that the process
keeps its peak activation memory mapped, as tcmalloc or jemalloc would (vLLM preloads one on CPU).
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap
_TRIM_THRESHOLD = (1 << 31) - 1  # never trim the heap top (mallopt takes an int)
_kept = False


def keep_freed_memory() -> bool:
    """Once per process: tell glibc's malloc to keep freed blocks for reuse. False where the C
    library is not glibc (or has no mallopt), which changes nothing."""
    global _kept
    if _kept:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.restype, mallopt.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
    _kept = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    logger.info("malloc keeps freed blocks for reuse: %s", "yes" if _kept else "no (mallopt refused)")
    return _kept
