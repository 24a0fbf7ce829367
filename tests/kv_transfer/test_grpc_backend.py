"""The gRPC backend beyond the shared transfer tests: streamed chunks, the wire format, loopback-only
serving, payload limits, deadlines, and peers that die mid-transfer (real processes, SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from pathlib import Path

import grpc
import msgpack
import pytest
import torch

from kv_transfer import KVReceiver, KVTicket, TransferState, make_ticket
from kv_transfer.backends import grpc_backend
from kv_transfer.backends.grpc_backend import GrpcTransport
from kv_transfer.protocol import ChunkHeader, encode_header
from kv_transfer.transport import TransferRefused
from protos import kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.kv_transfer.harness import (
    a_killed_receiver_fails_the_sender,
    assert_bit_exact,
    made_transports,
    make_side,
    transfer,
    wait_terminal,
)
from tests.kv_transfer.processes import RECEIVER_SCRIPT, read_line, sender_script


@pytest.fixture
def transports():
    yield from made_transports(GrpcTransport)


def _layer_chunk(ticket: KVTicket, layer: int, value: float = 1.0) -> tuple[bytes, bytes]:
    """A signed chunk for one layer of the harness's default single-shard layout."""
    nb = ticket.num_blocks
    payload = torch.full((2, nb, 4, 2, 8), value).numpy().tobytes()
    header = ChunkHeader(
        kind="layer",
        request_id=ticket.request_id,
        sender_rank=0,
        sender_tp=1,
        receiver_rank=0,
        layer=layer,
        num_heads=2,
        num_blocks=nb,
        nbytes=len(payload),
    )
    return encode_header(header, ticket.secret), payload


def _serve_one(transport: GrpcTransport, lease_s: float = 30.0):
    dst, _ = make_side(1, fill=False)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], "grpc")
    endpoint = transport.serve(receiver)
    ticket = make_ticket("req-1", "grpc", [endpoint], dst.layouts[0], "m", [1, 2, 3, 4], 13, lease_s)
    receiver.expect(ticket)
    return receiver, ticket, dst


# --- streamed chunks and the wire format ----------------------------------------------------------


@pytest.mark.parametrize("piece_bytes", [1000, 16 << 10, grpc_backend.DEFAULT_PIECE_BYTES])
def test_streamed_chunks_are_bit_exact(transports, piece_bytes):
    # 100 tokens (7 blocks of 16) of 2 heads x 64 dims in fp32: 112 KiB per receiver shard and layer.
    # 1000-byte pieces: 115 per chunk; 16 KiB: 7; 1 MiB: one data piece, used without assembly.
    t = transports(piece_bytes=piece_bytes)
    receivers, senders, ticket, full, dst, src_blocks = transfer(
        t, 1, 2, num_layers=4, total_kv_heads=4, head_dim=64, block_size=16, num_blocks=32, num_tokens=100
    )
    states = wait_terminal([lambda r=r: r.poll("req-1") for r in receivers] + [lambda: senders[0].poll("req-1")])
    assert all(s.state is TransferState.DONE for s in states), [(s.state, s.reason) for s in states]
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    senders[0].close()


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 70_000])
def test_hand_encoded_pieces_are_protobuf_pieces(size):
    payload = memoryview(os.urandom(size))
    raw = list(grpc_backend._encode_pieces(b"hdr", [payload], piece_bytes=1 << 20))
    first = kv_transfer_pb2.Piece.FromString(raw[0])
    assert (first.header, first.payload_size, first.data) == (b"hdr", size, b"")
    assert b"".join(kv_transfer_pb2.Piece.FromString(r).data for r in raw[1:]) == bytes(payload)
    # The server's fast path reads back exactly what protobuf would, from our pieces and from stock ones.
    assert b"".join(_decoded_data(r) for r in raw[1:]) == bytes(payload)
    assert _decoded_data(kv_transfer_pb2.Piece(data=bytes(payload)).SerializeToString()) == bytes(payload)
    assert isinstance(grpc_backend._decode_piece(raw[0]), kv_transfer_pb2.Piece)


