"""Keeping freed memory in the process for the next step (CPU, glibc).

Each forward pass allocates and frees its large activations afresh (a 2,048-token prefill of
SmolLM2 makes several 6-25 MB tensors a layer). glibc serves blocks that large with mmap, or trims
them off the heap top once freed, so the next step's allocations come back as fresh pages that
the kernel must fault in and zero: 67,000 page faults (270 MB) per prefill step, 12% of its time
under perf. Raising the mmap threshold and the trim threshold keeps those blocks in the heap,
where the next step reuses them (0 faults per step after the first). The cost is that the process
keeps its peak activation memory mapped (up to 1 GiB of free heap), as tcmalloc or jemalloc would
(vLLM preloads one on CPU). ``PDSERVE_KEEP_FREED_MEMORY=0`` leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
# Blocks below this come from the heap. Older glibc refuses more than 32 MiB (HEAP_MAX_SIZE / 2),
# which still covers a 2,048-token step's activations; threads' own arenas mmap past 64 MiB anyway.
_MMAP_THRESHOLDS = (1 << 30, 32 << 20)
_TRIM_THRESHOLD = 1 << 30  # the free heap top is given back only past 1 GiB
_kept: bool | None = None
kept_below = 0  # the mmap threshold set: freed blocks smaller than this stay in the heap


def keep_freed_memory() -> bool:
    """Once per process: tell glibc's malloc to keep freed blocks for reuse. False where the C
    library is not glibc (or has no mallopt), where it refused, or with PDSERVE_KEEP_FREED_MEMORY=0;
    then nothing changes."""
    global _kept, kept_below
    if _kept is not None:
        return _kept
    _kept = False
    if not sys.platform.startswith("linux") or os.environ.get("PDSERVE_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.restype, mallopt.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
    threshold = next((t for t in _MMAP_THRESHOLDS if mallopt(_M_MMAP_THRESHOLD, t)), None)
    trimmed = bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    _kept = threshold is not None and trimmed
    kept_below = threshold or 0
    logger.info("malloc keeps freed blocks below %s MiB for reuse: %s", (threshold or 0) >> 20, _kept)
    return _kept
