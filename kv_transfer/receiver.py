"""One receiving shard: verifies chunks and lands them straight in the blocks a ticket reserved.

Per transfer:  PENDING (ticket registered) ─▶ TRANSFERRING (first layer landed) ─▶ DONE (every
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

KVReceiver holds the lock and composes the collaborators of ``kv_transfer.receiving``: the tickets
(TicketBook), the checks every chunk passes (ChunkChecks), the completion rule (Completion), and one
landing per way above (CopiedLanding, PulledLanding, DirectLanding).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from common.kv_layout import KVCacheLayout
from kv_transfer.device_streams import on_transfer_stream, settle
from kv_transfer.errors import NotInPlace
from kv_transfer.protocol import INTEGRITY_MODES, ChunkHeader
from kv_transfer.receiving.cache import ReceivingCache
from kv_transfer.receiving.checks import ChunkChecks
from kv_transfer.receiving.completion import Completion
from kv_transfer.receiving.copied import CopiedLanding
from kv_transfer.receiving.direct import DirectLanding, DirectWrite
from kv_transfer.receiving.pulled import PulledLanding
from kv_transfer.receiving.tickets import TicketBook
from kv_transfer.receiving.transfer import ChunkKey, IncomingTransfer
from kv_transfer.state import TransferState, TransferStats
from kv_transfer.ticket import KVTicket

logger = logging.getLogger(__name__)

# Payloads arrive as read-only bytes; they are only read (copied into the cache), never written.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

_MAX_LOCKED_COPY_BYTES = 16 << 20  # a pulled batch copies at most this much per hold of the receiver's lock
_WRITE_GRACE_S = 5.0  # past the lease, how long release() still waits for a payload in flight

__all__ = ["DirectWrite", "KVReceiver", "NotInPlace", "ReceiveStatus"]


@dataclass(frozen=True, slots=True)
class ReceiveStatus:
    state: TransferState
    reason: str | None
    first_token_id: int | None
    layers_complete: int  # layers whose every segment has landed (layer-wise progress)
    payloads_arriving: int = 0  # chunks whose payload a transport is receiving into the blocks now


@contextlib.contextmanager
def _settled(device: torch.device) -> Iterator[None]:
    """The block's device work has run when it is left, raised or not."""
    try:
        yield
    finally:
        settle(device)


