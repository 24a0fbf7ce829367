"""One sending shard: pushes each layer's KV for a ticket as soon as the layer is computed.

The compute thread only enqueues (``send_layer`` / ``finish`` never touch the network); one
background thread per sender slices the source blocks and sends, so layer i travels while
layer i+1 computes. The queue is bounded: a sender that cannot keep up blocks the enqueue up to
the ticket's lease, then fails the transfer instead of buffering without limit.

How a layer leaves, best first:
    pulled      the receiver reads the blocks in this cache's shared memory (shm): one copy in all
    in place    the blocks travel from this cache straight into the reserved ones, a piece per run of
                consecutive blocks (equal TP degrees): no copy on either side over torch and tcp, one
                on each side over grpc
    copied      gathered (this shard's heads for each receiver) and sent as a payload; layers queued
                together leave in one chunk of up to 16 MB
A sender that fell behind the forward pass sends the layers queued meanwhile together, in one chunk.
Over a transport that pipelines (shm's pulled chunks, tcp), a layer's chunk leaves without waiting
for the verdict of the one before (over tcp, the one before of the same request): the verdicts are
read as they come, and the "done" waits for every one of them, so a refusal still fails the request
before it could count as DONE.

A transfer's blocks may leave in windows (``start`` names the first, ``next_window`` each next
one, in the ticket's order): a chunked prefill pushes the blocks each part of the prompt completed
while the next part computes, not the whole prompt during its last part. The "done" names every window; the windows
must cover the ticket's blocks by then. ``cancel`` ends a transfer that will not be finished (its
request aborted or preempted mid-prompt) once the items queued before it have left.

Per request:  PENDING ─▶ TRANSFERRING ─▶ DONE (every receiver acknowledged the "done") | FAILED.
The source blocks stay the caller's to hold until ``poll`` says the transfer is terminal.

KVSender composes the parts in ``kv_transfer.sending`` (listed there), one job each.
"""

from __future__ import annotations

import torch

from common.kv_layout import KVCacheLayout
from kv_transfer.device_streams import layer_ready
from kv_transfer.protocol import INTEGRITY_MODES
from kv_transfer.resharding import segments_from
from kv_transfer.sending.book import PushBook, SendStatus
from kv_transfer.sending.channels import Channels
from kv_transfer.sending.chunks import ChunkWriter
from kv_transfer.sending.items import CancelItem, DoneItem, LayerItem, WindowItem
from kv_transfer.sending.push import Push
from kv_transfer.sending.pusher import Pusher
from kv_transfer.sending.worker import SendWorker
from kv_transfer.state import TransferStats
from kv_transfer.ticket import KVTicket
from kv_transfer.transport import KVTransport

__all__ = ["KVSender", "SendStatus"]


class KVSender:
    def __init__(
        self,
        layout: KVCacheLayout,
        model_id: str,
        transport: KVTransport,
        *,
        max_queue: int = 64,
        integrity: str = "crc32",
    ) -> None:
        self.layout = layout
        self.model_id = model_id
        self.transport = transport
        if integrity not in INTEGRITY_MODES:
            raise ValueError(f"integrity={integrity!r}: use one of {', '.join(INTEGRITY_MODES)}")
        self.integrity = integrity  # what each chunk's header carries to check its payload (protocol)
        self._book = PushBook()
        channels = Channels(transport, self._book)
        self._channels = channels.by_endpoint  # the channel to each receiver endpoint, opened on first use
        pusher = Pusher(layout, self._book, channels, ChunkWriter(layout, integrity))
        self._worker = SendWorker(f"kv-sender-{layout.tp_rank}", max_queue, self._book, channels, pusher)

    # --- the compute side (never blocks on the network) ---------------------------------------
    def start(self, ticket: KVTicket, src_block_ids: list[int]) -> None:
        """Begin a transfer with its first window: the source blocks of the ticket's first blocks
        (all of them, or fewer when ``next_window`` adds the rest). Raises TicketError at once if the
        layouts cannot match."""
        ticket.check_sender(self.layout, self.model_id)
        segments = segments_from(
            self.layout.tp_rank, self.layout.tp_size, ticket.layout.tp_size, self.layout.total_kv_heads
        )
        push = Push(
            ticket=ticket,
            stats=TransferStats(ticket.request_id, self.transport.name),
            receivers={seg.receiver_rank for seg in segments},
        )
        push.open_window(src_block_ids)
        self._book.add(push)

    def next_window(self, request_id: str, src_block_ids: list[int]) -> None:
        """Queue the next window: source blocks of the ticket's blocks that follow the last window
        (layers queued after this go out for these blocks)."""
        self._worker.enqueue(WindowItem(request_id, [int(b) for b in src_block_ids]))

    def cancel(self, request_id: str, reason: str) -> None:
        """Fail the transfer once the items queued before this have left: it will not be finished."""
        self._worker.enqueue(CancelItem(request_id, reason))

    def send_layer(self, request_id: str, layer: int, kv_layer: torch.Tensor) -> None:
        """Queue layer ``layer`` (this shard's [2, blocks, block_size, heads, head_dim] tensor), on the
        compute thread right after the layer's KV was written (on CUDA: queued on its stream)."""
        self._worker.enqueue(LayerItem(request_id, layer, kv_layer, layer_ready(kv_layer)))

    def finish(self, request_id: str, first_token_id: int | None) -> None:
        """Queue the completion message after the last layer (carries prefill's first sampled token)."""
        self._worker.enqueue(DoneItem(request_id, first_token_id))

    def poll(self, request_id: str) -> SendStatus:
        return self._book.poll(request_id)

    def stats(self, request_id: str) -> TransferStats | None:
        return self._book.stats(request_id)

    def release(self, request_id: str) -> None:
        self._book.release(request_id)

    def close(self) -> None:
        self._worker.stop()
        for channel in self._channels.values():
            channel.close()
