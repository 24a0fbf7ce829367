"""Transfer states and statistics, shared by senders and receivers.

TransferState lives in common.kv_messages, which the engine reads too: one enum for both sides."""

from __future__ import annotations

from dataclasses import dataclass

from common.kv_messages import TransferState

__all__ = ["TransferState", "TransferStats"]


@dataclass(slots=True)
class TransferStats:
    request_id: str
    backend: str
    num_bytes: int = 0
    in_place_bytes: int = 0  # of num_bytes, those moved cache to cache with no buffer between (in place, pulled)
    num_layers: int = 0
    num_windows: int = 1  # the block windows it left in (a prefill pushes one per prompt chunk)
    start_time: float | None = None  # first chunk sent / received (time.monotonic)
    first_layer_time: float | None = None
    end_time: float | None = None

    @property
    def time_to_first_layer_s(self) -> float | None:
        if self.start_time is None or self.first_layer_time is None:
            return None
        return self.first_layer_time - self.start_time

    @property
    def total_time_s(self) -> float | None:
        if self.start_time is None or self.end_time is None:
            return None
        return self.end_time - self.start_time
