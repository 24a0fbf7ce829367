"""Host integers to the GPU without a stall: reusable pinned buffers, copied non-blocking.

A step's inputs (token ids, positions, slots, block tables) are built on the host. Copied from
pageable memory, each ``.to(cuda)`` is synchronous; from a pinned buffer it is queued on the
stream and the host goes on. Two buffers take turns, each guarded by an event recorded after its
copy, so a step never rewrites a buffer the GPU may still be reading.
"""

from __future__ import annotations

import torch


class PinnedUpload:
    """``upload(host)`` -> the same values on ``device`` (a plain copy off CUDA)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def __call__(self, host: torch.Tensor) -> torch.Tensor:
        assert host.dtype == self.dtype, f"{host.dtype} into a {self.dtype} upload"
        if self.device.type != "cuda":
            return host.to(self.device)
        turn, self._turn = self._turn, self._turn ^ 1
        buffer, copied = self._buffers[turn], self._copied[turn]
        if copied is not None:
            copied.synchronize()  # normally long done: the step that read it has returned
        count = host.numel()
        if buffer is None or buffer.numel() < count:
            buffer = torch.empty(max(2 * count, 4096), dtype=self.dtype, pin_memory=True)
            self._buffers[turn] = buffer
        staged = buffer[:count]
        staged.copy_(host.reshape(-1))
        on_device = staged.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[turn] = event
        return on_device.view(host.shape)
