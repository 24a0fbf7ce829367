"""NCCL's process-wide settings, read from the environment when a group is made.

torch reads TORCH_NCCL_ASYNC_ERROR_HANDLING when a ProcessGroupNCCL is constructed, so one group can
be made with its own value by setting the variable around that construction. Every group made in
a pdserve process is made under ``group_construction``: the KV transport's pair groups with the
handling off, the engine's tensor-parallel group with torch's default, and neither inherits the
other's value while the variable is briefly changed.

Torch-free, so engine/ and kv_transfer/ both use it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_lock = threading.Lock()


@contextlib.contextmanager
def group_construction(**overrides: str) -> Iterator[None]:
    """Hold the process's NCCL-group lock, with ``overrides`` (variable -> value) set, for the block."""
    with _lock:
        before = {name: os.environ.get(name) for name in overrides}
        os.environ.update(overrides)
        try:
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