@pytest.mark.parametrize("piece_bytes", [7, 1000, 4096])
def test_small_slices_share_pieces(piece_bytes):
    # The per-layer runs of a short transfer are small: packed into shared pieces, never one each.
    sizes = (300, 1, 2500, 0, 999, 64, 5000)
    parts = [memoryview(os.urandom(n)) for n in sizes]
    raw = list(grpc_backend._encode_pieces(b"hdr", parts, piece_bytes=piece_bytes))
    data = [_decoded_data(r) for r in raw[1:]]
    assert b"".join(data) == b"".join(bytes(p) for p in parts)
    assert kv_transfer_pb2.Piece.FromString(raw[0]).payload_size == sum(sizes)
    assert all(0 < len(d) <= piece_bytes for d in data)
    # A part's slices: cut only at multiples of piece_bytes, so never across two pieces.
    slices = [min(piece_bytes, n - start) for n in sizes for start in range(0, n, piece_bytes)]
    assert len(data) < len(slices) if piece_bytes >= 1000 else len(data) <= len(slices)
    packed, at = [], 0
    for d in data:  # every piece is whole slices laid end to end
        run = 0
        while run < len(d):
            run += slices[at]
            at += 1
        packed.append(run == len(d))
    assert all(packed) and at == len(slices)


def _decoded_data(raw: bytes) -> bytes:
    piece = grpc_backend._decode_piece(raw)
    return bytes(piece) if isinstance(piece, memoryview) else piece.data


def test_generated_stub_interoperates(transports):
    # A client of the generated code (protobuf-encoded pieces, data split oddly) against our server.
    receiver, ticket, dst = _serve_one(transports())
    header, payload = _layer_chunk(ticket, layer=0, value=2.0)
    pieces = [kv_transfer_pb2.Piece(header=header, payload_size=len(payload), data=payload[:100])]
    pieces += [kv_transfer_pb2.Piece(data=payload[i : i + 700]) for i in range(100, len(payload), 700)]
    with grpc.insecure_channel(ticket.receiver_endpoints[0].removeprefix("grpc://")) as channel:
        ack = kv_transfer_pb2_grpc.KVTransferStub(channel).Push(iter(pieces), timeout=5)
    assert ack.ok, ack.reason
    assert receiver.poll("req-1").layers_complete == 1
    assert torch.all(dst.caches[0][0][:, [1, 2, 3, 4]] == 2.0)


def _silent_stream(endpoint: str, opened: list, release: threading.Event):
    """A Push call that sends nothing until ``release`` (no client deadline): a peer holding a thread."""
    channel = grpc.insecure_channel(endpoint.removeprefix("grpc://"))
    opened.append(channel)

    def nothing():
        release.wait(60)
        return
        yield

    return kv_transfer_pb2_grpc.KVTransferStub(channel).Push.future(nothing())


def test_silent_streams_are_cancelled_soon_and_one_peer_never_holds_every_thread(transports):
    """8 Push calls that send nothing and set no deadline (7f34ac8: they held all 8 server threads
    for as long as they stayed open): the eighth is refused at once (one thread stays free for
    other peers), the others cancelled after first_piece_s; then chunks are served as before."""
    server = transports(max_workers=8, first_piece_s=1.0)
    assert server.limits.max_calls_per_peer == 7
    _receiver, ticket, dst = _serve_one(server)
    opened: list = []
    release = threading.Event()
    try:
        started = time.monotonic()
        silent = [_silent_stream(ticket.receiver_endpoints[0], opened, release) for _ in range(8)]
        outcomes = []
        for future in silent:
            error = future.exception(timeout=10)
            outcomes.append(error.code() if error is not None else future.result().reason)
        assert time.monotonic() - started < 5.0
        assert outcomes.count(grpc.StatusCode.CANCELLED) == 7, outcomes
        assert sum("max_calls_per_peer" in str(o) for o in outcomes) == 1, outcomes
        assert server.deadlines.num_cancelled == 7
        header, payload = _layer_chunk(ticket, layer=0, value=3.0)
        transports().connect(ticket.receiver_endpoints[0]).send(header, payload, 10)
        assert torch.all(dst.caches[0][0][:, [1, 2, 3, 4]] == 3.0)
    finally:
        release.set()
        for channel in opened:
            channel.close()


def test_peers_are_counted_by_address():
    assert grpc_backend._peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert grpc_backend._peer_host("ipv6:[::1]:5000") == "::1"
    assert grpc_backend._peer_host("unix:/tmp/x") == "/tmp/x"


# --- serving: loopback only, bounded memory ---------------------------------------------------------


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on ``port`` (Linux /proc/net, hex as the kernel writes)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.add(address)
    return found


