"""One receiving shard: verifies chunks and writes them straight into reserved blocks.

Per request:  PENDING (ticket registered) ─▶ TRANSFERRING (first layer landed) ─▶ DONE (every
expected layer of every window from every expected sender, and their "done") | FAILED (checksum,
lease expired, a sender finished short).

A chunk carries one window of the ticket's blocks (``block_offset``, ``num_blocks``: a prefill
pushes each prompt chunk's blocks as it computes them); a sender's "done" names its windows, which
must tile the ticket's blocks. A chunk with a bad signature is refused and counted, but does not fail
the transfer: an unauthenticated party must not be able to cancel someone else's request.

Chunks land one of three ways:
    apply(header, payload)        the payload's bytes are copied into the reserved blocks (lock held)
    apply(header, b"", regions)   a pulled chunk: copied from the sender's shared memory (lock held)
    begin_direct / end_direct     the transport receives the payload straight into the reserved
                                  blocks (outside the lock, no copy); release() waits for it to end
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import NoReturn

import torch

from common.kv_layout import KVCacheLayout
from kv_transfer.block_copy import BlockCopyPlan, copy_blocks, plan_block_copy, scatter_plan, stacked_layers
from kv_transfer.protocol import (
    INTEGRITY_MODES,
    MAX_DIRECT_RUNS,
    ChunkHeader,
    ProtocolError,
    at_least,
    decode_header,
    integrity_of,
    payload_matches,
    peek_request_id,
)
from kv_transfer.resharding import plan_transfer, senders_for, shard_heads
from kv_transfer.state import TransferState, TransferStats
from kv_transfer.ticket import KVTicket, TicketError
from kv_transfer.transport import TransferRefused

logger = logging.getLogger(__name__)

# Payloads arrive as read-only bytes; they are only read (copied into the cache), never written.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

_MAX_LOCKED_COPY_BYTES = 16 << 20  # a pulled batch copies at most this much per hold of the receiver's lock
_WRITE_GRACE_S = 5.0  # past the lease, how long release() still waits for a payload in flight
# Released tickets remembered (with their secrets) so that their late chunks are told apart from
# forged ones: a transport may keep a connection that carried them (chunks of others follow).
_REMEMBERED_RELEASES = 4096
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HEADER_FIELDS = tuple(f.name for f in fields(ChunkHeader))


class NotInPlace(TransferRefused):
    """This receiver cannot take the chunk in place; the sender may send it to be copied instead."""


# A chunk's place in a transfer: (sender, layer, dst_head_offset, the window's block_offset and
# num_blocks). The window's size is part of it: a chunk of blocks [0, 2) must not stand in for a
# "done" that announces one window [0, N).
_ChunkKey = tuple[int, int, int, int, int]


@dataclass
class _Incoming:
    ticket: KVTicket
    state: TransferState = TransferState.PENDING
    reason: str | None = None
    sender_tp: int | None = None
    expected: set[tuple[int, int, int]] = field(default_factory=set)  # (sender, layer, dst_head_offset)
    segment_heads: dict[tuple[int, int], int] = field(default_factory=dict)  # (sender, dst offset) -> heads
    # (block_offset, num_blocks) -> the window's reserved blocks and a payload's plan into them
    windows: dict[tuple[int, int], tuple[list[int], BlockCopyPlan]] = field(default_factory=dict)
    landed: set[_ChunkKey] = field(default_factory=set)
    layers_landed: Counter = field(default_factory=Counter)  # layer -> (segment, window) pairs landed
    windows_landed: set[tuple[int, int]] = field(default_factory=set)  # (block_offset, num_blocks) chunks landed in
    done_from: set[int] = field(default_factory=set)
    done_windows: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # sender -> its windows
    first_token_id: int | None = None
    stats: TransferStats | None = None
    # (checked header fields, sender's block ids, their copy plan): what pulled layers share
    pull_plan: tuple[tuple[int, ...], list[int], BlockCopyPlan] | None = None
    writing: set[_ChunkKey] = field(default_factory=set)  # chunks a transport is receiving in place
    in_flight: list[DirectWrite] = field(default_factory=list)  # the writes under way (their abort hooks)
    # (block offset, num blocks, run lengths); (first block, length) of each run
    direct_plan: tuple[tuple[int, int, list[int]], list[tuple[int, int]]] | None = None


@dataclass(frozen=True, slots=True, eq=False)
class DirectWrite:
    """A chunk the transport receives straight into reserved blocks: ``targets`` (or ``views()``)
    are contiguous byte views of those blocks, in payload order (layer by layer; in each, K then V,
    each by run of consecutive blocks)."""

    request_id: str
    layers: list[ChunkHeader]  # one header per layer the chunk carries
    keys: list[_ChunkKey]
    spans: list[tuple[int, int, int]]  # (layer, byte offset, length) of each target in its layer's bytes
    layer_bytes: list[torch.Tensor | None] = field(repr=False)  # the receiver's layers as flat bytes
    layer_views: list[memoryview | None] = field(repr=False)  # the same, as memoryviews (a CPU cache)
    lease_left_s: float  # the transport must end the write by then (the sender's clock is not ours)
    incoming: _Incoming = field(repr=False)
    # The transport's way to cut the payload short (a gRPC call's cancel); release() calls it
    # rather than wait for a stalled sender. Without one, the transport bounds the wait itself.
    abort: list[Callable[[], object]] = field(default_factory=list, repr=False)

    @property
    def targets(self) -> list[torch.Tensor]:
        """The targets as uint8 tensors (on the cache's device)."""
        flat = self.layer_bytes
        return [flat[layer].narrow(0, offset, length) for layer, offset, length in self.spans]  # type: ignore[union-attr]

    def views(self) -> list[memoryview] | None:
        """The targets as writable memoryviews, sliced without a tensor op each; None for a GPU cache."""
        views = self.layer_views
        if any(views[layer] is None for layer, _, _ in self.spans):
            return None
        return [views[layer][offset : offset + length] for layer, offset, length in self.spans]  # type: ignore[index]


@dataclass(frozen=True, slots=True)
class ReceiveStatus:
    state: TransferState
    reason: str | None
    first_token_id: int | None
    layers_complete: int  # layers whose every segment has landed (layer-wise progress)


class KVReceiver:
    def __init__(
        self, kv_caches: list[torch.Tensor], layout: KVCacheLayout, backend: str = "", require_integrity: str = "none"
    ) -> None:
        assert len(kv_caches) == layout.num_layers, "one KV tensor per layer"
        if require_integrity not in INTEGRITY_MODES:
            raise ValueError(f"require_integrity={require_integrity!r}: use one of {', '.join(INTEGRITY_MODES)}")
        self.require_integrity = require_integrity  # the weakest payload check a chunk may carry
        self.kv_caches = kv_caches
        self._stacked = stacked_layers(kv_caches)  # [layers, ...] when they share one allocation
        # Each contiguous layer as flat bytes: a payload received in place lands in slices of these.
        self._layer_bytes = [kv.view(-1).view(torch.uint8) if kv.is_contiguous() else None for kv in kv_caches]
        self._layer_views = [
            memoryview(flat.numpy()) if flat is not None and flat.device.type == "cpu" else None
            for flat in self._layer_bytes
        ]
        self.layout = layout
        self.backend = backend
        self._lock = threading.Lock()
        self._writes_ended = threading.Condition(self._lock)
        self._incoming: dict[str, _Incoming] = {}
        self._released: OrderedDict[str, bytes] = OrderedDict()  # request id -> its ticket's secret
        self.refusals: Counter = Counter()  # reason -> count, for metrics

    # --- the decode driver's side ----------------------------------------------------------
    def expect(self, ticket: KVTicket) -> None:
        """Register a ticket before handing it out; chunks for unknown tickets are refused."""
        bad = [b for b in ticket.block_ids if not 0 <= b < self.layout.num_blocks]
        if bad:
            raise TicketError(
                f"ticket {ticket.request_id} names blocks {bad[:4]} outside this cache's {self.layout.num_blocks}"
            )
        with self._lock:
            self._released.pop(ticket.request_id, None)
            self._incoming[ticket.request_id] = _Incoming(
                ticket=ticket, stats=TransferStats(ticket.request_id, self.backend)
            )

    def poll(self, request_id: str) -> ReceiveStatus:
        """Never blocks. A non-terminal transfer past its lease becomes FAILED here."""
        with self._lock:
            incoming = self._incoming.get(request_id)
            if incoming is None:
                return ReceiveStatus(TransferState.FAILED, "no such ticket", None, 0)
            if not incoming.state.is_terminal and incoming.ticket.is_expired():
                self._fail(incoming, "lease expired before the KV arrived")
            complete = self._layers_complete(incoming)
            return ReceiveStatus(incoming.state, incoming.reason, incoming.first_token_id, complete)

    def stats(self, request_id: str) -> TransferStats | None:
        incoming = self._incoming.get(request_id)
        return incoming.stats if incoming else None

    def release(self, request_id: str) -> None:
        """Forget a ticket (its blocks are the engine's to free); later chunks for it are refused.

        Returns only once no transport is still receiving into the ticket's blocks: a payload in
        flight ends within its chunk's deadline, at the latest the lease (gloo closes a pair whose
        receive timed out, and a closed pair writes nothing more), so this waits at most that long,
        and only in a transfer ended mid-payload."""
        with self._lock:
            incoming = self._incoming.pop(request_id, None)
            if incoming is None:
                return
            self._released[request_id] = incoming.ticket.secret
            if len(self._released) > _REMEMBERED_RELEASES:
                self._released.popitem(last=False)
            for abort in [hook for write in incoming.in_flight for hook in write.abort]:
                try:
                    abort()
                except Exception:
                    logger.exception("aborting a payload in flight for %s failed", request_id)
            give_up = time.monotonic() + max(0.0, incoming.ticket.lease_deadline - time.time()) + _WRITE_GRACE_S
            while incoming.writing and self._writes_ended.wait(max(0.0, give_up - time.monotonic())):
                pass
            if incoming.writing:  # a transport that never ended its write: a bug, reported, not a hang
                logger.error("releasing %s with a payload still in flight past its lease", request_id)

    # --- the transport's side --------------------------------------------------------------
    def apply(
        self, raw_header: bytes, payload: memoryview | bytes, regions: Mapping[int, torch.Tensor] | None = None
    ) -> None:
        """Verify one chunk and write it. Raises TransferRefused with the reason; writes nothing then
        (a pulled chunk whose checksum fails has written into its own request's blocks only, and
        fails that request).

        ``regions``: the sender's memory this transport mapped (region id -> flat uint8 tensor),
        from which a pulled chunk (``header.pulled``) is read in place instead of from ``payload``.
        """
        with self._lock:
            incoming, header = self._authenticate(raw_header)
            self._learn_senders(incoming, header)
            if header.kind == "done":
                self._on_done(incoming, header)
                return
            layers = self._layers_of(header, payload_batch=not header.pulled)
            if len(layers) > 1 and not header.pulled:
                self._apply_payload_batch(incoming, layers, payload)
            elif len(layers) > 1 and self._stacked is not None:
                self._apply_pulled_batch(incoming, layers, regions)
            else:
                for layer_header in layers:
                    self._apply_layer(incoming, layer_header, payload, regions)

    def check_header(self, raw_header: bytes, nbytes: int) -> None:
        """Refuse (TransferRefused) a chunk whose header is not authentic, or whose payload of
        ``nbytes`` is larger than its ticket's blocks of every layer could hold, before a transport
        allocates or reads that payload. ``apply`` checks everything again."""
        with self._lock:
            incoming, _ = self._authenticate(raw_header)
            most = self.layout.num_layers * self._layer_bytes_of(incoming.ticket.num_blocks)
            if nbytes > most:
                self._refuse("shape", f"a payload of {nbytes} bytes; this ticket's blocks hold {most}")

    def begin_direct(
        self, raw_header: bytes, nbytes: int, num_pieces: int | None, abort: Callable[[], object] | None = None
    ) -> DirectWrite:
        """Check a chunk whose payload the transport will receive in place, and reserve its targets.

        Only a chunk carrying every head of this shard, for blocks whose runs are few, qualifies;
        anything else is refused (the sender then sends the payload to be copied). A chunk may carry
        several layers (``header.batch``: those queued at the sender). ``num_pieces``: the messages
        the transport will receive into the targets one each (None: it streams bytes across them).
        ``abort``: the transport's way to cut the payload short, registered before any ``release``
        can see the write. The caller must call ``end_direct`` exactly once afterwards, whatever
        happens to the payload."""
        with self._lock:
            incoming, header = self._authenticate(raw_header)
            if header.kind != "layer" or header.pulled or header.run_lengths is None:
                self._refuse("malformed", "a chunk received in place names its layers and block runs")
            self._learn_senders(incoming, header)
            layers = self._layers_of(header, payload_batch=True)
            keys = [self._check_chunk(incoming, layer) for layer in layers]
            if len(set(keys)) != len(keys):
                self._refuse("duplicate", f"a chunk names one layer twice: {keys}")
            layout = self.layout
            layer_bytes = self._layer_bytes_of(header.num_blocks)  # the window's (checked with the keys)
            if header.num_heads != layout.num_kv_heads or header.dst_head_offset != 0:
                self._refuse("shape", f"layer {header.layer}: a chunk received in place carries every head")
            if layer_bytes != header.nbytes or nbytes != layer_bytes * len(layers):
                self._refuse("shape", f"layer {header.layer}: {nbytes} bytes, expected {layer_bytes * len(layers)}")
            runs = self._direct_runs(incoming, header)
            if num_pieces is not None and len(layers) * 2 * len(runs) != num_pieces:
                self._refuse("shape", f"{num_pieces} pieces, expected {len(layers) * 2 * len(runs)}")
            block_bytes = layer_bytes // (2 * header.num_blocks)
            flats = [self._layer_bytes[layer.layer] for layer in layers]  # each [K blocks | V blocks]
            for layer, flat in zip(layers, flats, strict=True):
                if flat is None:
                    self.refusals["not_in_place"] += 1
                    raise NotInPlace(f"layer {layer.layer} of this cache is not contiguous")
            half = flats[0].numel() // 2  # type: ignore[union-attr]  # every layer has one shape
            spans_of_layer = [(part * half + dst * block_bytes, n * block_bytes) for part in (0, 1) for dst, n in runs]
            spans = [(layer.layer, offset, length) for layer in layers for offset, length in spans_of_layer]
            incoming.writing.update(keys)
            write = DirectWrite(
                incoming.ticket.request_id,
                layers,
                keys,
                spans,
                self._layer_bytes,
                self._layer_views,
                incoming.ticket.lease_deadline - time.time(),
                incoming,
                [abort] if abort is not None else [],
            )
            incoming.in_flight.append(write)
            return write

    def end_direct(self, write: DirectWrite, received: bool, reason: str = "") -> None:
        """The transport is done with ``write``'s targets: every byte received (``received``) or the
        payload failed midway (``reason``; the request fails). Raises TransferRefused like ``apply``."""
        # Checksums outside the lock (a chunk may be hundreds of MB): the blocks stay reserved
        # until the write ends below, so nothing else can touch them meanwhile.
        intact = []
        if received and any(header.checksum is not None for header in write.layers):
            views = write.views()
            parts = views if views is not None else [memoryview(t.cpu().numpy()) for t in write.targets]
            per_layer = len(parts) // len(write.layers)
            secret = write.incoming.ticket.secret
            intact = [
                payload_matches(header.checksum, secret, *parts[i * per_layer : (i + 1) * per_layer])
                for i, header in enumerate(write.layers)
            ]
        elif received:
            intact = [True] * len(write.layers)
        with self._lock:
            owner = write.incoming
            owner.writing.difference_update(write.keys)
            owner.in_flight = [other for other in owner.in_flight if other is not write]
            self._writes_ended.notify_all()  # release() may be waiting for this write to end
            if self._incoming.get(write.request_id) is not owner:
                self._refuse("terminal", f"transfer of {write.request_id} was released during its payload")
            first = write.layers[0].layer
            if not received:
                self._fail(owner, f"layer {first}+ payload not received: {reason}")
                self._refuse("payload", f"layer {first}+ payload not received: {reason}")
            if owner.state.is_terminal:
                self._refuse("terminal", f"transfer of {write.request_id} already {owner.state.name}")
            bad = intact.index(False) if False in intact else len(intact)
            self._land_before(owner, write.layers, write.keys, bad)

    # --- helpers (hold the lock) -----------------------------------------------------------
    def _layer_bytes_of(self, num_blocks: int) -> int:
        """K and V of one layer of every head of this shard, for ``num_blocks`` blocks."""
        layout = self.layout
        per_block = layout.block_size * layout.num_kv_heads * layout.head_dim * _DTYPES[layout.dtype].itemsize
        return 2 * num_blocks * per_block

    def _window(self, incoming: _Incoming, header: ChunkHeader) -> tuple[list[int], BlockCopyPlan]:
        """The reserved blocks of the chunk's window, and a payload's plan into them (checked)."""
        key = (header.block_offset, header.num_blocks)
        window = incoming.windows.get(key)
        if window is None:
            offset, count, total = header.block_offset, header.num_blocks, incoming.ticket.num_blocks
            if not (type(offset) is int and type(count) is int and offset >= 0 and 0 < count <= total - offset):
                self._refuse("shape", f"blocks [{offset}, +{count}) are not among the ticket's {total}")
            reserved = list(incoming.ticket.block_ids[offset : offset + count])
            window = incoming.windows[key] = (reserved, scatter_plan(reserved))
        return window

    def _authenticate(self, raw_header: bytes) -> tuple[_Incoming, ChunkHeader]:
        """The chunk's transfer and verified header, for a live ticket addressed to this shard."""
        try:
            request_id = peek_request_id(raw_header)
        except ProtocolError as exc:
            self._refuse("malformed", str(exc))
        incoming = self._incoming.get(request_id)
        if incoming is None:
            secret = self._released.get(request_id)
            if secret is None:
                self._refuse("unknown_ticket", f"no ticket for request {request_id!r} here")
            try:
                decode_header(raw_header, secret)
            except ProtocolError as exc:
                self._refuse("bad_signature", str(exc))
            self._refuse("released", f"transfer of {request_id} was released here")
        try:
            header = decode_header(raw_header, incoming.ticket.secret)
        except ProtocolError as exc:
            self._refuse("bad_signature", str(exc))
        if incoming.state.is_terminal:
            self._refuse("terminal", f"transfer of {request_id} already {incoming.state.name}")
        if incoming.ticket.is_expired():
            self._fail(incoming, "lease expired before the KV arrived")
            self._refuse("lease_expired", "the ticket's lease has expired")
        if header.receiver_rank != self.layout.tp_rank:
            self._refuse("wrong_shard", f"chunk for shard {header.receiver_rank} reached {self.layout.tp_rank}")
        return incoming, header

    def _direct_runs(self, incoming: _Incoming, header: ChunkHeader) -> list[tuple[int, int]]:
        """(first reserved block, length) of each run a payload received in place comes in: the
        window's reserved blocks in order, cut where the sender said, each run consecutive here too."""
        run_lengths = header.run_lengths
        cached = incoming.direct_plan
        if cached is None or cached[0] != (header.block_offset, header.num_blocks, run_lengths):
            reserved = self._window(incoming, header)[0]
            if (
                not isinstance(run_lengths, list)
                or not 0 < len(run_lengths) <= MAX_DIRECT_RUNS
                or not all(isinstance(n, int) and n > 0 for n in run_lengths)
                or sum(run_lengths) != len(reserved)
            ):
                self._refuse("shape", f"runs {run_lengths!r} do not cover the {len(reserved)} reserved blocks")
            runs, start = [], 0
            for n in run_lengths:
                first = reserved[start]
                if list(reserved[start : start + n]) != list(range(first, first + n)):
                    self._refuse("shape", f"run of {n} blocks from reserved block {first} is not consecutive here")
                runs.append((first, n))
                start += n
            cached = incoming.direct_plan = ((header.block_offset, header.num_blocks, list(run_lengths)), runs)
        return cached[1]

    def _layers_of(self, header: ChunkHeader, payload_batch: bool = False) -> list[ChunkHeader]:
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
            self._refuse("malformed", f"a batch of {len(batch) if isinstance(batch, list) else '?'} layers")
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
                self._refuse("malformed", f"batch entry {entry!r} is not [layer, region, offset, checksum]")
        # One constructor call per layer, not dataclasses.replace (~4x slower: it reads every field
        # anew), for chunks that name up to a model's every layer.
        shared = {name: getattr(header, name) for name in _HEADER_FIELDS}
        shared["batch"] = None
        for layer, region, offset, crc in batch:
            shared.update(layer=layer, src_region=region, src_offset=offset, checksum=crc)
            entries.append(ChunkHeader(**shared))
        return entries

    def _check_chunk(self, incoming: _Incoming, header: ChunkHeader) -> _ChunkKey:
        """The chunk's key in the transfer plan, once it is known to be expected, new and well shaped."""
        # The plan covers this shard's layers only.
        key = (header.sender_rank, header.layer, header.dst_head_offset, header.block_offset, header.num_blocks)
        if key[:3] not in incoming.expected:
            self._refuse("unplanned", f"chunk {key} is not part of the transfer plan")
        self._window(incoming, header)
        if key in incoming.landed:
            self._refuse("duplicate", f"chunk {key} already landed")
        if key in incoming.writing:
            self._refuse("duplicate", f"chunk {key} is already being received")
        if header.num_heads != incoming.segment_heads[(header.sender_rank, header.dst_head_offset)]:
            self._refuse("shape", f"chunk {key} carries {header.num_heads} heads, not the planned number")
        if not at_least(header.checksum, self.require_integrity):
            # A sender configured apart from this receiver: no later chunk of it will do better.
            reason = f"a {integrity_of(header.checksum)} payload check; this receiver requires {self.require_integrity}"
            self._fail(incoming, reason)
            self._refuse("integrity", f"chunk {key} carries {reason}")
        return key

    def _apply_layer(
        self,
        incoming: _Incoming,
        header: ChunkHeader,
        payload,
        regions: Mapping[int, torch.Tensor] | None,
        checked: bool = False,  # the payload already passed its check (a batch checked whole)
    ) -> None:
        key = self._check_chunk(incoming, header)
        heads = slice(header.dst_head_offset, header.dst_head_offset + header.num_heads)
        dst = self.kv_caches[header.layer][:, :, :, heads]
        # The copy stays under the lock: once release() returns, no chunk of that request can
        # still be writing into blocks the engine is about to reuse.
        if header.pulled:
            source, plan = self._pulled_source(incoming, header, regions)
            copy_blocks(dst, source, plan)
            self._verify_pulled(incoming, header, dst)
        else:
            target = self._target_view(incoming, header, payload)
            if not checked and not payload_matches(header.checksum, incoming.ticket.secret, payload):
                self._checksum_failed(incoming, header)
            copy_blocks(dst, target, self._window(incoming, header)[1])
        self._landed(incoming, [header], [key], header.nbytes if header.pulled else len(payload), header.pulled)

    def _apply_payload_batch(self, incoming: _Incoming, layers: list[ChunkHeader], payload) -> None:
        """Several layers carried one after another in the payload (the sender bounds it to 16 MB,
        so it is copied under one hold of the lock). Checked whole, checksums included, before
        anything is written."""
        keys = [self._check_chunk(incoming, header) for header in layers]
        if len(set(keys)) != len(keys):
            self._refuse("duplicate", "a batch names one layer twice")
        view = memoryview(payload).cast("B")
        per_layer = len(view) // len(layers)
        if per_layer * len(layers) != len(view):
            self._refuse("shape", f"a payload of {len(view)} bytes for {len(layers)} layers")
        first = self._target_view(incoming, layers[0], view[:per_layer])  # every layer has its shape
        for i, header in enumerate(layers):
            if not payload_matches(header.checksum, incoming.ticket.secret, view[i * per_layer : (i + 1) * per_layer]):
                self._checksum_failed(incoming, header)
        consecutive = all(header.layer == layers[0].layer + i for i, header in enumerate(layers))
        if self._stacked is None or not consecutive:
            for i, header in enumerate(layers):
                part = view[i * per_layer : (i + 1) * per_layer]
                self._apply_layer(incoming, header, part, None, checked=True)
            return
        # One copy per block run for all the layers (a per-layer copy costs ~100 us of Python).
        source = torch.frombuffer(view, dtype=torch.uint8).view(first.dtype).view(len(layers), *first.shape)
        heads = slice(layers[0].dst_head_offset, layers[0].dst_head_offset + layers[0].num_heads)
        dst = self._stacked[layers[0].layer : layers[-1].layer + 1, :, :, :, heads]
        copy_blocks(dst, source.to(dst.device), self._window(incoming, layers[0])[1], dim=2)
        self._landed(incoming, layers, keys, per_layer * len(layers), in_place=False)

    def _apply_pulled_batch(
        self, incoming: _Incoming, layers: list[ChunkHeader], regions: Mapping[int, torch.Tensor] | None
    ) -> None:
        """Several pulled layers: consecutive layers that sit back to back on both sides move in one
        copy per block run (a per-layer copy costs ~50 us of Python, as much as a 1k-token layer's
        bytes). Called with the lock held; released between groups of at most 16 MB."""
        keys = [self._check_chunk(incoming, header) for header in layers]
        if len(set(keys)) != len(keys):
            self._refuse("duplicate", "a batch names one layer twice")
        first = layers[0]
        src_layer_bytes = (
            2 * first.src_num_blocks * self.layout.block_size * first.src_heads * self.layout.head_dim
        ) * _DTYPES[self.layout.dtype].itemsize
        heads = slice(first.dst_head_offset, first.dst_head_offset + first.num_heads)
        assert self._stacked is not None
        most = max(1, _MAX_LOCKED_COPY_BYTES // max(1, first.nbytes))  # layers copied per lock hold
        groups: list[tuple[int, int, torch.Tensor, BlockCopyPlan]] = []  # (start, end, source, plan)
        start = 0
        while start < len(layers):
            end = start + 1
            while (
                end < len(layers)
                and end - start < most
                and layers[end].layer == layers[end - 1].layer + 1
                and layers[end].src_region == layers[start].src_region
                and layers[end].src_offset == layers[end - 1].src_offset + src_layer_bytes
            ):
                end += 1
            # Every group is checked before anything is written: a refused batch writes nothing.
            source, plan = self._pulled_source(incoming, layers[start], regions, num_layers=end - start)
            groups.append((start, end, source, plan))
            start = end
        for start, end, source, plan in groups:
            if start:
                # Let poll() and expect() in between groups: a decode step must not wait behind a
                # whole batch. The request may have ended meanwhile: then nothing more is written.
                self._lock.release()
                self._lock.acquire()
                if self._incoming.get(first.request_id) is not incoming or incoming.state.is_terminal:
                    self._refuse("terminal", f"transfer of {first.request_id} ended during its batch")
            dst = self._stacked[layers[start].layer : layers[end - 1].layer + 1, :, :, :, heads]
            copy_blocks(dst, source, plan, dim=2)
            intact = (self._pulled_intact(incoming, layers[i], dst[i - start]) for i in range(start, end))
            bad = next((i for i, ok in enumerate(intact) if not ok), end - start)
            self._land_before(incoming, layers[start:end], keys[start:end], bad)

    def _land_before(self, incoming: _Incoming, headers: list[ChunkHeader], keys: list[_ChunkKey], bad: int) -> None:
        """Chunks written in place whose checksums were checked: those before index ``bad`` land;
        the one at ``bad`` (if any) failed its checksum and fails the request."""
        landed = headers[:bad]
        self._landed(incoming, landed, keys[:bad], sum(h.nbytes for h in landed), in_place=True)
        if bad < len(headers):
            self._checksum_failed(incoming, headers[bad])

    def _verify_pulled(self, incoming: _Incoming, header: ChunkHeader, dst: torch.Tensor) -> None:
        if not self._pulled_intact(incoming, header, dst):
            self._checksum_failed(incoming, header)

    @staticmethod
    def _pulled_intact(incoming: _Incoming, header: ChunkHeader, dst: torch.Tensor) -> bool:
        if header.checksum is None:
            return True
        scatter = incoming.windows[(header.block_offset, header.num_blocks)][1]  # checked with its key
        return payload_matches(header.checksum, incoming.ticket.secret, _payload_bytes(dst, scatter))

    def _checksum_failed(self, incoming: _Incoming, header: ChunkHeader) -> NoReturn:
        self._fail(incoming, f"checksum mismatch in layer {header.layer}")
        self._refuse("checksum", f"checksum mismatch in layer {header.layer}")

    def _landed(
        self,
        incoming: _Incoming,
        headers: list[ChunkHeader],
        keys: list[_ChunkKey],
        nbytes: int,
        in_place: bool,
    ) -> None:
        """``headers``' chunks (``nbytes`` in all) are in their blocks: recorded together, since a
        batch names up to every layer and the bookkeeping costs as much per layer as a short copy."""
        if not headers:
            return
        now = time.monotonic()
        stats = incoming.stats
        assert stats is not None
        if stats.start_time is None:
            stats.start_time = now
        stats.num_bytes += nbytes
        if in_place:
            stats.in_place_bytes += nbytes
        incoming.landed.update(keys)
        for header in headers:
            incoming.layers_landed[header.layer] += 1
            incoming.windows_landed.add((header.block_offset, header.num_blocks))
        if stats.first_layer_time is None and self._layers_complete(incoming) >= 1:
            stats.first_layer_time = now
        if incoming.state is TransferState.PENDING:
            incoming.state = TransferState.TRANSFERRING
        self._maybe_done(incoming)

    def _learn_senders(self, incoming: _Incoming, header: ChunkHeader) -> None:
        if incoming.sender_tp is None:
            incoming.sender_tp = header.sender_tp
            plan = plan_transfer(header.sender_tp, self.layout.tp_size, self.layout.total_kv_heads)
            incoming.segment_heads = {
                (seg.sender_rank, seg.dst_head_offset): seg.num_heads
                for seg in plan
                if seg.receiver_rank == self.layout.tp_rank
            }
            incoming.expected = {
                (sender, layer, offset)
                for sender, offset in incoming.segment_heads
                for layer in range(self.layout.num_layers)
            }
        elif header.sender_tp != incoming.sender_tp:
            self._refuse("unplanned", f"sender TP changed from {incoming.sender_tp} to {header.sender_tp}")

    def _target_view(self, incoming: _Incoming, header: ChunkHeader, payload) -> torch.Tensor:
        layout = self.layout
        dtype = _DTYPES[layout.dtype]
        shape = (2, header.num_blocks, layout.block_size, header.num_heads, layout.head_dim)  # the window's
        expected_bytes = torch.Size(shape).numel() * dtype.itemsize
        if len(payload) != expected_bytes:
            self._refuse("shape", f"layer {header.layer}: {len(payload)} bytes, expected {expected_bytes}")
        if header.dst_head_offset + header.num_heads > layout.num_kv_heads:
            self._refuse("shape", f"heads [{header.dst_head_offset}, +{header.num_heads}) exceed this shard")
        raw = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
        return raw.view(dtype).view(shape).to(self.kv_caches[0].device)

    def _pulled_source(
        self,
        incoming: _Incoming,
        header: ChunkHeader,
        regions: Mapping[int, torch.Tensor] | None,
        num_layers: int | None = None,
    ) -> tuple[torch.Tensor, BlockCopyPlan]:
        """The sender's blocks of this chunk, viewed in place in its shared region (checked first:
        an authenticated header still may not make this side read outside that region). With
        ``num_layers``, that many layers lying back to back from ``src_offset``, stacked."""
        layout = self.layout
        region = None if regions is None else regions.get(header.src_region)
        if region is None:
            self._refuse("shape", f"layer {header.layer}: the sender's memory region {header.src_region} is unknown")
        dtype = _DTYPES[layout.dtype]
        itemsize = dtype.itemsize
        src_ids = header.src_block_ids or []
        shape = (2, header.src_num_blocks, layout.block_size, header.src_heads, layout.head_dim)
        layer_bytes = torch.Size(shape).numel() * itemsize
        # Every layer of a transfer names the same blocks and heads: check those once per request.
        key = (
            header.src_num_blocks,
            header.src_heads,
            header.src_head_offset,
            header.num_heads,
            header.nbytes,
            header.block_offset,
            header.num_blocks,
        )
        cached = incoming.pull_plan
        if cached is None or cached[0] != key or cached[1] != src_ids:
            reserved = self._window(incoming, header)[0]
            expected_bytes = 2 * len(reserved) * layout.block_size * header.num_heads * layout.head_dim
            problems = [
                len(src_ids) != len(reserved) and f"{len(src_ids)} source blocks for {len(reserved)} reserved",
                header.nbytes != expected_bytes * itemsize
                and f"{header.nbytes} bytes, expected {expected_bytes * itemsize}",
                header.dst_head_offset + header.num_heads > layout.num_kv_heads
                and f"heads [{header.dst_head_offset}, +{header.num_heads}) exceed this shard",
                (header.src_head_offset < 0 or header.src_head_offset + header.num_heads > header.src_heads)
                and "source heads out of range",
                bool(src_ids)
                and (min(src_ids) < 0 or max(src_ids) >= header.src_num_blocks)
                and "source block ids out of range",
            ]
            problem = next((p for p in problems if p), None)
            if problem:
                self._refuse("shape", f"layer {header.layer}: {problem}")
            plan = plan_block_copy(src_ids, reserved)
            cached = incoming.pull_plan = (key, src_ids, plan)
        span = layer_bytes * (num_layers or 1)
        if header.src_offset < 0 or header.src_offset % itemsize or header.src_offset + span > len(region):
            self._refuse("shape", f"layer {header.layer}: source tensor outside the shared region")
        source = region[header.src_offset : header.src_offset + span].view(dtype)
        source = source.view(shape if num_layers is None else (num_layers, *shape))
        return source.narrow(-2, header.src_head_offset, header.num_heads), cached[2]

    def _on_done(self, incoming: _Incoming, header: ChunkHeader) -> None:
        sender = header.sender_rank
        windows = header.windows if header.windows is not None else [[0, incoming.ticket.num_blocks]]
        tiling = _tiling_windows(windows, incoming.ticket.num_blocks)
        if tiling is None:
            self._fail(incoming, f"sender {sender} finished with windows {windows!r} that do not tile the ticket")
            return
        incoming.done_from.add(sender)
        incoming.done_windows[sender] = tiling
        if header.first_token_id is not None:
            incoming.first_token_id = header.first_token_id
        announced = self._keys_of(incoming, sender)
        landed = {key for key in incoming.landed if key[0] == sender}
        if landed != announced:
            missing, stray = len(announced - landed), len(landed - announced)
            self._fail(incoming, f"sender {sender} finished with {missing} chunks missing, {stray} outside its windows")
            return
        self._maybe_done(incoming)

    @staticmethod
    def _keys_of(incoming: _Incoming, sender: int) -> set[_ChunkKey]:
        """Every chunk a finished sender's windows owe this shard."""
        windows = incoming.done_windows[sender]
        return {(*key, offset, count) for key in incoming.expected if key[0] == sender for offset, count in windows}

    def _maybe_done(self, incoming: _Incoming) -> None:
        if not incoming.done_from:
            return  # no sender has finished yet
        assert incoming.sender_tp is not None
        needed = senders_for(self.layout.tp_rank, incoming.sender_tp, self.layout.tp_size, self.layout.total_kv_heads)
        if not needed <= incoming.done_from:
            return
        owed: set[_ChunkKey] = set()
        for sender in needed:
            owed |= self._keys_of(incoming, sender)
        if incoming.landed == owed:
            incoming.state = TransferState.DONE
            stats = incoming.stats
            assert stats is not None
            stats.end_time = time.monotonic()
            stats.num_layers = self.layout.num_layers

    def _layers_complete(self, incoming: _Incoming) -> int:
        if incoming.sender_tp is None:
            return 0
        per_layer = len(incoming.expected) // self.layout.num_layers * max(1, len(incoming.windows_landed))
        count = 0
        for layer in range(self.layout.num_layers):  # layers land in order; count the complete prefix
            if incoming.layers_landed[layer] < per_layer:
                break
            count += 1
        return count

    def _fail(self, incoming: _Incoming, reason: str) -> None:
        if not incoming.state.is_terminal:
            incoming.state = TransferState.FAILED
            incoming.reason = reason
            if incoming.stats is not None:
                incoming.stats.end_time = time.monotonic()

    def _refuse(self, kind: str, message: str) -> NoReturn:
        self.refusals[kind] += 1
        raise TransferRefused(message, kind)


def _payload_bytes(dst: torch.Tensor, scatter: BlockCopyPlan) -> memoryview:
    """The bytes a payload of these blocks would have carried (to checksum a pulled chunk)."""
    blocks = dst.index_select(1, scatter.dst_index.to(dst.device)).contiguous().cpu()
    return memoryview(blocks.view(torch.uint8).numpy()).cast("B")


__all__ = ["KVReceiver", "ReceiveStatus", "shard_heads"]


def _tiling_windows(windows, num_blocks: int) -> list[tuple[int, int]] | None:
    """``windows`` ([block_offset, num_blocks] each, from a "done") as pairs, if they cover a ticket of
    ``num_blocks`` blocks in order without a gap or an overlap; else None."""
    if not isinstance(windows, list) or not 0 < len(windows) <= max(1, num_blocks):
        return None
    tiling: list[tuple[int, int]] = []
    end = 0
    for window in windows:
        if not (type(window) is list and len(window) == 2 and all(type(v) is int for v in window)):
            return None
        offset, count = window
        if offset != end or count <= 0:
            return None
        tiling.append((offset, count))
        end += count
    return tiling if end == num_blocks else None
