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
                together leave in one message of up to 16 MB
A sender that fell behind the forward pass sends the layers queued meanwhile together, in one chunk.
Over a transport that pipelines (shm's pulled chunks, tcp), a layer's chunk leaves without waiting
for the verdict of the one before (over tcp, the one before of the same request): the verdicts are
read as they come, and the "done" waits for every one of them, so a refusal still fails the request
before it could count as DONE.

A transfer's blocks may leave in windows (``start`` names the first, ``next_window`` each next
one, in the ticket's order): a prefill pushes each chunk's completed blocks while the next chunk
computes, not the whole prompt during its last chunk. The "done" names every window; the windows
must cover the ticket's blocks by then. ``cancel`` ends a transfer that will not be finished (its
request aborted or preempted mid-prompt) once the items queued before it have left.

Per request:  PENDING ─▶ TRANSFERRING ─▶ DONE (every receiver acknowledged the "done") | FAILED.
The source blocks stay the caller's to hold until ``poll`` says the transfer is terminal.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace

import torch

from common.kv_layout import KVCacheLayout
from common.openmp import run_tensor_ops_serially
from kv_transfer.block_copy import BlockCopyPlan, copy_blocks, gather_plan, plan_block_copy, stacked_layers
from kv_transfer.protocol import (
    INTEGRITY_MODES,
    MAX_DIRECT_PIECES,
    MAX_DIRECT_RUNS,
    ChunkHeader,
    encode_header,
    payload_check,
)
from kv_transfer.resharding import segments_from
from kv_transfer.state import TransferState, TransferStats
from kv_transfer.ticket import KVTicket
from kv_transfer.transport import KVChannel, KVTransport

logger = logging.getLogger(__name__)

_MAX_ENQUEUE_WAIT_S = 5.0
_MAX_LAYERS_PER_CHUNK = 64  # layers one pulled chunk may name
# A copied batch is written under the receiver's lock: bound it as a pulled batch's copy is bounded.
_MAX_COPIED_BATCH_BYTES = 16 << 20
_SETTLE_EVERY_S = 0.005  # how often an idle sender reads the verdicts of chunks it posted
_NOTHING = object()


@dataclass
class _Outgoing:
    ticket: KVTicket
    # The window being sent: its source blocks, their gather plan, and their plan into the reserved
    # ones (whose runs split a payload sent in place).
    src_block_ids: list[int] = field(default_factory=list)
    gather: BlockCopyPlan = field(default_factory=lambda: gather_plan([]))
    direct: BlockCopyPlan = field(default_factory=lambda: plan_block_copy([], []))
    block_offset: int = 0  # the window's first block among the ticket's
    windows: list[list[int]] = field(default_factory=list)  # [block_offset, num_blocks] of each window
    state: TransferState = TransferState.PENDING
    reason: str | None = None
    stats: TransferStats | None = None
    layers_sent: int = 0
    receivers: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class SendStatus:
    state: TransferState
    reason: str | None
    layers_sent: int


def _block_bytes(layout: KVCacheLayout) -> int:
    """One block of one of K or V in a shard of this layout."""
    return layout.block_size * layout.num_kv_heads * layout.head_dim * getattr(torch, layout.dtype).itemsize