def test_serves_on_loopback_only(transports):
    endpoint = transports().serve(KVReceiver(*_one_shard()))
    host, port = endpoint.removeprefix("grpc://").rsplit(":", 1)
    assert host == "127.0.0.1"
    socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()
    if sys.platform != "linux":
        pytest.skip("/proc/net and 127.0.0.2 are Linux-only checks")
    # 127.0.0.1 only, as IPv4 or IPv6-mapped (gRPC may bind a dual-stack socket): no 0.0.0.0, no ::
    listening = _listening_addresses(int(port))
    assert listening and listening <= {"0100007F", "0000000000000000FFFF00000100007F"}, listening
    with pytest.raises(OSError):  # the rest of 127/8 reaches this host but not this server
        socket.create_connection(("127.0.0.2", int(port)), timeout=2).close()


def _one_shard():
    dst, _ = make_side(1, fill=False)
    return dst.caches[0], dst.layouts[0]


def test_oversized_payload_is_refused_before_allocating(transports, monkeypatch):
    allocations: list[int] = []
    real_allocate = grpc_backend._allocate
    monkeypatch.setattr(grpc_backend, "_allocate", lambda n: allocations.append(n) or real_allocate(n))

    # A declared size of 1 TiB (the default limit is 1 GiB) from a raw client: refused, nothing allocated.
    receiver, ticket, _ = _serve_one(transports())
    header, _ = _layer_chunk(ticket, layer=0)
    huge = kv_transfer_pb2.Piece(header=header, payload_size=1 << 40)
    with grpc.insecure_channel(ticket.receiver_endpoints[0].removeprefix("grpc://")) as channel:
        ack = kv_transfer_pb2_grpc.KVTransferStub(channel).Push(iter([huge]), timeout=5)
    assert not ack.ok and "exceeds" in ack.reason

    # Through a channel, against a server with a small limit: TransferRefused, nothing allocated.
    small = transports(max_payload_bytes=1024, piece_bytes=512)
    receiver, ticket, dst = _serve_one(small)
    header, payload = _layer_chunk(ticket, layer=0)  # 2 KiB, streamed in 512-byte pieces
    assert len(payload) == 2048
    with pytest.raises(TransferRefused, match="exceeds this receiver's limit of 1024"):
        transports(piece_bytes=512).connect(ticket.receiver_endpoints[0]).send(header, payload, 5)
    assert allocations == []
    assert sum(receiver.refusals.values()) == 0  # the receiver never saw it
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])


def test_forged_chunk_is_refused_before_allocating(transports, monkeypatch):
    allocations: list[int] = []
    real_allocate = grpc_backend._allocate
    monkeypatch.setattr(grpc_backend, "_allocate", lambda n: allocations.append(n) or real_allocate(n))
    receiver, ticket, dst = _serve_one(transports())
    forged = encode_header(
        ChunkHeader(kind="layer", request_id="req-1", sender_rank=0, sender_tp=1, receiver_rank=0), b"x"
    )
    pieces = [kv_transfer_pb2.Piece(header=forged, payload_size=512 << 20, data=bytes(1024))]  # claims 512 MiB
    with grpc.insecure_channel(ticket.receiver_endpoints[0].removeprefix("grpc://")) as channel:
        ack = kv_transfer_pb2_grpc.KVTransferStub(channel).Push(iter(pieces), timeout=5)
    assert not ack.ok and "signature" in ack.reason
    assert allocations == [] and receiver.refusals["bad_signature"] == 1
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])


def test_short_stream_is_refused_and_writes_nothing(transports):
    receiver, ticket, dst = _serve_one(transports())
    header, payload = _layer_chunk(ticket, layer=0)
    pieces = [kv_transfer_pb2.Piece(header=header, payload_size=len(payload), data=payload[:1000])]
    with grpc.insecure_channel(ticket.receiver_endpoints[0].removeprefix("grpc://")) as channel:
        ack = kv_transfer_pb2_grpc.KVTransferStub(channel).Push(iter(pieces), timeout=5)
    assert not ack.ok and "ended after 1000" in ack.reason
    assert sum(receiver.refusals.values()) == 0  # the receiver never saw the partial chunk
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])


# --- deadlines and dead peers -------------------------------------------------------------------------


class _StuckReceiver:
    def __init__(self) -> None:
        self.release = threading.Event()

    def check_header(self, raw_header, nbytes) -> None:
        pass

    def apply(self, raw_header, payload) -> None:
        self.release.wait(10)

    def landing_stream(self):
        return contextlib.nullcontext()


