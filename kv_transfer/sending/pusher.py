"""Sends a push's items on the sending thread: its layers, each by the best path open to it, and
its "done". The one place a layer's path is chosen (the paths: ``kv_transfer.sending.paths``).

For each head segment (the heads one receiver takes from this shard), layers go pulled when the
channel can share this cache with the receiver. Otherwise, when this shard sends to one receiver
only, as many as can go in place do; the rest are copied, several to a chunk.
"""

from __future__ import annotations

from common.kv_layout import KVCacheLayout
from kv_transfer.protocol import ChunkHeader, encode_header
from kv_transfer.resharding import HeadSegment, segments_from
from kv_transfer.sending.book import PushBook
from kv_transfer.sending.channels import Channels
from kv_transfer.sending.chunks import ChunkWriter, segment_layer_bytes, time_left
from kv_transfer.sending.items import LayerItem
from kv_transfer.sending.paths import send_copied_batch, send_copied_layer, send_in_place, send_pulled
from kv_transfer.sending.push import Push
from kv_transfer.transport import KVChannel

# A copied batch is written under the receiver's lock: bound it as a pulled batch's copy is bounded.
_MAX_COPIED_BATCH_BYTES = 16 << 20


class Pusher:
    def __init__(self, layout: KVCacheLayout, book: PushBook, channels: Channels, writer: ChunkWriter) -> None:
        self.layout = layout
        self.book = book
        self.channels = channels
        self.writer = writer

    def send_layers(self, push: Push, layers: list[LayerItem]) -> None:
        """Layers of one push queued together, in order: they leave in as few chunks as their paths allow."""
        ticket = push.ticket
        layout = self.layout
        w, channels = self.writer, self.channels
        if push.stats.start_time is None and not self.book.transferring(push):
            return
        segments = segments_from(layout.tp_rank, layout.tp_size, ticket.layout.tp_size, layout.total_kv_heads)
        copied: list[tuple[HeadSegment, KVChannel]] = []
        for seg in segments:
            channel = channels.to(ticket, seg.receiver_rank)
            sources = channel.pull_sources([item.kv_layer for item in layers])
            if all(source is not None for source in sources):
                send_pulled(w, channels, push, layers, seg, channel, sources)
            else:
                copied.append((seg, channel))
        done = send_in_place(w, channels, push, layers, *copied[0]) if len(copied) == len(segments) == 1 else 0
        rest = layers[done:]
        if not copied:  # every segment pulled its layers
            for _ in rest:
                push.layer_sent()
        while rest and copied:
            # Layers queued together leave in one chunk per segment, up to _MAX_COPIED_BATCH_BYTES.
            widest = max(seg.num_heads for seg, _ in copied)
            batch = max(1, _MAX_COPIED_BATCH_BYTES // max(1, segment_layer_bytes(push, rest[0].kv_layer, widest)))
            group, rest = rest[:batch], rest[batch:]
            if len(group) > 1:
                for seg, channel in copied:
                    send_copied_batch(w, channels, push, group, seg, channel)
                for _ in group:
                    push.layer_sent()
            else:
                send_copied_layer(w, channels, push, group[0], copied, len(segments) == 1)

    def send_done(self, push: Push, first_token_id: int | None) -> None:
        """The "done" to every receiver, naming the windows; then the transfer is DONE (a refusal of
        a posted chunk, read here at the latest, fails it first)."""
        ticket = push.ticket
        sent = push.num_blocks_pushed
        if sent != ticket.num_blocks:
            raise ValueError(f"finished with {sent} of the ticket's {ticket.num_blocks} blocks sent")
        for receiver in sorted(push.receivers):
            header = ChunkHeader(
                kind="done",
                request_id=ticket.request_id,
                sender_rank=self.layout.tp_rank,
                sender_tp=self.layout.tp_size,
                receiver_rank=receiver,
                first_token_id=first_token_id,
                num_layers_sent=push.layers_sent,
                windows=push.windows,
            )
            self.channels.to(ticket, receiver).send(encode_header(header, ticket.secret), b"", time_left(ticket))
        if self.channels.posting:
            self.channels.collect()  # the sends above settled this request's posted chunks
        self.book.done(push)
