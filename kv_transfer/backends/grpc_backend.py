"""gRPC transport: one call per chunk, served by the ``KVTransfer`` service of ``protos/kv_transfer.proto``.

    sender thread   KVChannel.send(header, payload, timeout_s)
                      ├─ small payload:  PushSingle(Piece{header, payload_size, data})
                      └─ otherwise:      Push(stream Piece): [header, payload_size] [slice 0] … [slice n]
    server worker     refuse payload_size > max_payload_bytes (before allocating)
                      copy the slices into one reused assembly buffer (a lone slice is used as it came)
                      KVReceiver.apply(header, buffer) ──▶ Ack{ok, reason}

A chunk sent in place (``send_pieces``: equal TP degrees, from the sender's cache itself) has
``in_place`` set on its header piece: the server checks the header (``KVReceiver.begin_direct``)
and copies each slice as it arrives straight into the reserved blocks, so neither side gathers,
assembles or scatters. A receiver that cannot (a non-contiguous cache) answers ``declined`` and is
sent copies from then on.

Every call carries a deadline (the sender's ``timeout_s``), and the server keeps its own, whatever
the caller asked (``kv_transfer.backends.call_deadlines``): a call whose header piece has not come
within ``first_piece_s`` is cancelled, and any call after ``max_call_s``; one peer address holds at
most ``max_calls_per_peer`` server threads (default: all but one), and the connection's keepalive
pings are limited. Silent streams then hold a thread for seconds, not for ever. Errors map onto the
KVChannel contract:
Ack{ok=false} → TransferRefused, DEADLINE_EXCEEDED → TimeoutError, any other gRPC status (peer gone,
connection refused, cancelled, overloaded) → ConnectionError.

Speed: outside gRPC each payload byte is copied once per side. Data-only pieces are encoded and
decoded by hand (one length-delimited field, wire-compatible with ``Piece``) because protobuf would
copy each slice three times; the slices of small pieces (the per-layer runs of a short transfer)
share a message, since grpcio spends ~0.1 ms a message here whatever its size, so any CPU piece
goes in place. Small chunks take the unary call because gRPC starts a thread for every
client stream. The assembly buffer is kept per server thread, so ``KVReceiver.apply`` must copy the
payload out before it returns (it does: it writes it into the cache). Channels are plaintext:
chunks are authenticated by their HMAC-signed header, not encrypted; serve on loopback or a
trusted network.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from common.openmp import run_tensor_ops_serially
from kv_transfer.backends.call_deadlines import CallDeadlines
from kv_transfer.receiver import KVReceiver, NotInPlace
from kv_transfer.transport import KVChannel, KVTransport, TransferRefused
from protos import kv_transfer_pb2

logger = logging.getLogger(__name__)

SCHEME = "grpc://"
DEFAULT_PIECE_BYTES = 1 << 20
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30
DEFAULT_MAX_REUSED_BYTES = 64 << 20
SINGLE_MAX_BYTES = 64 << 10  # payloads up to this (and up to one piece) take the unary PushSingle
_MESSAGE_SLACK = 64 << 10  # room for the header and framing on top of one slice

Piece = kv_transfer_pb2.Piece
Ack = kv_transfer_pb2.Ack
_SERVICE = kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
_DATA_TAG = bytes([3 << 3 | 2])  # Piece.data: field 3, length-delimited


# The server's side of a connection: no pings from clients between calls, none more often than
# every 10 s (two strikes close the connection), and a connection idle for 5 minutes is closed.
_SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.max_connection_idle_ms", 300_000),
]


def _peer_host(peer: str) -> str:
    """``ipv4:127.0.0.1:5000`` -> ``127.0.0.1``; ``ipv6:[::1]:5000`` -> ``::1``."""
    address = peer.split(":", 1)[1] if ":" in peer else peer
    if address.startswith("["):
        return address[1 : address.find("]")]
    return address.rsplit(":", 1)[0]


def _channel_options(piece_bytes: int) -> list[tuple[str, int]]:
    largest = max(piece_bytes, SINGLE_MAX_BYTES)
    return [
        ("grpc.max_send_message_length", largest + _MESSAGE_SLACK),
        ("grpc.max_receive_message_length", largest + _MESSAGE_SLACK),
        # Read whole slices off the socket instead of gRPC's default small reads.
        ("grpc.experimental.tcp_read_chunk_size", largest),
        ("grpc.experimental.tcp_max_read_chunk_size", 4 * largest),
    ]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _encode_pieces(header: bytes, parts: list[memoryview], piece_bytes: int, in_place: bool = False) -> Iterator[bytes]:
    """The Push stream, serialized: a header piece, then data-only pieces of at most ``piece_bytes``
    (a part's slices; the payload is the parts one after another)."""
    size = sum(len(part) for part in parts)
    yield Piece(header=header, payload_size=size, in_place=in_place).SerializeToString()
    # Small slices of consecutive parts share a piece (grpcio costs ~0.1 ms a message here, whatever
    # its size); a slice never straddles two pieces, so large parts go as before, one slice each.
    batch: list[memoryview] = []
    filled = 0
    for part in parts:
        for start in range(0, len(part), piece_bytes):
            piece = part[start : start + piece_bytes]
            if batch and filled + len(piece) > piece_bytes:
                yield b"".join((_DATA_TAG, _varint(filled), *batch))  # the one copy of these slices
                batch, filled = [], 0
            batch.append(piece)
            filled += len(piece)
    if batch:
        yield b"".join((_DATA_TAG, _varint(filled), *batch))


def _decode_piece(raw: bytes) -> Piece | memoryview:
    """A data-only piece as a view of the received bytes (no copy); any other piece through protobuf."""
    if raw[:1] == _DATA_TAG:
        length, pos, shift = 0, 1, 0
        while pos < len(raw) and shift < 64:
            byte = raw[pos]
            length |= (byte & 0x7F) << shift
            pos += 1
            shift += 7
            if byte < 0x80:
                if pos + length == len(raw):
                    return memoryview(raw)[pos:]
                break
    return Piece.FromString(raw)


def _allocate(num_bytes: int) -> bytearray:
    """Every assembly buffer comes from here (a seam for tests that check refusals allocate nothing)."""
    return bytearray(num_bytes)


@dataclass(frozen=True)
class CallLimits:
    first_piece_s: float = 5.0  # a call whose header piece has not come by then is cancelled
    max_call_s: float = 120.0  # any call, after its header: a lease is 30 s plus a prompt's share
    max_calls_per_peer: int = 7  # server threads one peer address may hold at once


class _KVTransferServicer:
    """Serves one receiver on the server's worker threads, one chunk per call."""

    def __init__(
        self,
        receiver: KVReceiver,
        max_payload_bytes: int,
        max_reused_bytes: int,
        deadlines: CallDeadlines,
        limits: CallLimits,
    ) -> None:
        self.receiver = receiver
        self.max_payload_bytes = max_payload_bytes
        self.max_reused_bytes = max_reused_bytes
        self.deadlines = deadlines
        self.limits = limits
        self._local = threading.local()
        self._lock = threading.Lock()
        self._calls_by_peer: dict[str, int] = {}

    def push(self, pieces: Iterator[Piece | memoryview], context: grpc.ServicerContext) -> Ack:
        peer = _peer_host(context.peer())
        with self._lock:
            calls = self._calls_by_peer.get(peer, 0)
            if calls >= self.limits.max_calls_per_peer:
                return Ack(ok=False, reason=f"{calls} calls from {peer} are in progress here (max_calls_per_peer)")
            self._calls_by_peer[peer] = calls + 1
        key = self.deadlines.watch(time.monotonic() + self.limits.first_piece_s, context.cancel)
        try:
            return self._push(pieces, context, key)
        finally:
            self.deadlines.end(key)
            with self._lock:
                left = self._calls_by_peer[peer] - 1
                if left:
                    self._calls_by_peer[peer] = left
                else:
                    del self._calls_by_peer[peer]

    def _push(self, pieces: Iterator[Piece | memoryview], context: grpc.ServicerContext, key: int) -> Ack:
        try:
            first = next(pieces, None)
            if not isinstance(first, Piece):
                raise TransferRefused("a chunk must start with its header piece")
            self.deadlines.move(key, time.monotonic() + self.limits.max_call_s)
            with self.receiver.landing_stream():  # a GPU cache's copies off the compute stream
                if first.in_place:
                    self._receive_in_place(first, pieces, context)
                else:
                    self.receiver.apply(first.header, self._assemble(first, pieces))
        except NotInPlace as exc:
            return Ack(ok=False, reason=str(exc), declined=True)
        except TransferRefused as exc:
            return Ack(ok=False, reason=str(exc))
        except grpc.RpcError:  # the sender went away or a deadline passed: nobody reads this answer
            return Ack(ok=False, reason="the chunk was cancelled before it arrived")
        except Exception as exc:  # a receiver bug refuses this chunk; the server keeps serving
            logger.exception("KV receiver failed on a chunk")
            return Ack(ok=False, reason=f"receiver error: {type(exc).__name__}: {exc}")
        return Ack(ok=True)

    def push_single(self, piece: Piece, context: grpc.ServicerContext) -> Ack:
        return self.push(iter((piece,)), context)

    def _receive_in_place(
        self, first: Piece, pieces: Iterator[Piece | memoryview], context: grpc.ServicerContext
    ) -> None:
        """Each slice is copied as it arrives straight into the reserved blocks (no assembly buffer:
        one copy on this side). The receiver checked the header first; nothing is allocated. If the
        request is released meanwhile (a stalled sender, an aborted request), the call is cancelled."""
        write = self.receiver.begin_direct(first.header, first.payload_size, None, abort=context.cancel)
        try:
            views = write.views()
            targets: list[memoryview] | list[torch.Tensor] = views if views is not None else write.targets
            index, offset, filled, size = 0, 0, 0, first.payload_size
            data = first.data
            while filled < size:
                if not data:
                    data = self._next_data(pieces, filled, size)
                view = memoryview(data)
                while len(view):
                    if index == len(targets):
                        raise TransferRefused(f"payload overruns its declared {size} bytes")
                    target = targets[index]
                    n = min(len(view), len(target) - offset)
                    if isinstance(target, memoryview):
                        target[offset : offset + n] = view[:n]
                    else:  # a GPU cache
                        target.narrow(0, offset, n).copy_(torch.frombuffer(view[:n], dtype=torch.uint8))
                    view, offset, filled = view[n:], offset + n, filled + n
                    if offset == len(target):
                        index, offset = index + 1, 0
                data = b""
            if next(pieces, None) is not None:
                raise TransferRefused(f"payload overruns its declared {size} bytes")
        except BaseException as exc:
            with contextlib.suppress(TransferRefused):
                self.receiver.end_direct(write, received=False, reason=str(exc) or type(exc).__name__)
            raise
        self.receiver.end_direct(write, received=True)

    def _assemble(self, first: Piece, pieces: Iterator[Piece | memoryview]) -> bytes | memoryview:
        size = first.payload_size
        if size > self.max_payload_bytes:
            raise TransferRefused(f"payload of {size} bytes exceeds this receiver's limit of {self.max_payload_bytes}")
        self.receiver.check_header(first.header, size)  # before anything is allocated for it
        data = first.data
        if not data and size:
            data = self._next_data(pieces, 0, size)
        if len(data) == size:
            return data  # one slice: hand it over as it arrived
        buf = self._buffer(size)
        filled = 0
        while True:
            if filled + len(data) > size:
                raise TransferRefused(f"payload overruns its declared {size} bytes")
            buf[filled : filled + len(data)] = data
            filled += len(data)
            if filled == size:
                return buf
            data = self._next_data(pieces, filled, size)

    @staticmethod
    def _next_data(pieces: Iterator[Piece | memoryview], filled: int, size: int) -> bytes | memoryview:
        piece = next(pieces, None)
        if piece is None:
            raise TransferRefused(f"chunk stream ended after {filled} of {size} payload bytes")
        return piece if isinstance(piece, memoryview) else piece.data

    def _buffer(self, size: int) -> memoryview:
        if size > self.max_reused_bytes:
            return memoryview(_allocate(size))
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._local.buf = _allocate(size)
        return memoryview(buf)[:size]


class _GrpcChannel(KVChannel):
    """Connects on the first send and reuses the gRPC channel; one sender thread at a time."""

    # Small pieces share a message (_encode_pieces): a piece costs this side nothing of its own. A
    # receiver with a GPU cache copies each slice up to the device by itself (a few us each).
    in_place_min_piece_bytes = 0

    def __init__(self, endpoint: str, piece_bytes: int) -> None:
        self.sends_in_place = True  # until the receiver declines it once
        self.endpoint = endpoint
        self.piece_bytes = piece_bytes
        self.single_max_bytes = min(SINGLE_MAX_BYTES, piece_bytes)
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._calls: tuple[grpc.StreamUnaryMultiCallable, grpc.UnaryUnaryMultiCallable] | None = None

    def _connect(self) -> tuple[grpc.StreamUnaryMultiCallable, grpc.UnaryUnaryMultiCallable]:
        with self._lock:
            if self._calls is None:
                target = self.endpoint.removeprefix(SCHEME)
                self._channel = grpc.insecure_channel(target, options=_channel_options(self.piece_bytes))
                push = self._channel.stream_unary(f"/{_SERVICE}/Push", response_deserializer=Ack.FromString)
                push_single = self._channel.unary_unary(
                    f"/{_SERVICE}/PushSingle",
                    request_serializer=Piece.SerializeToString,
                    response_deserializer=Ack.FromString,
                )
                self._calls = (push, push_single)
            return self._calls

    def send(self, header: bytes, payload: memoryview | bytes, timeout_s: float, tag: str | None = None) -> None:
        view = memoryview(payload)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        push, push_single = self._connect()
        if len(view) <= self.single_max_bytes:
            piece = Piece(header=bytes(header), payload_size=len(view), data=bytes(view))
            ack = self._call(lambda: push_single(piece, timeout=timeout_s), timeout_s)
        else:
            ack = self._call(
                lambda: push(_encode_pieces(bytes(header), [view], self.piece_bytes), timeout=timeout_s), timeout_s
            )
        if not ack.ok:
            raise TransferRefused(ack.reason)

    def send_pieces(self, header: bytes, pieces: list[torch.Tensor], timeout_s: float, tag: str | None = None) -> bool:
        if not self.sends_in_place or any(piece.device.type != "cpu" for piece in pieces):
            return False
        parts = [memoryview(piece.reshape(-1).view(torch.uint8).numpy()) for piece in pieces]
        push, _ = self._connect()
        ack = self._call(
            lambda: push(_encode_pieces(bytes(header), parts, self.piece_bytes, in_place=True), timeout=timeout_s),
            timeout_s,
        )
        if ack.declined:
            logger.info("%s takes no chunks in place (%s): sending copies", self.endpoint, ack.reason)
            self.sends_in_place = False
            return False
        if not ack.ok:
            raise TransferRefused(ack.reason)
        return True

    def _call(self, call, timeout_s: float) -> Ack:
        try:
            return call()
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"no verdict from {self.endpoint} within {timeout_s:.1f}s") from exc
            detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            raise ConnectionError(f"gRPC {code.name if code else 'error'} from {self.endpoint}: {detail}") from exc

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = None
            self._calls = None


