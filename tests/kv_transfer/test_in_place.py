"""Chunks sent in place (torch: gloo messages straight into the blocks; gRPC: slices copied into
them as they arrive): from the sender's cache into the receiver's reserved blocks with no gather,
assembly or scatter, falling back to copies where that cannot work, and never writing into blocks
after the receiver released them. Also the copied batches that carry several small layers."""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import replace

import msgpack
import pytest
import torch

from kv_transfer import KVReceiver, KVSender, TransferState, make_ticket
from kv_transfer.backends import torch_dist
from kv_transfer.backends.torch_dist import TorchDistTransport
from kv_transfer.protocol import encode_header
from kv_transfer.receiver import NotInPlace
from kv_transfer.sending.worker import SendWorker
from kv_transfer.transport import KVChannel, TransferRefused
from tests.kv_transfer.harness import (
    assert_bit_exact,
    layer_chunk_header,
    make_side,
    transfer,
    transport_named,
    wait_terminal,
    wait_until,
)

SRC_BLOCKS = [7, 8, 9, 10]
DST_BLOCKS = [1, 2, 3, 4]  # one run against SRC_BLOCKS: K and V in one piece each


@pytest.fixture(params=["torch", "grpc", "tcp"])
def transport(request):
    t = transport_named(request.param)
    yield t
    t.shutdown()


@pytest.fixture(autouse=True)
def _small_pieces_in_place(monkeypatch):
    """These tests' layers are a few KB: send them in place anyway (by default, over torch, several
    layers of small pieces are copied into one message instead; see the copied-batch tests below).
    tcp and grpc send any piece in place already: they set their own ``in_place_min_piece_bytes``."""
    monkeypatch.setattr(KVChannel, "in_place_min_piece_bytes", 0)


def _done(receivers, senders):
    states = wait_terminal(
        [lambda r=r: r.poll("req-1") for r in receivers] + [lambda s=s: s.poll("req-1") for s in senders]
    )
    assert all(s.state is TransferState.DONE for s in states), [(s.state, s.reason) for s in states]


@pytest.mark.parametrize(
    ("dst_blocks", "dtype"),
    [
        (list(range(20, 24)), "float32"),  # one run
        (list(range(20, 24)), "bfloat16"),
        ([23, 22, 21, 20], "float32"),  # four runs of one block: eight pieces, K runs before V runs
        ([20, 21, 30, 31], "bfloat16"),  # two runs
    ],
)
def test_equal_tp_moves_every_byte_in_place_bit_exact(transport, dst_blocks, dtype):
    receivers, senders, ticket, full, dst, src_blocks = transfer(transport, 1, 1, dst_blocks=dst_blocks, dtype=dtype)
    _done(receivers, senders)
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    untouched = [b for b in range(dst.layouts[0].num_blocks) if b not in ticket.block_ids[: ticket.num_blocks]]
    assert all(torch.count_nonzero(layer[:, untouched]) == 0 for layer in dst.caches[0])
    for stats in (senders[0].stats("req-1"), receivers[0].stats("req-1")):
        assert stats.num_bytes > 0 and stats.in_place_bytes == stats.num_bytes, stats
    senders[0].close()


def test_equal_tp_above_one_goes_in_place_per_shard(transport):
    receivers, senders, ticket, full, dst, src_blocks = transfer(transport, 2, 2, total_kv_heads=4)
    _done(receivers, senders)
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    assert all(r.stats("req-1").in_place_bytes == r.stats("req-1").num_bytes > 0 for r in receivers)
    for s in senders:
        s.close()


