"""Freed activation memory stays in the process, where the next step's tensors reuse it."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from engine import heap
from engine.heap import keep_freed_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def mallinfo() -> MallInfo2:
    fn = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if fn is None:
        pytest.skip("mallinfo2 needs glibc 2.33")
    fn.restype = MallInfo2
    return fn()


def test_a_freed_large_tensor_stays_in_the_heap_for_reuse():
    # Counted by malloc itself, not by page faults: the kernel may reclaim idle pages on its own.
    mallinfo()
    assert keep_freed_memory()
    size = 40 << 20  # above glibc's largest dynamic mmap threshold (32 MiB): without the setting it
    # is mmapped on allocation and unmapped on free, and every step faults it in afresh
    if heap.kept_below <= size:
        pytest.skip("this glibc caps the mmap threshold at 32 MiB")
    mapped_before = mallinfo().hblkhd
    t = torch.empty(size // 4)
    assert mallinfo().hblkhd - mapped_before < size  # served from the heap, not a fresh mapping
    del t
    assert mallinfo().fordblks >= size  # freed, and still the process's, for the next allocation
