"""Checking a chunk before anything lands: its header authenticated under its ticket's secret, its
place in the transfer plan, its window among the ticket's blocks.

A chunk with a bad signature is refused and counted, but does not fail the transfer: an
unauthenticated party must not be able to cancel someone else's request. Every refusal is counted
by kind (``refusals``, for metrics) and raised as TransferRefused.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import fields
from typing import NoReturn

from common.kv_layout import KVCacheLayout
from kv_transfer.block_copy import scatter_plan
from kv_transfer.errors import TransferRefused
from kv_transfer.protocol import (
    ChunkHeader,
    ProtocolError,
    at_least,
    decode_header,
    integrity_of,
    peek_request_id,
)
from kv_transfer.receiving.tickets import TicketBook
from kv_transfer.receiving.transfer import ChunkKey, IncomingTransfer, ReservedWindow

_HEADER_FIELDS = tuple(f.name for f in fields(ChunkHeader))


class ChunkChecks:
    def __init__(self, tickets: TicketBook, layout: KVCacheLayout, require_integrity: str, refusals: Counter) -> None:
        self.tickets = tickets
        self.layout = layout
        self.require_integrity = require_integrity  # the weakest payload check a chunk may carry
        self.refusals = refusals  # reason -> count

    def refuse(self, kind: str, message: str) -> NoReturn:
        self.refusals[kind] += 1
        raise TransferRefused(message, kind)

    def checksum_failed(self, incoming: IncomingTransfer, header: ChunkHeader) -> NoReturn:
        incoming.fail(f"checksum mismatch in layer {header.layer}")
        self.refuse("checksum", f"checksum mismatch in layer {header.layer}")

    def authenticate(self, raw_header: bytes) -> tuple[IncomingTransfer, ChunkHeader]:
        """The chunk's transfer and verified header, for a live ticket addressed to this shard."""
        try:
            request_id = peek_request_id(raw_header)
        except ProtocolError as exc:
            self.refuse("malformed", str(exc))
        incoming = self.tickets.incoming.get(request_id)
        if incoming is None:
            secret = self.tickets.released_secret(request_id)
            if secret is None:
                self.refuse("unknown_ticket", f"no ticket for request {request_id!r} here")
            try:
                decode_header(raw_header, secret)
            except ProtocolError as exc:
                self.refuse("bad_signature", str(exc))
            self.refuse("released", f"transfer of {request_id} was released here")
        try:
            header = decode_header(raw_header, incoming.ticket.secret)
        except ProtocolError as exc:
            self.refuse("bad_signature", str(exc))
        if incoming.state.is_terminal:
            self.refuse("terminal", f"transfer of {request_id} already {incoming.state.name}")
        if incoming.expire_if_due():
            self.refuse("lease_expired", "the ticket's lease has expired")
        if header.receiver_rank != self.layout.tp_rank:
            self.refuse("wrong_shard", f"chunk for shard {header.receiver_rank} reached {self.layout.tp_rank}")
        return incoming, header

    def payload_fits(self, raw_header: bytes, nbytes: int) -> None:
        """Refuse a chunk whose header is not authentic, or whose payload of ``nbytes`` is larger
        than its ticket's blocks of every layer could hold."""
        incoming, _ = self.authenticate(raw_header)
        most = self.layout.num_layers * self.layer_bytes_of(incoming.ticket.num_blocks)
        if nbytes > most:
            self.refuse("shape", f"a payload of {nbytes} bytes; this ticket's blocks hold {most}")

    def layer_bytes_of(self, num_blocks: int) -> int:
        """K and V of one layer of every head of this shard, for ``num_blocks`` blocks."""
        return num_blocks * self.layout.bytes_per_block_per_layer

    def layers_of(self, header: ChunkHeader, payload_batch: bool = False) -> list[ChunkHeader]:
        """A chunk's layers, one header each: the chunk itself, or each entry of a batch (pulled, or
        with ``payload_batch`` carried by the payload, region -1, layer after layer)."""
        if header.batch is None:
            return [header]
        batch = header.batch
        if (
            header.pulled == payload_batch
            or not isinstance(batch, list)
            or not 0 < len(batch) <= self.layout.num_layers
            or (payload_batch and any(isinstance(e, list) and len(e) == 4 and e[1] != -1 for e in batch))
        ):
            self.refuse("malformed", f"a batch of {len(batch) if isinstance(batch, list) else '?'} layers")
        entries = []
        for entry in batch:
            if not (
                type(entry) is list
                and len(entry) == 4
                and type(entry[0]) is int
                and type(entry[1]) is int
                and type(entry[2]) is int
                and (entry[3] is None or type(entry[3]) in (int, bytes))
            ):
                self.refuse("malformed", f"batch entry {entry!r} is not [layer, region, offset, checksum]")
        # One constructor call per layer, not dataclasses.replace (~4x slower: it reads every field
        # anew), for chunks that name up to a model's every layer.
        shared = {name: getattr(header, name) for name in _HEADER_FIELDS}
        shared["batch"] = None
        for layer, region, offset, crc in batch:
            shared.update(layer=layer, src_region=region, src_offset=offset, checksum=crc)
            entries.append(ChunkHeader(**shared))
        return entries

    def check_chunk(self, incoming: IncomingTransfer, header: ChunkHeader) -> ChunkKey:
        """The chunk's key in the transfer plan, once it is known to be expected, new and well shaped."""
        # The plan covers this shard's layers only.
        key = ChunkKey(header.sender_rank, header.layer, header.dst_head_offset, header.block_offset, header.num_blocks)
        if key[:3] not in incoming.expected:
            self.refuse("unplanned", f"chunk {tuple(key)} is not part of the transfer plan")
        self.window(incoming, header)
        if key in incoming.landed:
            self.refuse("duplicate", f"chunk {tuple(key)} already landed")
        if key in incoming.writing:
            self.refuse("duplicate", f"chunk {tuple(key)} is already being received")
        if header.num_heads != incoming.segment_heads[(header.sender_rank, header.dst_head_offset)]:
            self.refuse("shape", f"chunk {tuple(key)} carries {header.num_heads} heads, not the planned number")
        if not at_least(header.checksum, self.require_integrity):
            # A sender configured apart from this receiver: no later chunk of it will do better.
            reason = f"a {integrity_of(header.checksum)} payload check; this receiver requires {self.require_integrity}"
            incoming.fail(reason)
            self.refuse("integrity", f"chunk {tuple(key)} carries {reason}")
        return key

    def check_batch(self, incoming: IncomingTransfer, layers: list[ChunkHeader]) -> list[ChunkKey]:
        """``check_chunk`` of each layer of a batch, which must not name one layer twice."""
        keys = [self.check_chunk(incoming, header) for header in layers]
        if len(set(keys)) != len(keys):
            self.refuse("duplicate", f"a batch names one layer twice: {[tuple(key) for key in keys]}")
        return keys

    def window(self, incoming: IncomingTransfer, header: ChunkHeader) -> ReservedWindow:
        """The reserved blocks of the chunk's window, and a payload's plan into them (checked)."""
        key = (header.block_offset, header.num_blocks)  # a plain pair: looked up for every layer
        window = incoming.windows.get(key)
        if window is None:
            offset, count, total = header.block_offset, header.num_blocks, incoming.ticket.num_blocks
            if not (type(offset) is int and type(count) is int and offset >= 0 and 0 < count <= total - offset):
                self.refuse("shape", f"blocks [{offset}, +{count}) are not among the ticket's {total}")
            reserved = list(incoming.ticket.block_ids[offset : offset + count])
            window = incoming.windows[key] = ReservedWindow(reserved, scatter_plan(reserved))
        return window