@pytest.mark.parametrize(
    ("sender_tp", "receiver_tp", "dst_blocks", "num_tokens"),
    [
        (3, 1, None, 13),  # resharding: heads are sliced out, so each side copies
        (1, 3, None, 13),
        (1, 1, list(range(40, 20, -2)), 40),  # ten runs of one block: too fragmented for pieces
    ],
)
def test_resharding_and_fragmented_blocks_fall_back_to_copies(
    transport, sender_tp, receiver_tp, dst_blocks, num_tokens
):
    receivers, senders, ticket, full, dst, src_blocks = transfer(
        transport, sender_tp, receiver_tp, total_kv_heads=3, dst_blocks=dst_blocks, num_tokens=num_tokens, num_blocks=48
    )
    _done(receivers, senders)
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    assert all(r.stats("req-1").in_place_bytes == 0 < r.stats("req-1").num_bytes for r in receivers)
    for s in senders:
        s.close()


def test_receiver_that_cannot_take_pieces_declines_and_the_sender_copies(transport):
    src, full = make_side(1, fill=True)
    dst, _ = make_side(1, fill=False, total_kv_heads=4)
    # Every other head of a wider cache: a valid cache for the layout, but not contiguous.
    layers = [layer[:, :, :, ::2] for layer in dst.caches[0]]
    layout = src.layouts[0]
    receiver = KVReceiver(layers, layout, "torch")
    ticket = make_ticket("req-1", "torch", [transport.serve(receiver)], layout, "m", DST_BLOCKS, 13, 30)
    receiver.expect(ticket)
    sender = KVSender(layout, "m", transport)
    sender.start(ticket, SRC_BLOCKS)
    for i, kv in enumerate(src.caches[0]):
        sender.send_layer("req-1", i, kv)
    sender.finish("req-1", 0)
    _done([receiver], [sender])
    for i, layer in enumerate(layers):
        assert torch.equal(layer[:, DST_BLOCKS], full[i][:, SRC_BLOCKS])
    assert receiver.refusals["not_in_place"] == 1  # declined once; the channel then sent copies
    assert receiver.stats("req-1").in_place_bytes == 0
    sender.close()


# --- the receiver's side of a chunk taken in place ------------------------------------------


def _receiver(lease_s: float = 30.0):
    dst, _ = make_side(1, fill=False)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], "torch")
    ticket = make_ticket("req-1", "torch", ["torch://127.0.0.1:1"], dst.layouts[0], "m", DST_BLOCKS, 13, lease_s)
    receiver.expect(ticket)
    return receiver, ticket, dst


def _in_place_header(ticket, layout, **fields):
    nbytes = 2 * ticket.num_blocks * layout.block_size * layout.num_kv_heads * layout.head_dim * 4
    base = dict(num_heads=layout.num_kv_heads, num_blocks=ticket.num_blocks, nbytes=nbytes, run_lengths=[4])
    header = layer_chunk_header(**{**base, **fields})
    return header, nbytes


