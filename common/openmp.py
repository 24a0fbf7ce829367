"""One OpenMP team per process: side threads run their tensor work serially.

libgomp, torch's OpenMP runtime on Linux, keeps a team of worker threads for every thread that
ran a parallel region, for as long as that thread lives. When it manages more threads than the
process has CPUs it cuts every barrier's spin to 100 iterations and then sleeps on a futex, so
one long-lived side thread that once ran a parallel copy turns every parallel region of the
engine's steps into sleep/wake round trips: 25% slower alone (64 × 256/64 tokens, 2 cores), about
twice as slow while the router and Serve's proxy share the cores. Threads that only move bytes
(KV I/O, accept loops) or build the engine before handing it over should not own a team.

Torch-free: the runtime is found among the libraries already loaded into the process.
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The loaded libraries, if one of them is an OpenMP runtime (torch loads its own globally)."""
    process = ctypes.CDLL(None)
    return process if hasattr(process, "omp_set_num_threads") else None


def run_tensor_ops_serially() -> None:
    """The calling thread's torch operations run on it alone from now on: OpenMP's thread count
    is a per-thread setting, so the engine thread keeps its own. A no-op without OpenMP."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    # Torch sets each thread's OpenMP count from its global setting at the thread's first
    # parallel operation; asking for the count does that now, so it cannot undo ours later.
    torch.get_num_threads()
    runtime = _openmp_runtime()
    if runtime is not None:
        runtime.omp_set_num_threads(1)
