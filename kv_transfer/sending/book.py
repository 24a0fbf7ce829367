"""Every push of one sender, and the lock that both of its threads take to change one.

The compute thread starts, polls and releases pushes; the sending thread takes one at a time to
work on and moves its transfer's state forward. A push whose lease ran out fails on ``poll``,
unless the sending thread is working on it (see there).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from kv_transfer.sending.push import Push
from kv_transfer.state import TransferState, TransferStats


@dataclass(frozen=True, slots=True)
class SendStatus:
    state: TransferState
    reason: str | None
    layers_sent: int


class PushBook:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._pushes: dict[str, Push] = {}
        self._current: str | None = None  # the request the sending thread is working on

    # --- the compute thread -------------------------------------------------------------------
    def add(self, push: Push) -> None:
        with self.lock:
            self._pushes[push.ticket.request_id] = push

    def get(self, request_id: str) -> Push | None:
        return self._pushes.get(request_id)

    def poll(self, request_id: str) -> SendStatus:
        with self.lock:
            push = self._pushes.get(request_id)
            if push is None:
                return SendStatus(TransferState.FAILED, "no such transfer", 0)
            # While the sending thread works on this request it may still read the source blocks:
            # it ends the transfer itself (its send deadline is the lease), so the blocks stay held.
            if not push.state.is_terminal and push.ticket.is_expired() and self._current != request_id:
                push.fail("lease expired before the receiver acknowledged")
            return SendStatus(push.state, push.reason, push.layers_sent)

    def stats(self, request_id: str) -> TransferStats | None:
        push = self._pushes.get(request_id)
        return push.stats if push else None

    def release(self, request_id: str) -> None:
        with self.lock:
            self._pushes.pop(request_id, None)

    # --- either thread ------------------------------------------------------------------------
    def fail(self, push: Push, reason: str) -> None:
        with self.lock:
            push.fail(reason)

    def fail_request(self, request_id: str, reason: str) -> None:
        with self.lock:
            push = self._pushes.get(request_id)
            if push is not None:
                push.fail(reason)

    # --- the sending thread -------------------------------------------------------------------
    def take(self, request_id: str) -> Push | None:
        """The push to work on next, None if it ended meanwhile; ``put_down`` when done with it."""
        with self.lock:
            push = self._pushes.get(request_id)
            if push is None or push.state.is_terminal:
                return None
            self._current = request_id
            return push

    def put_down(self) -> None:
        with self.lock:
            self._current = None

    def open_window(self, push: Push, src_block_ids: list[int]) -> None:
        with self.lock:
            if not push.open_window(src_block_ids):
                push.fail(f"window {src_block_ids[:4]}... names no block left of the ticket's")

    def transferring(self, push: Push) -> bool:
        """Mark the transfer as begun (its first chunk about to leave); False if it already ended."""
        push.stats.start_time = time.monotonic()
        with self.lock:
            if push.state.is_terminal:
                return False
            push.state = TransferState.TRANSFERRING
            return True

    def done(self, push: Push) -> None:
        """Every receiver acknowledged the "done" (unless a posted chunk's refusal failed it since)."""
        with self.lock:
            if not push.state.is_terminal:
                push.state = TransferState.DONE
                stats = push.stats
                stats.end_time = time.monotonic()
                stats.num_layers = push.layers_sent // max(1, len(push.windows))
                stats.num_windows = len(push.windows)