def test_release_waits_for_a_payload_in_flight():
    receiver, ticket, dst = _receiver()
    header, nbytes = _in_place_header(ticket, dst.layouts[0])
    write = receiver.begin_direct(encode_header(header, ticket.secret), nbytes, 2)
    assert [t.numel() for t in write.targets] == [nbytes // 2] * 2
    released = threading.Event()
    thread = threading.Thread(target=lambda: (receiver.release("req-1"), released.set()))
    thread.start()
    assert not released.wait(0.3)  # the blocks may still be written: release() must not hand them back
    for target in write.targets:
        target.fill_(7)
    with pytest.raises(TransferRefused, match="released"):
        receiver.end_direct(write, received=True)
    assert released.wait(5)
    thread.join()


def test_release_never_hangs_on_a_write_nobody_ends(monkeypatch, caplog):
    import kv_transfer.receiver as receiver_module

    monkeypatch.setattr(receiver_module, "_WRITE_GRACE_S", 0.1)
    receiver, ticket, dst = _receiver(lease_s=0.3)
    header, nbytes = _in_place_header(ticket, dst.layouts[0])
    receiver.begin_direct(encode_header(header, ticket.secret), nbytes, 2)  # and never end_direct: a bug
    start = time.monotonic()
    receiver.release("req-1")
    assert 0.2 < time.monotonic() - start < 3  # the lease, plus the grace
    assert "still in flight" in caplog.text


def test_a_payload_cut_short_fails_the_request():
    receiver, ticket, dst = _receiver()
    header, nbytes = _in_place_header(ticket, dst.layouts[0])
    write = receiver.begin_direct(encode_header(header, ticket.secret), nbytes, 2)
    with pytest.raises(TransferRefused, match="not received"):
        receiver.end_direct(write, received=False, reason="connection closed")
    status = receiver.poll("req-1")
    assert status.state is TransferState.FAILED and "payload not received: connection closed" in status.reason
    start = time.monotonic()
    receiver.release("req-1")
    assert time.monotonic() - start < 1


def test_checksum_covers_the_pieces_in_payload_order():
    receiver, ticket, dst = _receiver()
    layout = dst.layouts[0]
    header, nbytes = _in_place_header(ticket, layout)
    payload = torch.randn(nbytes // 4)
    header, _ = _in_place_header(ticket, layout, checksum=zlib.crc32(payload.numpy().tobytes()))
    write = receiver.begin_direct(encode_header(header, ticket.secret), nbytes, 2)
    write.targets[1].copy_(payload.view(torch.uint8)[nbytes // 2 :])  # V first: order must not matter
    write.targets[0].copy_(payload.view(torch.uint8)[: nbytes // 2])
    receiver.end_direct(write, received=True)
    assert torch.equal(dst.caches[0][0][:, DST_BLOCKS].reshape(-1), payload)

    header, _ = _in_place_header(ticket, layout, layer=1, checksum=12345)
    write = receiver.begin_direct(encode_header(header, ticket.secret), nbytes, 2)
    with pytest.raises(TransferRefused, match="checksum"):
        receiver.end_direct(write, received=True)
    assert receiver.poll("req-1").state is TransferState.FAILED
    assert receiver.refusals["checksum"] == 1


@pytest.mark.parametrize(
    ("fields", "pieces", "match"),
    [
        ({"num_heads": 1}, 2, "1 heads, not the planned"),
        ({"dst_head_offset": 1}, 2, "not part of the transfer plan"),
        ({"sender_tp": 2, "num_heads": 1}, 2, "every head"),
        ({"nbytes": 64}, 2, "bytes, expected"),
        ({}, 3, "3 pieces, expected 2"),
        ({"batch": [[0, -1, 0, None], [1, -1, 0, None]]}, 2, "bytes, expected"),  # two layers' worth
        ({"batch": [[0, -1, 0, None], [0, -1, 0, None]]}, 2, "names one layer twice"),
        ({"batch": [[0, 3, 0, None], [1, -1, 0, None]]}, 2, "a batch of 2 layers"),  # a pulled entry
        ({"batch": [[0, -1, 0, None], [9, -1, 0, None]]}, 2, "not part of the transfer plan"),
        ({"run_lengths": [3]}, 2, "do not cover the 4 reserved blocks"),
        ({"run_lengths": [3, 3]}, 2, "do not cover the 4 reserved blocks"),
        ({"run_lengths": [4, 0]}, 2, "do not cover the 4 reserved blocks"),
        ({"run_lengths": [1] * 9}, 2, "do not cover"),  # more runs than a chunk may have
        ({"run_lengths": [1, 1, 1, 1]}, 2, None),  # four runs: eight pieces expected, not two
        ({"layer": 5}, 2, "not part of the transfer plan"),
        ({"kind": "done"}, 2, "names its layers"),
        ({"src_region": 0}, 2, "names its layers"),
    ],
)
def test_malformed_in_place_chunks_reserve_nothing(fields, pieces, match):
    receiver, ticket, dst = _receiver()
    header, nbytes = _in_place_header(ticket, dst.layouts[0], **fields)
    with pytest.raises(TransferRefused, match=match or "pieces, expected"):
        receiver.begin_direct(encode_header(header, ticket.secret), nbytes, pieces)
    assert receiver.poll("req-1").state is TransferState.PENDING  # refused, not failed
    start = time.monotonic()
    receiver.release("req-1")  # nothing reserved: returns at once
    assert time.monotonic() - start < 1


def test_wrong_secret_and_duplicates_are_refused_before_any_write():
    receiver, ticket, dst = _receiver()
    header, nbytes = _in_place_header(ticket, dst.layouts[0])
    with pytest.raises(TransferRefused, match="signature"):
        receiver.begin_direct(encode_header(header, b"not the secret"), nbytes, 2)
    write = receiver.begin_direct(encode_header(header, ticket.secret), nbytes, 2)
    with pytest.raises(TransferRefused, match="already being received"):
        receiver.begin_direct(encode_header(header, ticket.secret), nbytes, 2)
    receiver.end_direct(write, received=True)
    with pytest.raises(TransferRefused, match="already landed"):
        receiver.begin_direct(encode_header(header, ticket.secret), nbytes, 2)


def test_one_chunk_carries_several_layers_each_checked_on_its_own():
    receiver, ticket, dst = _receiver()
    layout = dst.layouts[0]
    _, layer_bytes = _in_place_header(ticket, layout)
    payloads = [torch.randn(layer_bytes // 4) for _ in range(3)]
    crcs = [zlib.crc32(p.numpy().tobytes()) for p in payloads]
    crcs[2] ^= 1  # layer 2 arrives corrupted
    header, _ = _in_place_header(ticket, layout, checksum=crcs[0], batch=[[i, -1, 0, crcs[i]] for i in range(3)])
    write = receiver.begin_direct(encode_header(header, ticket.secret), 3 * layer_bytes, 6)
    assert [h.layer for h in write.layers] == [0, 1, 2] and len(write.targets) == 6
    for i, payload in enumerate(payloads):
        write.targets[2 * i].copy_(payload.view(torch.uint8)[: layer_bytes // 2])
        write.targets[2 * i + 1].copy_(payload.view(torch.uint8)[layer_bytes // 2 :])
    with pytest.raises(TransferRefused, match="checksum mismatch in layer 2"):
        receiver.end_direct(write, received=True)
    for i in (0, 1):  # landed, each checked against its own checksum
        assert torch.equal(dst.caches[0][i][:, DST_BLOCKS].reshape(-1), payloads[i])
    status = receiver.poll("req-1")
    assert status.state is TransferState.FAILED and status.layers_complete == 2


def test_layers_queued_behind_a_busy_sender_leave_in_one_chunk(transport, monkeypatch):
    gate, chunks = threading.Event(), []
    connect = transport.connect

    def gated_connect(endpoint):
        channel = connect(endpoint)
        send_spans = channel.send_spans

        def recording_send_spans(header, layers, spans, timeout_s, tag=None):
            gate.wait(10)  # the sender is busy while the forward pass queues more layers
            chunks.append((msgpack.unpackb(msgpack.unpackb(header)["body"]), len(layers) * len(spans)))
            return send_spans(header, layers, spans, timeout_s, tag)

        channel.send_spans = recording_send_spans
        return channel

    monkeypatch.setattr(transport, "connect", gated_connect)
    receivers, senders, ticket, full, dst, src_blocks = transfer(transport, 1, 1, num_layers=6)
    gate.set()
    assert wait_terminal([lambda: senders[0].poll("req-1")])[0].state is TransferState.DONE
    layers = [entry[0] for chunk, _ in chunks for entry in (chunk["batch"] or [[chunk["layer"]]])]
    assert sorted(layers) == list(range(6)) and len(chunks) <= 2  # 6 layers, at most 2 chunks
    runs = 4  # transfer()'s reversed destination blocks: one run per block
    assert sum(n for _, n in chunks) == 6 * 2 * runs
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    assert receivers[0].stats("req-1").in_place_bytes == receivers[0].stats("req-1").num_bytes
    senders[0].close()


def test_a_non_contiguous_cache_declines_rather_than_refuses():
    dst, _ = make_side(1, fill=False, total_kv_heads=4)
    layout = make_side(1, fill=False)[0].layouts[0]
    receiver = KVReceiver([layer[:, :, :, ::2] for layer in dst.caches[0]], layout, "torch")
    ticket = make_ticket("req-1", "torch", ["torch://127.0.0.1:1"], layout, "m", DST_BLOCKS, 13, 30)
    receiver.expect(ticket)
    header, nbytes = _in_place_header(ticket, layout)
    with pytest.raises(NotInPlace):
        receiver.begin_direct(encode_header(header, ticket.secret), nbytes, 2)


# --- over a real pair ---------------------------------------------------------------------


def test_a_refused_in_place_chunk_writes_nothing_and_the_channel_pairs_again(transport):
    receiver, ticket, dst = _receiver()
    endpoint = transport.serve(receiver)
    src, _ = make_side(1, fill=True)
    header, _ = _in_place_header(ticket, dst.layouts[0])
    pieces = [src.caches[0][0][part].narrow(0, 7, 4) for part in (0, 1)]  # SRC_BLOCKS: one run
    channel = transport.connect(endpoint)
    with pytest.raises(TransferRefused, match="signature"):
        channel.send_pieces(encode_header(header, b"not the secret"), pieces, 5)
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])
    assert channel.send_pieces(encode_header(header, ticket.secret), pieces, 5)  # a fresh pair
    assert torch.equal(dst.caches[0][0][:, DST_BLOCKS], src.caches[0][0][:, SRC_BLOCKS])
    assert receiver.refusals["bad_signature"] == 1 and receiver.poll("req-1").state is TransferState.TRANSFERRING
    channel.close()


def _stalled_torch_sender(transport, endpoint, header, secret, nbytes, head_timeout_ms):
    """Sends a chunk's head and its K piece by hand, then stalls (V never comes). Returns the channel."""
    channel = transport.connect(endpoint)
    with channel._lock:
        raw = encode_header(header, secret)
        deadline = channel._ready(raw, 10.0)  # pairs: the hello carries this signed header
        pair = channel._pair
        view = memoryview(channel._head.numpy())
        torch_dist._HEAD.pack_into(view, 0, len(raw), nbytes, head_timeout_ms, 0, 2)
        view[torch_dist._HEAD.size : torch_dist._HEAD.size + len(raw)] = raw
        pair.send(channel._head, deadline, "head")
        pair.send(torch.full((nbytes // 2,), 9, dtype=torch.uint8), deadline, "K only")
    return channel


def test_sender_stalling_mid_payload_fails_the_request_and_frees_the_blocks():
    """Pieces stop arriving: the receive ends at the chunk's deadline, the pair closes (gloo writes
    nothing after a receive timed out), the request fails with the reason, release() is prompt."""
    receiver, ticket, dst = _receiver()
    transport = TorchDistTransport()
    header, nbytes = _in_place_header(ticket, dst.layouts[0])
    channel = _stalled_torch_sender(transport, transport.serve(receiver), header, ticket.secret, nbytes, 1000)
    (status,) = wait_terminal([lambda: receiver.poll("req-1")], timeout_s=10)
    assert status.state is TransferState.FAILED and "payload not received" in status.reason
    start = time.monotonic()
    receiver.release("req-1")
    assert time.monotonic() - start < 1
    # The pair is gone: the rest of the payload cannot land. Its thread fails the receive first,
    # then closes its gloo group and leaves the table (under a loaded host, a moment later).
    deadline = time.monotonic() + 10
    while transport.num_pairs() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert transport.num_pairs() == 0
    channel.close()
    transport.shutdown()


def test_a_stalled_payload_holds_release_for_its_stall_bound_not_the_lease():
    receiver, ticket, dst = _receiver(lease_s=60)
    transport = TorchDistTransport(payload_stall_s=0.5)
    header, nbytes = _in_place_header(ticket, dst.layouts[0])
    # The sender claims a minute for this chunk; the receiver allows a stall of 0.5 s.
    channel = _stalled_torch_sender(transport, transport.serve(receiver), header, ticket.secret, nbytes, 60_000)
    assert receiver.poll("req-1").state is TransferState.PENDING  # K landed, V pending: still receiving
    start = time.monotonic()
    receiver.release("req-1")  # say, the client went away
    assert time.monotonic() - start < 3
    channel.close()
    transport.shutdown()


def test_releasing_during_a_stalled_grpc_stream_cancels_it():
    from kv_transfer.backends import grpc_backend

    receiver, ticket, dst = _receiver(lease_s=60)
    header, nbytes = _in_place_header(ticket, dst.layouts[0])
    transport = transport_named("grpc")
    channel = transport.connect(transport.serve(receiver))
    push, _ = channel._connect()
    stalled, finish = threading.Event(), threading.Event()

    def stream():
        first = grpc_backend.Piece(header=encode_header(header, ticket.secret), payload_size=nbytes, in_place=True)
        yield first.SerializeToString()
        yield grpc_backend.Piece(data=bytes(nbytes // 2)).SerializeToString()
        stalled.set()
        finish.wait(30)  # the sender hangs mid-payload

    outcome = []
    caller = threading.Thread(target=lambda: outcome.append(_call_outcome(push, stream())))
    caller.start()
    assert stalled.wait(10)
    assert wait_until(lambda: receiver._incoming["req-1"].writing)
    start = time.monotonic()
    receiver.release("req-1")
    assert time.monotonic() - start < 3
    finish.set()
    caller.join(10)
    assert outcome and outcome[0] == "CANCELLED"
    channel.close()
    transport.shutdown()


def _call_outcome(push, stream) -> str:
    import grpc

    try:
        ack = push(stream, timeout=30)
        return f"ack ok={ack.ok}"
    except grpc.RpcError as exc:
        return exc.code().name


def test_a_pair_is_dropped_after_an_unexpected_error_mid_exchange(monkeypatch):
    """Message order on a pair is lost once an exchange breaks off: the channel must not reuse it."""
    receiver, ticket, dst = _receiver()
    second = make_ticket("req-2", "torch", ["torch://127.0.0.1:1"], dst.layouts[0], "m", [11, 12, 13, 14], 13, 30)
    receiver.expect(second)
    transport = TorchDistTransport()
    channel = transport.connect(transport.serve(receiver))
    src, _ = make_side(1, fill=True)
    pieces = [src.caches[0][0][part].narrow(0, 7, 4) for part in (0, 1)]
    header, _ = _in_place_header(ticket, dst.layouts[0])
    post_all = torch_dist._Pair.post_all

    def failing_post_all(self, op, parts):
        raise RuntimeError("NCCL setup failed")  # say: anything but a timeout or a closed connection

    monkeypatch.setattr(torch_dist._Pair, "post_all", failing_post_all)
    with pytest.raises(RuntimeError, match="NCCL"):
        channel.send_pieces(encode_header(header, ticket.secret), pieces, 5)
    assert channel.num_connects == 1
    monkeypatch.setattr(torch_dist._Pair, "post_all", post_all)
    (status,) = wait_terminal([lambda: receiver.poll("req-1")])  # its payload never came
    assert status.state is TransferState.FAILED and "payload not received" in status.reason
    header = replace(header, request_id="req-2")
    assert channel.send_pieces(encode_header(header, second.secret), pieces, 5)
    assert channel.num_connects == 2  # over a fresh pair: the broken one was not reused
    assert torch.equal(dst.caches[0][0][:, [11, 12, 13, 14]], src.caches[0][0][:, SRC_BLOCKS])
    channel.close()
    transport.shutdown()


def test_runs_must_be_consecutive_on_the_receiving_side_too():
    dst, _ = make_side(1, fill=False)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], "torch")
    ticket = make_ticket("req-1", "torch", ["torch://127.0.0.1:1"], dst.layouts[0], "m", [20, 28, 29, 30], 13, 30)
    receiver.expect(ticket)
    for runs, pieces in (([4], 2), ([2, 2], 4)):  # 20 and 28 are not consecutive
        header, nbytes = _in_place_header(ticket, dst.layouts[0], run_lengths=runs)
        with pytest.raises(TransferRefused, match="not consecutive here"):
            receiver.begin_direct(encode_header(header, ticket.secret), nbytes, pieces)
    header, nbytes = _in_place_header(ticket, dst.layouts[0], run_lengths=[1, 3])
    write = receiver.begin_direct(encode_header(header, ticket.secret), nbytes, 4)
    assert [t.numel() for t in write.targets] == [nbytes // 8, 3 * nbytes // 8] * 2
    for target in write.targets:
        target.fill_(1)
    receiver.end_direct(write, received=True)
    written = [b for b in range(32) if torch.count_nonzero(dst.caches[0][0][:, b])]
    assert written == [20, 28, 29, 30]


# --- several layers of small pieces: copied into one message instead ---------------------------


@pytest.mark.parametrize("backend", ["torch", "grpc", "shm", "tcp"])
def test_small_layers_queued_together_are_copied_into_one_message(backend, monkeypatch):
    transport = transport_named(backend)
    queued, chunks = threading.Event(), []
    # The sender fell behind the forward pass: it takes its first layer only once every layer is
    # queued. (Left to the scheduler, it sometimes took layer 0 alone, which rightly went in place.)
    layers_behind = SendWorker._layers_behind

    def behind_the_forward_pass(worker, first, held):
        queued.wait(10)
        return layers_behind(worker, first, held)

    monkeypatch.setattr(SendWorker, "_layers_behind", behind_the_forward_pass)
    connect = transport.connect

    def recording_connect(endpoint):
        channel = connect(endpoint)
        channel.in_place_min_piece_bytes = 1 << 30  # what a gloo channel sets; tcp sends any piece in place
        for name in ("send", "send_staged"):
            original = getattr(channel, name, None)

            def recording(header, payload, timeout_s, tag=None, original=original):
                chunks.append(msgpack.unpackb(msgpack.unpackb(header)["body"]))
                return original(header, payload, timeout_s, tag)

            setattr(channel, name, recording)
        return channel

    monkeypatch.setattr(transport, "connect", recording_connect)
    try:
        receivers, senders, ticket, full, dst, src_blocks = transfer(transport, 1, 1, num_layers=6)
        queued.set()
        _done(receivers, senders)
        layers = [
            entry[0] for chunk in chunks if chunk["kind"] == "layer" for entry in chunk["batch"] or [[chunk["layer"]]]
        ]
        assert layers == list(range(6))
        assert [chunk["kind"] for chunk in chunks].count("layer") == 1  # all 6 in one message
        assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
        assert receivers[0].stats("req-1").in_place_bytes == 0
        senders[0].close()
    finally:
        queued.set()
        transport.shutdown()


def test_a_copied_batch_is_checked_whole_before_anything_is_written():
    receiver, ticket, dst = _receiver()
    layout = dst.layouts[0]
    _, layer_bytes = _in_place_header(ticket, layout)
    payload = torch.randn(2 * layer_bytes // 4)
    two = [[0, -1, 0, None], [1, -1, 0, None]]
    cases = [
        (dict(batch=two), payload.numpy().tobytes()[:-4], "bytes"),  # short by one value
        (dict(batch=[[0, -1, 0, None], [0, -1, 0, None]]), payload.numpy().tobytes(), "twice"),
        (dict(batch=[[0, -1, 0, None], [7, -1, 0, None]]), payload.numpy().tobytes(), "not part of the transfer plan"),
        (dict(batch=[[0, 3, 0, None], [1, -1, 0, None]]), payload.numpy().tobytes(), "a batch of 2 layers"),
    ]
    for fields, raw, match in cases:
        header = layer_chunk_header(num_heads=2, num_blocks=4, nbytes=layer_bytes, **fields)
        with pytest.raises(TransferRefused, match=match):
            receiver.apply(encode_header(header, ticket.secret), raw)
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])
    header = layer_chunk_header(num_heads=2, num_blocks=4, nbytes=layer_bytes, batch=two)
    receiver.apply(encode_header(header, ticket.secret), payload.numpy().tobytes())
    halves = payload.view(2, -1)
    for layer in (0, 1):
        assert torch.equal(dst.caches[0][layer][:, DST_BLOCKS].reshape(-1), halves[layer])
    assert receiver.poll("req-1").layers_complete == 2


@pytest.mark.parametrize("layers", [[0, 2], [1, 2]])
@pytest.mark.parametrize("one_allocation", [True, False])
def test_a_copied_batch_lands_layer_by_layer_or_stacked(layers, one_allocation):
    dst, _ = make_side(1, fill=False)
    caches = dst.caches[0] if one_allocation else [layer.clone() for layer in dst.caches[0]]
    receiver = KVReceiver(caches, dst.layouts[0], "torch")
    ticket = make_ticket("req-1", "torch", ["torch://127.0.0.1:1"], dst.layouts[0], "m", [4, 3, 9, 10], 13, 30)
    receiver.expect(ticket)
    layer_bytes = 2 * 4 * 4 * 2 * 8 * 4
    payload = torch.randn(len(layers) * layer_bytes // 4)
    entries = [
        [layer, -1, 0, zlib.crc32(part.numpy().tobytes())]
        for layer, part in zip(layers, payload.chunk(len(layers)), strict=True)
    ]
    header = layer_chunk_header(num_heads=2, num_blocks=4, nbytes=layer_bytes, checksum=entries[0][3], batch=entries)
    receiver.apply(encode_header(header, ticket.secret), payload.numpy().tobytes())
    for layer, part in zip(layers, payload.chunk(len(layers)), strict=True):
        assert torch.equal(caches[layer][:, [4, 3, 9, 10]].reshape(-1), part)
    untouched = [layer for layer in range(3) if layer not in layers]
    assert all(torch.count_nonzero(caches[layer]) == 0 for layer in untouched)
    assert receiver.stats("req-1").num_bytes == len(layers) * layer_bytes


@pytest.mark.parametrize(("sent_fraction", "why"), [(0.5, "ended after 1024 of 2048"), (1.5, "overruns")])
def test_grpc_stream_short_or_long_fails_the_request_and_frees_the_blocks(sent_fraction, why):
    from kv_transfer.backends import grpc_backend

    receiver, ticket, dst = _receiver()
    header, nbytes = _in_place_header(ticket, dst.layouts[0])
    transport = transport_named("grpc")
    channel = transport.connect(transport.serve(receiver))
    push, _ = channel._connect()
    data = bytes(int(nbytes * sent_fraction))

    def stream():
        first = grpc_backend.Piece(header=encode_header(header, ticket.secret), payload_size=nbytes, in_place=True)
        yield first.SerializeToString()
        yield grpc_backend.Piece(data=data).SerializeToString()

    ack = push(stream(), timeout=5)
    assert not ack.ok and why in ack.reason
    status = receiver.poll("req-1")
    assert status.state is TransferState.FAILED and "payload not received" in status.reason and why in status.reason
    start = time.monotonic()
    receiver.release("req-1")  # nothing in flight any more
    assert time.monotonic() - start < 1
    channel.close()
    transport.shutdown()
