"""The completion rule: what a transfer is owed, what has landed, and when it is DONE.

The plan is learnt from a transfer's first chunk: the sender's TP size decides which senders' head
segments this shard receives, each for every layer. A sender's "done" names its windows, which must
tile the ticket's blocks; the transfer is DONE once every expected sender said "done" and exactly
the chunks their windows owe this shard (every layer of every segment, in every window) have landed.
"""

from __future__ import annotations

import time

from common.kv_layout import KVCacheLayout
from kv_transfer.protocol import ChunkHeader
from kv_transfer.receiving.checks import ChunkChecks
from kv_transfer.receiving.transfer import ChunkKey, IncomingTransfer, SegmentLayer, Window
from kv_transfer.resharding import plan_transfer, senders_for
from kv_transfer.state import TransferState


class Completion:
    def __init__(self, layout: KVCacheLayout, checks: ChunkChecks) -> None:
        self.layout = layout
        self.checks = checks

    def learn_senders(self, incoming: IncomingTransfer, header: ChunkHeader) -> None:
        if incoming.sender_tp is None:
            incoming.sender_tp = header.sender_tp
            plan = plan_transfer(header.sender_tp, self.layout.tp_size, self.layout.total_kv_heads)
            incoming.segment_heads = {
                (seg.sender_rank, seg.dst_head_offset): seg.num_heads
                for seg in plan
                if seg.receiver_rank == self.layout.tp_rank
            }
            incoming.expected = {
                SegmentLayer(sender, layer, offset)
                for sender, offset in incoming.segment_heads
                for layer in range(self.layout.num_layers)
            }
        elif header.sender_tp != incoming.sender_tp:
            self.checks.refuse("unplanned", f"sender TP changed from {incoming.sender_tp} to {header.sender_tp}")

    def landed(
        self,
        incoming: IncomingTransfer,
        headers: list[ChunkHeader],
        keys: list[ChunkKey],
        nbytes: int,
        in_place: bool,
    ) -> None:
        """``headers``' chunks (``nbytes`` in all) are in their blocks: recorded together, since a
        batch names up to every layer and the bookkeeping costs as much per layer as a short copy."""
        if not headers:
            return
        now = time.monotonic()
        stats = incoming.stats
        if stats.start_time is None:
            stats.start_time = now
        stats.num_bytes += nbytes
        if in_place:
            stats.in_place_bytes += nbytes
        incoming.landed.update(keys)
        for header in headers:
            incoming.layers_landed[header.layer] += 1
            incoming.windows_landed.add((header.block_offset, header.num_blocks))
        if stats.first_layer_time is None and self.layers_complete(incoming) >= 1:
            stats.first_layer_time = now
        if incoming.state is TransferState.PENDING:
            incoming.state = TransferState.TRANSFERRING
        self._maybe_done(incoming)

    def on_done(self, incoming: IncomingTransfer, header: ChunkHeader) -> None:
        """A sender's "done": it fails the transfer if the sender's windows do not tile the ticket,
        or if what landed from it is not exactly what they owe."""
        sender = header.sender_rank
        windows = header.windows if header.windows is not None else [[0, incoming.ticket.num_blocks]]
        tiling = _tiling_windows(windows, incoming.ticket.num_blocks)
        if tiling is None:
            incoming.fail(f"sender {sender} finished with windows {windows!r} that do not tile the ticket")
            return
        incoming.done_from.add(sender)
        incoming.done_windows[sender] = tiling
        if header.first_token_id is not None:
            incoming.first_token_id = header.first_token_id
        announced = self._owed_by(incoming, sender)
        landed = {key for key in incoming.landed if key.sender == sender}
        if landed != announced:
            missing, stray = len(announced - landed), len(landed - announced)
            incoming.fail(f"sender {sender} finished with {missing} chunks missing, {stray} outside its windows")
            return
        self._maybe_done(incoming)

    def layers_complete(self, incoming: IncomingTransfer) -> int:
        """Layers whose every segment has landed in every window that chunks landed in so far."""
        if incoming.sender_tp is None:
            return 0
        per_layer = len(incoming.expected) // self.layout.num_layers * max(1, len(incoming.windows_landed))
        count = 0
        for layer in range(self.layout.num_layers):  # layers land in order; count the complete prefix
            if incoming.layers_landed[layer] < per_layer:
                break
            count += 1
        return count

    def _owed_by(self, incoming: IncomingTransfer, sender: int) -> set[ChunkKey]:
        """Every chunk a finished sender's windows owe this shard."""
        windows = incoming.done_windows[sender]
        return {
            ChunkKey(*segment, offset, count)
            for segment in incoming.expected
            if segment.sender == sender
            for offset, count in windows
        }

    def _maybe_done(self, incoming: IncomingTransfer) -> None:
        if not incoming.done_from:
            return  # no sender has finished yet
        assert incoming.sender_tp is not None
        needed = senders_for(self.layout.tp_rank, incoming.sender_tp, self.layout.tp_size, self.layout.total_kv_heads)
        if not needed <= incoming.done_from:
            return
        owed: set[ChunkKey] = set()
        for sender in needed:
            owed |= self._owed_by(incoming, sender)
        if incoming.landed == owed:
            incoming.state = TransferState.DONE
            incoming.stats.end_time = time.monotonic()
            incoming.stats.num_layers = self.layout.num_layers


def _tiling_windows(windows: object, num_blocks: int) -> list[Window] | None:
    """``windows`` ([block_offset, num_blocks] each, from a "done"), if they cover a ticket of
    ``num_blocks`` blocks in order without a gap or an overlap; else None."""
    if not isinstance(windows, list) or not 0 < len(windows) <= max(1, num_blocks):
        return None
    tiling: list[Window] = []
    end = 0
    for window in windows:
        if not (type(window) is list and len(window) == 2 and all(type(v) is int for v in window)):
            return None
        offset, count = window
        if offset != end or count <= 0:
            return None
        tiling.append(Window(offset, count))
        end += count
    return tiling if end == num_blocks else None
