"""One transfer as the receiving shard sees it (its states: kv_transfer.receiver): its ticket, the
plan learnt from its first chunk, what has landed, what the senders that finished said, and the
checks its chunks share, made once per ticket. The keys name a chunk's place in the transfer.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kv_transfer.block_copy import BlockCopyPlan
from kv_transfer.state import TransferState, TransferStats
from kv_transfer.ticket import KVTicket

if TYPE_CHECKING:
    from kv_transfer.receiving.direct import DirectPlan, DirectWrite
    from kv_transfer.receiving.pulled import PullPlan

LEASE_EXPIRED = "lease expired before the KV arrived"  # engine.llm_engine counts failures by "lease expired"


class SegmentLayer(NamedTuple):
    """One layer of one sender's head segment: what the transfer plan expects in every window."""

    sender: int
    layer: int
    dst_head_offset: int


class ChunkKey(NamedTuple):
    """A chunk's place in a transfer. The window's size is part of it: a chunk of blocks [0, 2) must
    not stand in for a "done" that announces one window [0, N)."""

    sender: int
    layer: int
    dst_head_offset: int
    block_offset: int
    num_blocks: int


class Window(NamedTuple):
    """A contiguous range of a ticket's blocks, as indexes into them."""

    block_offset: int
    num_blocks: int


class ReservedWindow(NamedTuple):
    """A window's reserved blocks in this cache, and a payload's plan into them."""

    block_ids: list[int]
    scatter: BlockCopyPlan


@dataclass(slots=True)
class IncomingTransfer:
    ticket: KVTicket
    stats: TransferStats
    state: TransferState = TransferState.PENDING
    reason: str | None = None
    first_token_id: int | None = None
    # The plan, learnt from the first chunk (the sender's TP size decides it).
    sender_tp: int | None = None
    expected: set[SegmentLayer] = field(default_factory=set)
    # (sender, dst_head_offset) -> its heads; looked up per chunk with a plain tuple, so left one
    segment_heads: dict[tuple[int, int], int] = field(default_factory=dict)
    # What has landed, and what the senders that finished said they sent.
    landed: set[ChunkKey] = field(default_factory=set)
    layers_landed: Counter[int] = field(default_factory=Counter)  # layer -> (segment, window) pairs landed
    # (block_offset, num_blocks) of the windows chunks landed in: a plain pair, added per layer
    windows_landed: set[tuple[int, int]] = field(default_factory=set)
    done_from: set[int] = field(default_factory=set)  # senders
    done_windows: dict[int, list[Window]] = field(default_factory=dict)  # sender -> its windows
    # Checked once per ticket, then reused by its chunks.
    windows: dict[tuple[int, int], ReservedWindow] = field(default_factory=dict)  # by (block_offset, num_blocks)
    pull_plan: PullPlan | None = None  # what pulled layers share
    direct_plan: DirectPlan | None = None  # the block runs of a payload received in place
    # Payloads a transport is receiving in place.
    writing: set[ChunkKey] = field(default_factory=set)
    in_flight: list[DirectWrite] = field(default_factory=list)  # the writes under way (their abort hooks)

    def fail(self, reason: str) -> None:
        if not self.state.is_terminal:
            self.state = TransferState.FAILED
            self.reason = reason
            self.stats.end_time = time.monotonic()

    def expire_if_due(self) -> bool:
        """Whether the ticket's lease has run out; a transfer not yet ended fails then."""
        if not self.ticket.is_expired():
            return False
        self.fail(LEASE_EXPIRED)
        return True

    def end_write(self, write: DirectWrite) -> None:
        """The transport is done with ``write``'s targets, whatever became of its payload."""
        self.writing.difference_update(write.keys)
        self.in_flight = [other for other in self.in_flight if other is not write]