def test_deadline_gives_timeout_error(transports):
    stuck = _StuckReceiver()
    endpoint = transports().serve(stuck)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        transports().connect(endpoint).send(b"h", b"x" * 10, 0.3)
    assert time.monotonic() - start < 3
    stuck.release.set()


def test_dead_endpoint_fails_fast(transports):
    server = transports()
    _, ticket, _ = _serve_one(server)
    channel = transports().connect(ticket.receiver_endpoints[0])
    header, payload = _layer_chunk(ticket, layer=0)
    channel.send(header, payload, 5)  # connected and working
    server.shutdown()
    start = time.monotonic()
    with pytest.raises(ConnectionError):
        channel.send(header, payload, 30)
    assert time.monotonic() - start < 5, "a dead endpoint must fail fast, not wait out the deadline"

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    with pytest.raises(ConnectionError):
        transports().connect(f"grpc://127.0.0.1:{free_port}").send(header, payload, 30)
    assert time.monotonic() - start < 10


def test_connect_rejects_foreign_endpoints():
    with pytest.raises(ValueError, match="grpc://"):
        GrpcTransport().connect("inproc://0")


# --- peers in other processes, killed mid-transfer ---------------------------------------------------

_SENDER_SCRIPT = sender_script(
    "from kv_transfer.backends.grpc_backend import GrpcTransport",
    "GrpcTransport()",
    """
import grpc
from kv_transfer.protocol import encode_header
from protos import kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.kv_transfer.harness import layer_chunk_header

def stalled():  # layer 2, properly signed: half its 2 KiB payload, then never another byte
    header = layer_chunk_header(layer=2, num_heads=2, num_blocks=4, nbytes=2048)
    yield kv_transfer_pb2.Piece(header=encode_header(header, ticket.secret), payload_size=2048)
    yield kv_transfer_pb2.Piece(data=bytes(1024))
    print("stalled", flush=True)
    time.sleep(600)
    yield kv_transfer_pb2.Piece(data=bytes(1024))

channel = grpc.insecure_channel(ticket.receiver_endpoints[0].removeprefix("grpc://"))
kv_transfer_pb2_grpc.KVTransferStub(channel).Push(stalled(), timeout=600)
""",
)


def test_receiver_process_killed_mid_transfer(transports, spawn):
    lease_s = 20.0
    proc = spawn(RECEIVER_SCRIPT, "grpc", str(lease_s))
    ticket = KVTicket.from_dict(msgpack.unpackb(bytes.fromhex(read_line(proc)), raw=False))
    kill = lambda: (proc.kill(), proc.wait(10))  # noqa: E731
    status, seconds = a_killed_receiver_fails_the_sender(transports(), ticket, kill, [7, 8, 9, 10], layers_before=2)
    assert "ConnectionError" in status.reason and seconds < 5, (status, seconds)


def test_sender_process_killed_mid_transfer(transports, spawn):
    lease_s = 6.0
    # One worker thread: a chunk left hanging by the dead sender must give it back.
    server = transports(max_workers=1)
    proc = spawn(_SENDER_SCRIPT)
    assert read_line(proc) == "ready"  # imports done: the lease starts now
    receiver, ticket, dst = _serve_one(server, lease_s=lease_s)
    proc.stdin.write(msgpack.packb(ticket.to_dict(), use_bin_type=True).hex() + "\n")
    proc.stdin.flush()
    assert read_line(proc) == "sent"
    assert read_line(proc) == "stalled"
    status = receiver.poll("req-1")
    assert status.state is TransferState.TRANSFERRING and status.layers_complete == 2

    proc.kill()
    proc.wait(10)
    remaining = ticket.lease_left_s()
    status = wait_terminal([lambda: receiver.poll("req-1")], timeout_s=remaining + 3)[0]
    assert status.state is TransferState.FAILED and "lease expired" in status.reason
    assert torch.count_nonzero(dst.caches[0][2]) == 0  # the layer never sent stays untouched

    # The server's only worker is free again: a new chunk gets a verdict, not a wait.
    header, payload = _layer_chunk(ticket, layer=2)
    with pytest.raises(TransferRefused, match="already FAILED"):
        transports().connect(ticket.receiver_endpoints[0]).send(header, payload, 5)
