"""The ways a layer's chunk leaves for one receiver's heads (a head segment), best first.

    pulled      ``send_pulled``: the receiver reads the blocks in this cache's shared memory: one
                copy in all, and one chunk for the layers queued together
    in place    ``send_in_place``: the blocks travel from this cache straight into the reserved
                ones, a piece per run of consecutive blocks (equal TP degrees)
    copied      gathered and sent as a payload: ``send_copied_batch`` for several layers in one
                chunk, ``send_copied_layer`` for one, straight into the transport's staging memory
                when it offers some (``send_whole_layer_staged``)

The pusher chooses among them; each adds the bytes it sent to the push's stats and notes each
chunk whose verdict comes later (``Channels.sent_on``). Called on the sending thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from kv_transfer.block_copy import copy_blocks, stacked_layers
from kv_transfer.protocol import MAX_DIRECT_PIECES, MAX_DIRECT_RUNS, encode_header
from kv_transfer.resharding import HeadSegment
from kv_transfer.sending.channels import Channels
from kv_transfer.sending.chunks import ChunkWriter, block_bytes, payload_view, segment_layer_bytes, time_left
from kv_transfer.sending.items import LayerItem
from kv_transfer.sending.push import Push
from kv_transfer.transport import KVChannel


def send_pulled(
    w: ChunkWriter,
    channels: Channels,
    push: Push,
    layers: list[LayerItem],
    seg: HeadSegment,
    channel: KVChannel,
    sources: Sequence[tuple[int, int] | None],
) -> None:
    """The receiver reads this segment's blocks of ``layers`` straight from the sender's cache
    (at ``sources``, a region and offset per layer): one copy in all, and one chunk for all the layers."""
    ticket = push.ticket
    window = push.window
    kv_layer = layers[0].kv_layer
    nbytes = segment_layer_bytes(push, kv_layer, seg.num_heads)
    entries = []
    for item, source in zip(layers, sources, strict=True):
        assert source is not None, "a pulled chunk names where the receiver reads each layer"
        region, offset = source
        crc = None
        if w.integrity != "none":  # the check covers the bytes as a payload would carry them
            blocks = w.gather_blocks(item.kv_layer, window.gather)
            crc = w.check(ticket, payload_view(w.select_heads(blocks, seg.src_head_offset, seg.num_heads)))
        entries.append((item.layer, region, offset, crc))
    first_layer, region, offset, crc = entries[0]
    header = replace(
        w.layer_header(push, first_layer, seg, nbytes, None),
        checksum=crc,
        src_region=region,
        src_offset=offset,
        src_num_blocks=kv_layer.shape[1],
        src_heads=kv_layer.shape[3],
        src_head_offset=seg.src_head_offset,
        src_block_ids=window.src_block_ids,
        batch=[[layer, region, offset, crc] for layer, region, offset, crc in entries] if len(entries) > 1 else None,
    )
    encoded = encode_header(header, ticket.secret)
    if channel.post(encoded, ticket.request_id, time_left(ticket)):
        channels.posting.add(channel)  # its verdict comes later, through Channels.collect
    else:
        channel.send(encoded, b"", time_left(ticket), ticket.request_id)
        channels.sent_on(channel)
    push.stats.num_bytes += nbytes * len(entries)
    push.stats.in_place_bytes += nbytes * len(entries)


def send_in_place(
    w: ChunkWriter, channels: Channels, push: Push, layers: list[LayerItem], seg: HeadSegment, channel: KVChannel
) -> int:
    """Send layers from the cache itself, a piece per run of consecutive blocks, for the receiver
    to take into its reserved blocks: no copy on either side, and layers queued together in one
    chunk. Only when both sides hold the same heads (equal TP degrees) and the blocks form few
    runs. Returns how many of ``layers`` went (the rest are for the copying path)."""
    ticket = push.ticket
    window = push.window
    runs = window.direct.runs
    first = layers[0].kv_layer
    if (
        not channel.sends_in_place
        or ticket.layout.tp_size != w.layout.tp_size
        or runs is None
        or len(runs) > MAX_DIRECT_RUNS
        or not all(item.kv_layer.is_contiguous() for item in layers)
        or (first.device.type != "cpu" and not channel.sends_device_pieces)
    ):
        return 0
    layer_bytes = segment_layer_bytes(push, first, seg.num_heads)
    if len(layers) > 1 and layer_bytes // (2 * len(runs)) < channel.in_place_min_piece_bytes:
        return 0
    if layer_bytes != 2 * len(window.src_block_ids) * block_bytes(ticket.layout):
        # The receiver sizes its receives from its own layout: a piece of another size would
        # abort its process inside gloo. The copying path checks sizes before writing.
        return 0
    per_chunk = max(1, MAX_DIRECT_PIECES // (2 * len(runs)))
    one_block = layer_bytes // (2 * len(window.src_block_ids))
    half = first.numel() * first.element_size() // 2  # a layer's bytes: [K blocks | V blocks]
    spans = [(part * half + src * one_block, length * one_block) for part in (0, 1) for src, _, length in runs]
    for start in range(0, len(layers), per_chunk):
        group = layers[start : start + per_chunk]
        entries: list[list[int | bytes | None]] = []
        for item in group:
            # Over the bytes in payload order, as the receiver checks them.
            crc = w.spans_check(ticket, item.kv_layer, spans) if w.integrity != "none" else None
            entries.append([item.layer, -1, 0, crc])
        header = replace(
            w.layer_header(push, group[0].layer, seg, layer_bytes, None),
            checksum=entries[0][3],
            run_lengths=[length for _, _, length in runs],
            batch=entries if len(entries) > 1 else None,
        )
        encoded = encode_header(header, ticket.secret)
        sources = [item.kv_layer for item in group]
        if not channel.send_spans(encoded, sources, spans, time_left(ticket), ticket.request_id):
            return start  # declined: this receiver takes copies only
        channels.sent_on(channel)
        push.stats.num_bytes += layer_bytes * len(group)
        push.stats.in_place_bytes += layer_bytes * len(group)
        for _ in group:
            push.layer_sent()
    return len(layers)


def send_copied_batch(
    w: ChunkWriter, channels: Channels, push: Push, group: list[LayerItem], seg: HeadSegment, channel: KVChannel
) -> None:
    """Several layers' blocks of one segment gathered back to back (into the transport's staging
    memory when it offers some) and sent as one chunk: one call and one verdict for all."""
    ticket = push.ticket
    window = push.window
    first = group[0].kv_layer
    shape = (2, len(window.src_block_ids), first.shape[2], seg.num_heads, first.shape[4])
    layer_bytes = segment_layer_bytes(push, first, seg.num_heads)
    total = layer_bytes * len(group)
    staging = channel.staging(total) if first.device.type == "cpu" else None
    flat = staging[:total] if staging is not None else w.scratch_tensor("batch", (total,), torch.uint8, first.device)
    stacked = flat.view(first.dtype).view(len(group), *shape)
    source = stacked_layers([item.kv_layer for item in group])
    if source is not None and all(item.layer == group[0].layer + i for i, item in enumerate(group)):
        # Consecutive layers of one allocation (as an engine's cache is): one copy per block run.
        copy_blocks(stacked, source.narrow(4, seg.src_head_offset, seg.num_heads), window.gather, dim=2)
    else:
        for i, item in enumerate(group):
            copy_blocks(stacked[i], item.kv_layer.narrow(3, seg.src_head_offset, seg.num_heads), window.gather)
    checked = w.integrity != "none"  # (a GPU layer comes to the host only to be hashed)
    entries: list[list[int | bytes | None]] = [
        [item.layer, -1, 0, w.check(ticket, payload_view(w.host.to_host(stacked[i], "check"))) if checked else None]
        for i, item in enumerate(group)
    ]
    header = replace(
        w.layer_header(push, group[0].layer, seg, layer_bytes, None), checksum=entries[0][3], batch=entries
    )
    encoded = encode_header(header, ticket.secret)
    if staging is not None:
        channel.send_staged(encoded, total, time_left(ticket), ticket.request_id)
    else:
        channel.send(encoded, payload_view(w.host.to_host(stacked)), time_left(ticket), ticket.request_id)
    channels.sent_on(channel)
    push.stats.num_bytes += total


def send_copied_layer(
    w: ChunkWriter,
    channels: Channels,
    push: Push,
    item: LayerItem,
    copied: list[tuple[HeadSegment, KVChannel]],
    whole: bool,
) -> None:
    """One layer to every segment's receiver: gathered once, each segment's heads sent as a payload
    (``whole``: this shard sends to one receiver only, which may take the layer staged)."""
    ticket = push.ticket
    blocks: torch.Tensor | None = None  # this layer's blocks gathered, once, if some segment needs them
    for seg, channel in copied:
        if whole and send_whole_layer_staged(w, channels, push, item, seg, channel):
            continue
        if blocks is None:
            blocks = w.gather_blocks(item.kv_layer, push.window.gather)
        body = payload_view(w.select_heads(blocks, seg.src_head_offset, seg.num_heads))
        header = w.layer_header(push, item.layer, seg, len(body), body)
        channel.send(encode_header(header, ticket.secret), body, time_left(ticket), ticket.request_id)
        channels.sent_on(channel)
        push.stats.num_bytes += len(body)
    push.layer_sent()


def send_whole_layer_staged(
    w: ChunkWriter, channels: Channels, push: Push, item: LayerItem, seg: HeadSegment, channel: KVChannel
) -> bool:
    """Gather the blocks straight into the transport's staging memory (one copy fewer), when
    the transport offers it and one receiver takes all of this shard's heads."""
    kv_layer = item.kv_layer
    if seg.num_heads != kv_layer.shape[3] or kv_layer.device.type != "cpu":
        return False
    ticket = push.ticket
    shape = (2, len(push.window.src_block_ids), *kv_layer.shape[2:])
    nbytes = torch.Size(shape).numel() * kv_layer.element_size()
    staging = channel.staging(nbytes)
    if staging is None:
        return False
    copy_blocks(staging.view(kv_layer.dtype).view(shape), kv_layer, push.window.gather)
    header = w.layer_header(push, item.layer, seg, nbytes, memoryview(staging.numpy()))
    channel.send_staged(encode_header(header, ticket.secret), nbytes, time_left(ticket), ticket.request_id)
    channels.sent_on(channel)
    push.stats.num_bytes += nbytes
    return True
