"""One push: a prefill shard's sending of one transfer, and the window its layers leave from.

A ticket's blocks may leave in windows, in the ticket's order: each is a contiguous range of the
ticket's blocks, with the source blocks they come from. Layers queued after a window opens are
pushed from its blocks; the "done" names every window, which must cover the ticket's blocks.

    ticket blocks   [ d0 d1 d2 d3 d4 d5 d6 ]
    windows         [ 0, 3 ]    [ 3, 4 ]          [block_offset, num_blocks] each
                    s7 s2 s9    s4 s5 s1 s8       the source blocks of each, from this cache
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kv_transfer.block_copy import BlockCopyPlan, gather_plan, plan_block_copy
from kv_transfer.state import TransferState, TransferStats
from kv_transfer.ticket import KVTicket


@dataclass(frozen=True, slots=True)
class Window:
    """The window being pushed: its source blocks, their gather plan, and their plan into the
    reserved ones (whose runs split a payload sent in place)."""

    block_offset: int  # the window's first block among the ticket's
    src_block_ids: list[int]
    gather: BlockCopyPlan
    direct: BlockCopyPlan


def _no_window() -> Window:
    # Each push its own: a plan caches index tensors, and pushes run on different threads.
    return Window(0, [], gather_plan([]), plan_block_copy([], []))


@dataclass
class Push:
    """Written by the sending thread; its state and reason also by the compute thread (``poll``,
    a full queue), always under the book's lock."""

    ticket: KVTicket
    stats: TransferStats
    receivers: set[int]  # the receiver ranks this shard sends heads to
    window: Window = field(default_factory=_no_window)
    windows: list[list[int]] = field(default_factory=list)  # [block_offset, num_blocks] of each window
    state: TransferState = TransferState.PENDING
    reason: str | None = None
    layers_sent: int = 0

    def open_window(self, src_block_ids: list[int]) -> bool:
        """Make ``src_block_ids`` (cut to the ticket's blocks left) the window being pushed; False
        if none is left."""
        ticket = self.ticket
        offset = self.num_blocks_pushed
        block_ids = [int(b) for b in src_block_ids[: ticket.num_blocks - offset]]
        if not block_ids:
            return False
        self.window = Window(
            block_offset=offset,
            src_block_ids=block_ids,
            gather=gather_plan(block_ids),
            direct=plan_block_copy(block_ids, list(ticket.block_ids[offset : offset + len(block_ids)])),
        )
        self.windows.append([offset, len(block_ids)])
        return True

    @property
    def num_blocks_pushed(self) -> int:
        """The ticket's blocks the windows opened so far cover."""
        return sum(n for _, n in self.windows)

    def layer_sent(self) -> None:
        self.layers_sent += 1
        if self.stats.first_layer_time is None:
            self.stats.first_layer_time = time.monotonic()

    def fail(self, reason: str) -> None:
        """The caller holds the book's lock."""
        if not self.state.is_terminal:
            self.state = TransferState.FAILED
            self.reason = reason
            self.stats.end_time = time.monotonic()