class KVReceiver:
    def __init__(
        self, kv_caches: list[torch.Tensor], layout: KVCacheLayout, backend: str = "", require_integrity: str = "none"
    ) -> None:
        assert len(kv_caches) == layout.num_layers, "one KV tensor per layer"
        if require_integrity not in INTEGRITY_MODES:
            raise ValueError(f"require_integrity={require_integrity!r}: use one of {', '.join(INTEGRITY_MODES)}")
        self.require_integrity = require_integrity  # the weakest payload check a chunk may carry
        self.kv_caches = kv_caches
        self.layout = layout
        self.backend = backend
        self.refusals: Counter = Counter()  # reason -> count, for metrics
        cache = ReceivingCache.of(kv_caches, layout)
        self._device = cache.device
        self._stacked = cache.stacked  # [layers, ...] when they share one allocation
        self._lock = threading.Lock()
        self._writes_ended = threading.Condition(self._lock)
        self._tickets = TicketBook(layout, backend)
        self._checks = ChunkChecks(self._tickets, layout, require_integrity, self.refusals)
        self._completion = Completion(layout, self._checks)
        self._copied = CopiedLanding(cache, self._checks, self._completion)
        self._pulled = PulledLanding(cache, self._checks, self._completion)
        self._direct = DirectLanding(cache, self._checks)

    @property
    def _incoming(self) -> dict[str, IncomingTransfer]:
        """Request id -> its transfer (tests watch a transfer's writes in place through it)."""
        return self._tickets.incoming

    # --- the decode driver's side ----------------------------------------------------------
    def expect(self, ticket: KVTicket) -> None:
        """Register a ticket before handing it out; chunks for unknown tickets are refused."""
        self._tickets.check(ticket)
        with self._lock:
            self._tickets.add(ticket)

    def poll(self, request_id: str) -> ReceiveStatus:
        """Never blocks. A non-terminal transfer past its lease becomes FAILED here."""
        with self._lock:
            incoming = self._tickets.incoming.get(request_id)
            if incoming is None:
                return ReceiveStatus(TransferState.FAILED, "no such ticket", None, 0)
            incoming.expire_if_due()
            complete = self._completion.layers_complete(incoming)
            arriving = len(incoming.in_flight)
            return ReceiveStatus(incoming.state, incoming.reason, incoming.first_token_id, complete, arriving)

    def stats(self, request_id: str) -> TransferStats | None:
        incoming = self._tickets.incoming.get(request_id)
        return incoming.stats if incoming else None

    def release(self, request_id: str) -> None:
        """Forget a ticket (its blocks are the engine's to free); later chunks for it are refused.

        Returns only once no transport is still receiving into the ticket's blocks: a payload in
        flight ends within its chunk's deadline, at the latest the lease (gloo closes a pair whose
        receive timed out, and a closed pair writes nothing more), so this waits at most that long,
        and only in a transfer ended mid-payload."""
        with self._lock:
            incoming = self._tickets.forget(request_id)
            if incoming is None:
                return
            give_up = time.monotonic() + incoming.ticket.lease_left_s() + _WRITE_GRACE_S
            while incoming.writing and self._writes_ended.wait(max(0.0, give_up - time.monotonic())):
                pass
            if incoming.writing:  # a transport that never ended its write: a bug, reported, not a hang
                logger.error("releasing %s with a payload still in flight past its lease", request_id)

    # --- the transport's side --------------------------------------------------------------
    def landing_stream(self) -> contextlib.AbstractContextManager[None]:
        """What a transport's serving thread runs inside: with a GPU cache, the thread's device set
        and its work on its own transfer stream (a receive into the blocks queued there is settled
        before the chunk counts as landed), never the compute stream."""
        return on_transfer_stream(self._device)

    def apply(
        self,
        raw_header: bytes,
        payload: memoryview | bytes | torch.Tensor,
        regions: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        """Verify one chunk and write it. Raises TransferRefused with the reason; writes nothing then
        (a pulled chunk whose checksum fails has written into its own request's blocks only, and
        fails that request). ``payload``: host bytes, or a flat uint8 tensor on this cache's GPU
        (what an NCCL receive fills), landed from there without a trip through the host.

        ``regions``: the sender's memory this transport mapped (region id -> flat uint8 tensor),
        from which a pulled chunk (``header.pulled``) is read in place instead of from ``payload``.
        """
        # The copies stay under the lock: once release() returns, no chunk of that request can
        # still be writing into blocks the engine is about to reuse. On a GPU they run on this
        # thread's transfer stream, settled before the lock is let go: poll() (under the lock)
        # sees a chunk landed only once its bytes are in the blocks.
        with self._lock, on_transfer_stream(self._device), _settled(self._device):
            incoming, header = self._checks.authenticate(raw_header)
            self._completion.learn_senders(incoming, header)
            if header.kind == "done":
                self._completion.on_done(incoming, header)
                return
            layers = self._checks.layers_of(header, payload_batch=not header.pulled)
            if len(layers) > 1 and not header.pulled:
                self._copied.land_batch(incoming, layers, payload)
            elif len(layers) > 1 and self._stacked is not None:
                self._land_pulled_batch(incoming, layers, regions)
            else:
                for layer_header in layers:
                    if layer_header.pulled:
                        self._pulled.land(incoming, layer_header, regions)
                    else:
                        self._copied.land(incoming, layer_header, payload)

    def check_header(self, raw_header: bytes, nbytes: int) -> None:
        """Refuse (TransferRefused) a chunk whose header is not authentic, or whose payload of
        ``nbytes`` is larger than its ticket's blocks of every layer could hold, before a transport
        allocates or reads that payload. ``apply`` checks everything again."""
        with self._lock:
            self._checks.payload_fits(raw_header, nbytes)

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
            incoming, header = self._checks.authenticate(raw_header)
            if header.kind != "layer" or header.pulled or header.run_lengths is None:
                self._checks.refuse("malformed", "a chunk received in place names its layers and block runs")
            self._completion.learn_senders(incoming, header)
            return self._direct.begin(incoming, header, nbytes, num_pieces, abort)

    def end_direct(self, write: DirectWrite, received: bool, reason: str = "") -> None:
        """The transport is done with ``write``'s targets: every byte received (``received``) or the
        payload failed midway (``reason``; the request fails). Raises TransferRefused like ``apply``."""
        # Checksums outside the lock (a chunk may be hundreds of MB): the blocks stay reserved
        # until the write ends below, so nothing else can touch them meanwhile.
        with on_transfer_stream(self._device):
            # What the transport received into the blocks on this thread's stream (an NCCL receive
            # queues it there) is in them before anything counts as landed.
            settle(self._device)
            intact = self._direct.verify(write, received)
        with self._lock:
            owner = write.incoming
            owner.end_write(write)
            self._writes_ended.notify_all()  # release() may be waiting for this write to end
            if self._tickets.incoming.get(write.request_id) is not owner:
                self._checks.refuse("terminal", f"transfer of {write.request_id} was released during its payload")
            first = write.layers[0].layer
            if not received:
                owner.fail(f"layer {first}+ payload not received: {reason}")
                self._checks.refuse("payload", f"layer {first}+ payload not received: {reason}")
            if owner.state.is_terminal:
                self._checks.refuse("terminal", f"transfer of {write.request_id} already {owner.state.name}")
            bad = intact.index(False) if False in intact else len(intact)
            self._land_before(owner, write.layers, write.keys, bad)

    # --- helpers (hold the lock) -----------------------------------------------------------
    def _land_pulled_batch(
        self, incoming: IncomingTransfer, layers: list[ChunkHeader], regions: Mapping[int, torch.Tensor] | None
    ) -> None:
        """Several pulled layers, a group of them per copy; the lock is let go between groups."""
        groups = self._pulled.plan_batch(incoming, layers, regions, _MAX_LOCKED_COPY_BYTES)
        for i, group in enumerate(groups):
            if i:
                # Let poll() and expect() in between groups: a decode step must not wait behind a
                # whole batch. The request may have ended meanwhile: then nothing more is written.
                settle(self._device)  # what poll() may now see landed is in the blocks
                self._lock.release()
                self._lock.acquire()
                request_id = layers[0].request_id
                if self._tickets.incoming.get(request_id) is not incoming or incoming.state.is_terminal:
                    self._checks.refuse("terminal", f"transfer of {request_id} ended during its batch")
            bad = self._pulled.copy_group(incoming, group)
            self._land_before(incoming, group.layers, group.keys, bad)

    def _land_before(
        self, incoming: IncomingTransfer, headers: list[ChunkHeader], keys: list[ChunkKey], bad: int
    ) -> None:
        """Chunks written in place whose checksums were checked: those before index ``bad`` land;
        the one at ``bad`` (if any) failed its checksum and fails the request."""
        landed = headers[:bad]
        self._landed(incoming, landed, keys[:bad], sum(h.nbytes for h in landed), in_place=True)
        if bad < len(headers):
            self._checks.checksum_failed(incoming, headers[bad])

    def _landed(
        self, incoming: IncomingTransfer, headers: list[ChunkHeader], keys: list[ChunkKey], nbytes: int, in_place: bool
    ) -> None:
        self._completion.landed(incoming, headers, keys, nbytes, in_place)

    def _fail(self, incoming: IncomingTransfer, reason: str) -> None:  # a test ends a transfer mid-batch with it
        incoming.fail(reason)