class GrpcTransport(KVTransport):
    """One gRPC server per served receiver, bounded by ``max_workers`` threads and ``max_concurrent_rpcs``.

    Memory per server: a running call holds at most ``max_payload_bytes``; each worker thread keeps
    its assembly buffer for reuse up to ``max_reused_bytes``. Calls beyond ``max_concurrent_rpcs``
    (default 4 × ``max_workers``) are rejected with RESOURCE_EXHAUSTED: the sender sees ConnectionError.
    """

    name = "grpc"

    def __init__(
        self,
        max_workers: int = 8,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        *,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
        max_concurrent_rpcs: int | None = None,
        max_reused_bytes: int = DEFAULT_MAX_REUSED_BYTES,
        first_piece_s: float = CallLimits.first_piece_s,
        max_call_s: float = CallLimits.max_call_s,
        max_calls_per_peer: int | None = None,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers}: need at least 1 server thread")
        if max_payload_bytes < 0:
            raise ValueError(f"max_payload_bytes={max_payload_bytes}: must be >= 0 (default 1 GiB)")
        if not 1 <= piece_bytes <= 64 << 20:
            raise ValueError(f"piece_bytes={piece_bytes}: must be in [1, 64 MiB] (default 1 MiB)")
        self.max_workers = max_workers
        self.max_payload_bytes = max_payload_bytes
        self.piece_bytes = piece_bytes
        self.max_concurrent_rpcs = max_concurrent_rpcs if max_concurrent_rpcs is not None else 4 * max_workers
        self.max_reused_bytes = max_reused_bytes
        if not (first_piece_s > 0 and max_call_s > 0):
            raise ValueError(f"first_piece_s={first_piece_s}, max_call_s={max_call_s}: must be > 0 seconds")
        if max_calls_per_peer is not None and max_calls_per_peer < 1:
            raise ValueError(f"max_calls_per_peer={max_calls_per_peer}: must be >= 1")
        # One thread is always left to the other peers of a server.
        per_peer = max_calls_per_peer if max_calls_per_peer is not None else max(1, max_workers - 1)
        self.limits = CallLimits(first_piece_s, max_call_s, per_peer)
        self.deadlines = CallDeadlines("kv-grpc")
        self._lock = threading.Lock()
        self._servers: list[grpc.Server] = []
        self._channels: weakref.WeakSet[_GrpcChannel] = weakref.WeakSet()

    def serve(self, receiver: KVReceiver, host: str = "127.0.0.1") -> str:
        """Binds ``host`` (loopback unless the caller asks otherwise) on a free port.

        The server runs until ``shutdown`` or until this transport is garbage-collected: hold it.
        """
        server = grpc.server(
            # Its threads land KV: the engine thread owns the process's OpenMP team.
            ThreadPoolExecutor(
                max_workers=self.max_workers, thread_name_prefix="kv-grpc", initializer=run_tensor_ops_serially
            ),
            options=_channel_options(self.piece_bytes) + _SERVER_OPTIONS,
            maximum_concurrent_rpcs=self.max_concurrent_rpcs,
        )
        servicer = _KVTransferServicer(
            receiver, self.max_payload_bytes, self.max_reused_bytes, self.deadlines, self.limits
        )
        handlers = {
            "Push": grpc.stream_unary_rpc_method_handler(
                servicer.push, request_deserializer=_decode_piece, response_serializer=Ack.SerializeToString
            ),
            "PushSingle": grpc.unary_unary_rpc_method_handler(
                servicer.push_single, request_deserializer=Piece.FromString, response_serializer=Ack.SerializeToString
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
        address = f"[{host}]" if ":" in host else host
        try:
            port = server.add_insecure_port(f"{address}:0")
        except RuntimeError as exc:
            raise ConnectionError(f"cannot bind a KV transfer server on {host}: {exc}") from exc
        if port == 0:
            raise ConnectionError(f"cannot bind a KV transfer server on {host}")
        server.start()
        with self._lock:
            self._servers.append(server)
        return f"{SCHEME}{address}:{port}"

    def connect(self, endpoint: str) -> KVChannel:
        if not endpoint.startswith(SCHEME):
            raise ValueError(f"not a gRPC KV endpoint: {endpoint!r} (expected grpc://host:port)")
        channel = _GrpcChannel(endpoint, self.piece_bytes)
        with self._lock:
            self._channels.add(channel)
        return channel

    def shutdown(self) -> None:
        """Closes this transport's channels and stops its servers (in-flight calls get 1 s)."""
        with self._lock:
            servers, self._servers = self._servers, []
            channels = list(self._channels)
            self._channels.clear()
        for channel in channels:
            channel.close()
        stopped = [server.stop(grace=1.0) for server in servers]
        for event in stopped:
            event.wait(timeout=2.0)
        self.deadlines.stop()