def _payload(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes without a copy (bf16 has no numpy dtype: view as bytes)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


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
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._outgoing: dict[str, _Outgoing] = {}
        self._channels: dict[str, KVChannel] = {}
        self._scratch: dict[str, torch.Tensor] = {}  # used by the sending thread only
        self._posting: set[KVChannel] = set()  # channels with posted chunks' verdicts outstanding
        self._current: str | None = None  # the request the sending thread is working on
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"kv-sender-{layout.tp_rank}", daemon=True)
        self._thread.start()

    # --- the compute side (never blocks on the network) ---------------------------------------
    def start(self, ticket: KVTicket, src_block_ids: list[int]) -> None:
        """Begin a transfer with its first window: the source blocks of the ticket's first blocks
        (all of them, or fewer when ``next_window`` adds the rest). Raises TicketError at once if the
        layouts cannot match."""
        ticket.check_sender(self.layout, self.model_id)
        segments = segments_from(
            self.layout.tp_rank, self.layout.tp_size, ticket.layout.tp_size, self.layout.total_kv_heads
        )
        out = _Outgoing(
            ticket=ticket,
            stats=TransferStats(ticket.request_id, self.transport.name),
            receivers={seg.receiver_rank for seg in segments},
        )
        _open_window(out, src_block_ids)
        with self._lock:
            self._outgoing[ticket.request_id] = out

    def next_window(self, request_id: str, src_block_ids: list[int]) -> None:
        """Queue the next window: source blocks of the ticket's blocks that follow the last window
        (layers queued after this go out for these blocks)."""
        self._enqueue(request_id, ("window", request_id, [int(b) for b in src_block_ids], None))

    def cancel(self, request_id: str, reason: str) -> None:
        """Fail the transfer once the items queued before this have left: it will not be finished."""
        self._enqueue(request_id, ("cancel", request_id, reason, None))

    def send_layer(self, request_id: str, layer: int, kv_layer: torch.Tensor) -> None:
        """Queue layer ``layer`` (this shard's [2, blocks, block_size, heads, head_dim] tensor)."""
        self._enqueue(request_id, ("layer", request_id, layer, kv_layer))

    def finish(self, request_id: str, first_token_id: int | None) -> None:
        """Queue the completion message after the last layer (carries prefill's first sampled token)."""
        self._enqueue(request_id, ("done", request_id, first_token_id, None))

    def poll(self, request_id: str) -> SendStatus:
        with self._lock:
            out = self._outgoing.get(request_id)
            if out is None:
                return SendStatus(TransferState.FAILED, "no such transfer", 0)
            # While the sending thread works on this request it may still read the source blocks:
            # it ends the transfer itself (its send deadline is the lease), so the blocks stay held.
            if not out.state.is_terminal and out.ticket.is_expired() and self._current != request_id:
                self._fail(out, "lease expired before the receiver acknowledged")
            return SendStatus(out.state, out.reason, out.layers_sent)

    def stats(self, request_id: str) -> TransferStats | None:
        out = self._outgoing.get(request_id)
        return out.stats if out else None

    def release(self, request_id: str) -> None:
        with self._lock:
            self._outgoing.pop(request_id, None)

    def close(self) -> None:
        self._stopping = True
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)  # wakes an idle thread; a busy one sees _stopping
        self._thread.join(timeout=10)
        for channel in self._channels.values():
            channel.close()

    # --- the sending thread ---------------------------------------------------------------
    def _enqueue(self, request_id: str, item: tuple) -> None:
        out = self._outgoing.get(request_id)
        if out is None or out.state.is_terminal:
            return
        # Called from the forward pass: wait a little for room, never for a whole lease.
        timeout = min(_MAX_ENQUEUE_WAIT_S, max(0.0, out.ticket.lease_deadline - time.time()))
        try:
            self._queue.put(item, timeout=timeout)
        except queue.Full:
            with self._lock:
                self._fail(out, f"send queue still full after {timeout:.1f} s")

    def _run(self) -> None:
        run_tensor_ops_serially()  # the engine thread owns the process's OpenMP team
        held = _NOTHING  # an item taken off the queue while gathering a batch, handled next
        while not self._stopping:
            if held is _NOTHING:
                try:
                    # Verdicts outstanding: read them as they come, without holding up the next layer.
                    item = self._queue.get(timeout=_SETTLE_EVERY_S if self._posting else None)
                except queue.Empty:
                    self._collect(wait=False)
                    continue
            else:
                item, held = held, _NOTHING
            if item is None:
                return
            kind, request_id, arg, kv_layer = item
            layers = [(arg, kv_layer)]
            while kind == "layer" and len(layers) < _MAX_LAYERS_PER_CHUNK:
                # Layers of this request already waiting (the sender fell behind the forward pass)
                # leave together: one message, one verdict and one signature instead of one each.
                try:
                    held = self._queue.get_nowait()
                except queue.Empty:
                    break
                if held is None or held[0] != "layer" or held[1] != request_id:
                    break
                layers.append((held[2], held[3]))
                held = _NOTHING
            with self._lock:
                out = self._outgoing.get(request_id)
                if out is None or out.state.is_terminal:
                    continue
                self._current = request_id
            try:
                if kind == "layer":
                    self._send_layers(out, layers)
                elif kind == "window":
                    with self._lock:
                        if not _open_window(out, arg):
                            self._fail(out, f"window {arg[:4]}... names no block left of the ticket's")
                elif kind == "cancel":
                    with self._lock:
                        self._fail(out, arg)
                else:
                    self._send_done(out, arg)
            except Exception as exc:  # any transport failure ends this request, never the thread
                logger.warning("KV transfer of %s failed: %s", request_id, exc)
                if self._posting:
                    self._collect(wait=False)  # an earlier refusal is the root cause: it names it first
                with self._lock:
                    self._fail(out, f"{type(exc).__name__}: {exc}")
            finally:
                with self._lock:
                    self._current = None
            if self._posting:
                self._collect(wait=False)

    def _collect(self, wait: bool) -> None:
        """Fail the requests whose posted chunks the receiver refused (or never answered)."""
        timeout = 0.0
        if wait:
            with self._lock:
                deadlines = [o.ticket.lease_deadline for o in self._outgoing.values() if not o.state.is_terminal]
            timeout = max(0.05, max(deadlines, default=time.time()) - time.time())
        for channel in list(self._posting):
            for request_id, error in channel.collect(wait, timeout):
                logger.warning("KV transfer of %s failed: %s", request_id, error)
                with self._lock:
                    out = self._outgoing.get(request_id)
                    if out is not None:
                        self._fail(out, f"{type(error).__name__}: {error}")
            if not channel.num_posted:
                self._posting.discard(channel)

    def _send_layers(self, out: _Outgoing, layers: list[tuple[int, torch.Tensor]]) -> None:
        ticket = out.ticket
        layout = self.layout
        stats = out.stats
        assert stats is not None
        if stats.start_time is None:
            stats.start_time = time.monotonic()
            with self._lock:
                if out.state.is_terminal:
                    return
                out.state = TransferState.TRANSFERRING
        segments = segments_from(layout.tp_rank, layout.tp_size, ticket.layout.tp_size, layout.total_kv_heads)
        copied = []
        for seg in segments:
            channel = self._channel(ticket, seg.receiver_rank)
            sources = channel.pull_sources([kv for _, kv in layers])
            if all(source is not None for source in sources):
                self._send_pulled(out, layers, seg, channel, sources)
            else:
                copied.append((seg, channel))
        done = self._send_in_place(out, layers, *copied[0]) if len(copied) == len(segments) == 1 else 0
        rest = layers[done:]
        if not copied:  # every segment pulled its layers
            for _ in rest:
                self._layer_sent(out)
        while rest and copied:
            # Layers queued together leave in one message per segment, up to _MAX_COPIED_BATCH_BYTES.
            widest = max(seg.num_heads for seg, _ in copied)
            batch = max(1, _MAX_COPIED_BATCH_BYTES // max(1, self._segment_layer_bytes(out, rest[0][1], widest)))
            group, rest = rest[:batch], rest[batch:]
            if len(group) > 1:
                for seg, channel in copied:
                    self._send_copied_batch(out, group, seg, channel)
                for _ in group:
                    self._layer_sent(out)
            else:
                self._send_copied_layer(out, *group[0], copied, len(segments) == 1)

    def _send_copied_layer(self, out: _Outgoing, layer: int, kv_layer: torch.Tensor, copied, whole: bool) -> None:
        """One layer to every segment's receiver: gathered once, each segment's heads sent as a payload."""
        ticket = out.ticket
        assert out.stats is not None
        blocks: torch.Tensor | None = None  # this layer's blocks gathered, once, if some segment needs them
        for seg, channel in copied:
            if whole and self._send_whole_layer_staged(out, layer, kv_layer, seg, channel):
                continue
            if blocks is None:
                blocks = self._gather_blocks(kv_layer, out.gather)
            payload = _payload(self._select_heads(blocks, seg.src_head_offset, seg.num_heads))
            header = self._layer_header(out, layer, seg, len(payload), payload)
            channel.send(encode_header(header, ticket.secret), payload, self._time_left(ticket), ticket.request_id)
            self._sent_on(channel)
            out.stats.num_bytes += len(payload)
        self._layer_sent(out)

    @staticmethod
    def _segment_layer_bytes(out: _Outgoing, kv_layer: torch.Tensor, num_heads: int) -> int:
        return 2 * len(out.src_block_ids) * kv_layer.shape[2] * num_heads * kv_layer.shape[4] * kv_layer.element_size()

    def _send_copied_batch(self, out: _Outgoing, group: list[tuple[int, torch.Tensor]], seg, channel) -> None:
        """Several layers' blocks of one segment gathered back to back (into the transport's staging
        memory when it offers some) and sent as one message: one call and one verdict for all."""
        ticket = out.ticket
        first = group[0][1]
        shape = (2, len(out.src_block_ids), first.shape[2], seg.num_heads, first.shape[4])
        layer_bytes = self._segment_layer_bytes(out, first, seg.num_heads)
        total = layer_bytes * len(group)
        staging = channel.staging(total) if first.device.type == "cpu" else None
        flat = (
            staging[:total]
            if staging is not None
            else self._scratch_tensor("batch", (total,), torch.uint8, first.device)
        )
        stacked = flat.view(first.dtype).view(len(group), *shape)
        source = stacked_layers([kv for _, kv in group])
        if source is not None and all(layer == group[0][0] + i for i, (layer, _) in enumerate(group)):
            # Consecutive layers of one allocation (as an engine's cache is): one copy per block run.
            copy_blocks(stacked, source.narrow(4, seg.src_head_offset, seg.num_heads), out.gather, dim=2)
        else:
            for i, (_, kv) in enumerate(group):
                copy_blocks(stacked[i], kv.narrow(3, seg.src_head_offset, seg.num_heads), out.gather)
        checked = self.integrity != "none"  # (a GPU layer comes to the host only to be hashed)
        entries: list[list[int | bytes | None]] = [
            [layer, -1, 0, self._check(ticket, _payload(stacked[i].cpu())) if checked else None]
            for i, (layer, _) in enumerate(group)
        ]
        header = replace(
            self._layer_header(out, group[0][0], seg, layer_bytes, None), checksum=entries[0][3], batch=entries
        )
        encoded = encode_header(header, ticket.secret)
        if staging is not None:
            channel.send_staged(encoded, total, self._time_left(ticket), ticket.request_id)
        else:
            channel.send(encoded, _payload(stacked.cpu()), self._time_left(ticket), ticket.request_id)
        self._sent_on(channel)
        assert out.stats is not None
        out.stats.num_bytes += total

    def _send_pulled(self, out: _Outgoing, layers, seg, channel, sources) -> None:
        """The receiver reads this segment's blocks of ``layers`` straight from the sender's cache:
        one copy in all, and one message for all the layers."""
        ticket = out.ticket
        kv_layer = layers[0][1]
        nbytes = 2 * len(out.src_block_ids) * kv_layer.shape[2] * seg.num_heads * kv_layer.shape[4]
        nbytes *= kv_layer.element_size()
        entries = []
        for (layer, kv), (region, offset) in zip(layers, sources, strict=True):
            crc = None
            if self.integrity != "none":  # the check covers the bytes as a payload would carry them
                blocks = self._gather_blocks(kv, out.gather)
                crc = self._check(ticket, _payload(self._select_heads(blocks, seg.src_head_offset, seg.num_heads)))
            entries.append((layer, region, offset, crc))
        first_layer, region, offset, crc = entries[0]
        header = replace(
            self._layer_header(out, first_layer, seg, nbytes, None),
            checksum=crc,
            src_region=region,
            src_offset=offset,
            src_num_blocks=kv_layer.shape[1],
            src_heads=kv_layer.shape[3],
            src_head_offset=seg.src_head_offset,
            src_block_ids=out.src_block_ids,
            batch=[[layer, region, offset, crc] for layer, region, offset, crc in entries]
            if len(entries) > 1
            else None,
        )
        encoded = encode_header(header, ticket.secret)
        if channel.post(encoded, ticket.request_id, self._time_left(ticket)):
            self._posting.add(channel)  # its verdict comes later, through _collect
        else:
            channel.send(encoded, b"", self._time_left(ticket), ticket.request_id)
            self._sent_on(channel)
        assert out.stats is not None
        out.stats.num_bytes += nbytes * len(entries)
        out.stats.in_place_bytes += nbytes * len(entries)

    @staticmethod
    def _layer_sent(out: _Outgoing) -> None:
        out.layers_sent += 1
        assert out.stats is not None
        if out.stats.first_layer_time is None:
            out.stats.first_layer_time = time.monotonic()

    def _send_in_place(self, out: _Outgoing, layers: list[tuple[int, torch.Tensor]], seg, channel) -> int:
        """Send layers from the cache itself, a piece per run of consecutive blocks, for the receiver
        to take into its reserved blocks: no copy on either side, and layers queued together in one
        chunk. Only when both sides hold the same heads (equal TP degrees) and the blocks form few
        runs. Returns how many of ``layers`` went (the rest are for the copying path)."""
        ticket = out.ticket
        runs = out.direct.runs
        if (
            not channel.sends_in_place
            or ticket.layout.tp_size != self.layout.tp_size
            or runs is None
            or len(runs) > MAX_DIRECT_RUNS
            or not all(kv.is_contiguous() for _, kv in layers)
            or (layers[0][1].device.type != "cpu" and not channel.sends_device_pieces)
        ):
            return 0
        layer_bytes = self._segment_layer_bytes(out, layers[0][1], seg.num_heads)
        if len(layers) > 1 and layer_bytes // (2 * len(runs)) < channel.in_place_min_piece_bytes:
            return 0
        if layer_bytes != 2 * len(out.src_block_ids) * _block_bytes(ticket.layout):
            # The receiver sizes its receives from its own layout: a piece of another size would
            # abort its process inside gloo. The copying path checks sizes before writing.
            return 0
        per_chunk = max(1, MAX_DIRECT_PIECES // (2 * len(runs)))
        block_bytes = layer_bytes // (2 * len(out.src_block_ids))
        half = layers[0][1].numel() * layers[0][1].element_size() // 2  # a layer's bytes: [K blocks | V blocks]
        spans = [(part * half + src * block_bytes, length * block_bytes) for part in (0, 1) for src, _, length in runs]
        for start in range(0, len(layers), per_chunk):
            group = layers[start : start + per_chunk]
            entries = []
            for layer, kv in group:
                # Over the bytes in payload order, as the receiver checks them.
                crc = self._spans_check(ticket, kv, spans) if self.integrity != "none" else None
                entries.append([layer, -1, 0, crc])
            header = replace(
                self._layer_header(out, group[0][0], seg, layer_bytes, None),
                checksum=entries[0][3],
                run_lengths=[length for _, _, length in runs],
                batch=entries if len(entries) > 1 else None,
            )
            encoded = encode_header(header, ticket.secret)
            sources = [kv for _, kv in group]
            if not channel.send_spans(encoded, sources, spans, self._time_left(ticket), ticket.request_id):
                return start  # declined: this receiver takes copies only
            self._sent_on(channel)
            assert out.stats is not None
            out.stats.num_bytes += layer_bytes * len(group)
            out.stats.in_place_bytes += layer_bytes * len(group)
            for _ in group:
                self._layer_sent(out)
        return len(layers)

    def _send_whole_layer_staged(self, out: _Outgoing, layer: int, kv_layer: torch.Tensor, seg, channel) -> bool:
        """Gather the blocks straight into the transport's staging memory (one copy fewer), when
        the transport offers it and one receiver takes all of this shard's heads."""
        if seg.num_heads != kv_layer.shape[3] or kv_layer.device.type != "cpu":
            return False
        ticket = out.ticket
        shape = (2, len(out.src_block_ids), *kv_layer.shape[2:])
        nbytes = torch.Size(shape).numel() * kv_layer.element_size()
        staging = channel.staging(nbytes)
        if staging is None:
            return False
        copy_blocks(staging.view(kv_layer.dtype).view(shape), kv_layer, out.gather)
        header = self._layer_header(out, layer, seg, nbytes, memoryview(staging.numpy()))
        channel.send_staged(encode_header(header, ticket.secret), nbytes, self._time_left(ticket), ticket.request_id)
        self._sent_on(channel)
        assert out.stats is not None
        out.stats.num_bytes += nbytes
        return True

    def _check(self, ticket: KVTicket, *parts: memoryview) -> int | bytes | None:
        return payload_check(self.integrity, ticket.secret, *parts)

    def _spans_check(self, ticket: KVTicket, kv: torch.Tensor, spans: list[tuple[int, int]]) -> int | bytes | None:
        if kv.device.type == "cpu":
            flat = _payload(kv)
            return self._check(ticket, *(flat[offset : offset + length] for offset, length in spans))
        flat_gpu = kv.view(-1).view(torch.uint8)  # only the pieces come to the host, not the whole layer
        return self._check(ticket, *(_payload(flat_gpu.narrow(0, offset, length).cpu()) for offset, length in spans))

    def _sent_on(self, channel: KVChannel) -> None:
        """A layer chunk left under its request's tag: a pipelining channel reports its verdict later."""
        if channel.pipelines:
            self._posting.add(channel)

    def _gather_blocks(self, kv_layer: torch.Tensor, plan: BlockCopyPlan) -> torch.Tensor:
        """The ticket's source blocks of one layer, contiguous, in reused scratch memory.

        Reuse matters: a fresh multi-MB tensor per layer costs page faults that run at ~1.5 GB/s
        here, while a gather into memory already touched runs at ~10 GB/s. The scratch is safe to
        reuse because a chunk's send returns only once its memory may be reused (the receiver
        consumed it, or, for a pipelined chunk, the kernel holds a copy).
        """
        full = self._scratch_tensor(
            "blocks", (2, plan.num_blocks, *kv_layer.shape[2:]), kv_layer.dtype, kv_layer.device
        )
        copy_blocks(full, kv_layer, plan)
        return full

    def _select_heads(self, blocks: torch.Tensor, head_offset: int, num_heads: int) -> torch.Tensor:
        if num_heads != blocks.shape[3]:
            part = self._scratch_tensor(
                "heads", (*blocks.shape[:3], num_heads, blocks.shape[4]), blocks.dtype, blocks.device
            )
            part.copy_(blocks[:, :, :, head_offset : head_offset + num_heads])
            blocks = part
        return blocks.cpu()

    def _scratch_tensor(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * dtype.itemsize
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._scratch[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype).view(shape)

    def _layer_header(self, out: _Outgoing, layer: int, seg, nbytes: int, payload: memoryview | None) -> ChunkHeader:
        ticket = out.ticket
        return ChunkHeader(
            kind="layer",
            request_id=ticket.request_id,
            sender_rank=self.layout.tp_rank,
            sender_tp=self.layout.tp_size,
            receiver_rank=seg.receiver_rank,
            layer=layer,
            dst_head_offset=seg.dst_head_offset,
            num_heads=seg.num_heads,
            block_offset=out.block_offset,
            num_blocks=len(out.src_block_ids),
            nbytes=nbytes,
            checksum=self._check(ticket, payload) if payload is not None else None,
        )

    def _send_done(self, out: _Outgoing, first_token_id: int | None) -> None:
        ticket = out.ticket
        sent = sum(n for _, n in out.windows)
        if sent != ticket.num_blocks:
            raise ValueError(f"finished with {sent} of the ticket's {ticket.num_blocks} blocks sent")
        for receiver in sorted(out.receivers):
            header = ChunkHeader(
                kind="done",
                request_id=ticket.request_id,
                sender_rank=self.layout.tp_rank,
                sender_tp=self.layout.tp_size,
                receiver_rank=receiver,
                first_token_id=first_token_id,
                num_layers_sent=out.layers_sent,
                windows=out.windows,
            )
            self._channel(ticket, receiver).send(encode_header(header, ticket.secret), b"", self._time_left(ticket))
        if self._posting:
            self._collect(wait=False)  # the sends above settled this request's posted chunks
        with self._lock:
            if not out.state.is_terminal:
                out.state = TransferState.DONE
                assert out.stats is not None
                out.stats.end_time = time.monotonic()
                out.stats.num_layers = out.layers_sent // max(1, len(out.windows))
                out.stats.num_windows = len(out.windows)

    def _channel(self, ticket: KVTicket, receiver_rank: int) -> KVChannel:
        endpoint = ticket.receiver_endpoints[receiver_rank]
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = self.transport.connect(endpoint)
        return channel

    @staticmethod
    def _time_left(ticket: KVTicket) -> float:
        left = ticket.lease_deadline - time.time()
        if left <= 0:
            raise TimeoutError("lease expired")
        return left

    def _fail(self, out: _Outgoing, reason: str) -> None:
        if not out.state.is_terminal:
            out.state = TransferState.FAILED
            out.reason = reason
            if out.stats is not None:
                out.stats.end_time = time.monotonic()


def _open_window(out: _Outgoing, src_block_ids: list[int]) -> bool:
    """Make ``src_block_ids`` (cut to the ticket's blocks left) the window being sent; False if
    none is left."""
    ticket = out.ticket
    offset = sum(n for _, n in out.windows)
    block_ids = [int(b) for b in src_block_ids[: ticket.num_blocks - offset]]
    if not block_ids:
        return False
    out.src_block_ids = block_ids
    out.block_offset = offset
    out.gather = gather_plan(block_ids)
    out.direct = plan_block_copy(block_ids, list(ticket.block_ids[offset : offset + len(block_ids)]))
    out.windows.append([offset, len(block_ids)])
    return True
