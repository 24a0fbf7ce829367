"""KV transfer over every backend: bit-exact across TP pairs, layer-wise progress, and faults that
end in a terminal state with the reason, within the lease, writing nothing they should not."""

from __future__ import annotations

import sys
import time
import types
import zlib

import pytest
import torch

from kv_transfer import KVReceiver, KVSender, TicketError, TransferState, make_ticket
from kv_transfer.protocol import (
    ChunkHeader,
    _mac,
    at_least,
    encode_header,
    payload_check,
    payload_mac,
    payload_matches,
)
from kv_transfer.ticket import KVTicket
from kv_transfer.transport import TransferRefused, available_backends
from tests.kv_transfer.harness import (
    assert_bit_exact,
    layer_chunk_header,
    layout_for,
    make_side,
    pulls,
    transfer,
    transport_named,
    wait_terminal,
)

# Every backend registered in kv_transfer.transport runs every test here, and shm twice: with the
# senders' caches in private memory (staged copies) and in shared memory (the receiver pulls).
# auto is shm or tcp behind one endpoint, both run here already: its choice between them is
# tested in test_endpoints.py, and a cluster's hand-offs through it in tests/cluster.
BACKENDS = [*(b for b in available_backends() if b != "auto"), "shm-pull"]


@pytest.fixture(params=BACKENDS)
def transport(request):
    t = transport_named(request.param)
    yield t
    t.shutdown()


@pytest.mark.parametrize(("sender_tp", "receiver_tp", "heads"), [(1, 1, 2), (3, 1, 3), (1, 3, 3), (2, 4, 2)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bit_exact_across_tp_pairs(transport, sender_tp, receiver_tp, heads, dtype):
    receivers, senders, ticket, full, dst, src_blocks = transfer(
        transport, sender_tp, receiver_tp, total_kv_heads=heads, dtype=dtype
    )
    rx = wait_terminal([lambda r=r: r.poll("req-1") for r in receivers])
    tx = wait_terminal([lambda s=s: s.poll("req-1") for s in senders])
    assert all(s.state is TransferState.DONE for s in rx + tx), [(s.state, s.reason) for s in rx + tx]
    assert all(s.first_token_id == 42 for s in rx)
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    # Nothing outside the reserved blocks was touched.
    untouched = [b for b in range(dst.layouts[0].num_blocks) if b not in ticket.block_ids[: ticket.num_blocks]]
    assert all(torch.count_nonzero(layer[:, untouched]) == 0 for shard in dst.caches for layer in shard)
    stats = receivers[0].stats("req-1")
    assert stats.num_bytes > 0 and stats.total_time_s is not None and stats.num_layers == 3
    for s in senders:
        s.close()


@pytest.mark.parametrize("skew_s", [3600.0, -3600.0])
def test_a_lease_is_a_duration_whatever_the_hosts_wall_clocks_say(transport, skew_s, monkeypatch):
    """The ticket crosses to the sender as it would between hosts, and the clock of the day moves an
    hour (ahead: a lease read as a time of day would be over before it began; behind: it would
    outlive its blocks) once the receiver made it: nothing changes."""

    def skew_the_wall_clock(ticket) -> None:  # the transfer code's only: gRPC's own deadlines read it too
        skewed = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})
        skewed.time = lambda: time.time() + skew_s
        for name, module in list(sys.modules.items()):
            if name.startswith("kv_transfer") and getattr(module, "time", None) is time:
                monkeypatch.setattr(module, "time", skewed)

    receivers, senders, ticket, full, dst, src_blocks = transfer(
        transport, 1, 1, lease_s=20.0, through_wire=True, before_send=skew_the_wall_clock
    )
    rx = wait_terminal([lambda: receivers[0].poll("req-1")])
    tx = wait_terminal([lambda: senders[0].poll("req-1")])
    assert all(s.state is TransferState.DONE for s in rx + tx), [(s.state, s.reason) for s in rx + tx]
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    assert 0 < KVTicket.from_dict(ticket.to_dict()).lease_left_s() <= 20.0
    senders[0].close()


def test_a_ticket_written_out_carries_what_is_left_of_its_lease(monkeypatch):
    dst, _ = make_side(1, fill=False)
    ticket = make_ticket("req-1", "tcp", ["127.0.0.1:1"], dst.layouts[0], "m", [1, 2, 3, 4], 13, 30.0)
    real_monotonic = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + 12.0)  # held 12 s
    assert "lease_deadline" not in ticket.to_dict() and 17.0 < ticket.to_dict()["lease_s"] <= 18.0
    monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + 31.0)
    assert ticket.is_expired() and ticket.to_dict()["lease_s"] == 0.0


def test_smollm2_layout_bit_exact(transport):
    # SmolLM2's real shard layout: 30 layers, 3 KV heads of 64, 16-token blocks, prefill TP=3 -> decode TP=1.
    receivers, senders, ticket, full, dst, src_blocks = transfer(
        transport, 3, 1, num_layers=30, total_kv_heads=3, head_dim=64, block_size=16, num_blocks=40, num_tokens=100
    )
    assert [s.state for s in wait_terminal([lambda: receivers[0].poll("req-1")])] == [TransferState.DONE]
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    for s in senders:
        s.close()


def test_layers_arrive_before_later_layers_are_produced(transport):
    src, _, receiver, sender = _layer_by_layer(transport, lease_s=30)
    sender.send_layer("req-1", 0, src.caches[0][0])  # layer 0 computed; layers 1-2 not yet
    deadline = time.monotonic() + 10
    while receiver.poll("req-1").layers_complete < 1 and time.monotonic() < deadline:
        time.sleep(0.002)
    status = receiver.poll("req-1")
    assert status.layers_complete == 1 and status.state is TransferState.TRANSFERRING
    for layer in (1, 2):
        sender.send_layer("req-1", layer, src.caches[0][layer])
    sender.finish("req-1", 5)
    assert wait_terminal([lambda: receiver.poll("req-1")])[0].state is TransferState.DONE
    stats = receiver.stats("req-1")
    assert stats.time_to_first_layer_s is not None and stats.time_to_first_layer_s <= stats.total_time_s
    sender.close()


def _layer_by_layer(transport, lease_s: float, integrity: str = "crc32", require_integrity: str = "none", windows=(4,)):
    """One sender and one receiver shard of the 3-layer test layout, the ticket issued, nothing sent
    (``windows``: the blocks of the first window, and of each next one)."""
    src, _ = make_side(1, fill=True, shared=pulls(transport))
    receiver, ticket, dst = _one_receiver(transport, lease_s, require_integrity)
    sender = KVSender(src.layouts[0], "m", transport, integrity=integrity)
    source, start = [7, 8, 9, 10], 0
    for i, count in enumerate(windows):
        if i == 0:
            sender.start(ticket, source[:count])
        else:
            sender.next_window("req-1", source[start : start + count])
        start += count
    return src, dst, receiver, sender


@pytest.mark.chaos
def test_a_dropped_layer_chunk_fails_the_transfer_at_its_done(transport):
    src, dst, receiver, sender = _layer_by_layer(transport, lease_s=30.0)
    for layer in (0, 2):  # layer 1's chunk is lost on the way
        sender.send_layer("req-1", layer, src.caches[0][layer])
    sender.finish("req-1", 5)
    (rx,) = wait_terminal([lambda: receiver.poll("req-1")])
    assert rx.state is TransferState.FAILED and "missing" in rx.reason, rx
    assert rx.layers_complete < 3
    assert torch.count_nonzero(dst.caches[0][1]) == 0  # the lost layer wrote nothing
    receiver.release("req-1")
    sender.close()


@pytest.mark.chaos
@pytest.mark.parametrize("delay_s", [0.3, 2.3])
def test_a_delayed_layer_chunk_lands_within_the_lease_and_fails_past_it(transport, delay_s):
    src, dst, receiver, sender = _layer_by_layer(transport, lease_s=2.0)
    sender.send_layer("req-1", 0, src.caches[0][0])
    time.sleep(delay_s)  # the network holds layer 1 back
    for layer in (1, 2):
        sender.send_layer("req-1", layer, src.caches[0][layer])
    sender.finish("req-1", 5)
    rx, tx = wait_terminal([lambda: receiver.poll("req-1"), lambda: sender.poll("req-1")])
    if delay_s < 2.0:
        assert rx.state is tx.state is TransferState.DONE, (rx, tx)
        for layer in range(3):  # whole blocks move, the 13 tokens' last one included
            assert torch.equal(dst.caches[0][layer][:, [1, 2, 3, 4]], src.caches[0][layer][:, [7, 8, 9, 10]])
    else:
        assert rx.state is TransferState.FAILED and "lease" in rx.reason, rx
        assert tx.state is TransferState.FAILED, tx
        # Nothing after the lease was written: layers 1 and 2 of the reserved blocks are still zero.
        assert all(torch.count_nonzero(dst.caches[0][layer][:, [1, 2, 3, 4]]) == 0 for layer in (1, 2))
    receiver.release("req-1")
    sender.close()


def _layer0_chunk(
    num_heads: int, checksum: int | bytes | None = None, block_offset: int = 0, num_blocks: int = 4
) -> tuple[ChunkHeader, bytes]:
    """A hand-made layer-0 chunk of ones for the 4-block, 8-dim test layout (not from a KVSender)."""
    payload = torch.ones(2, max(num_blocks, 1), 4, num_heads, 8).numpy().tobytes()
    header = layer_chunk_header(
        num_heads=num_heads, block_offset=block_offset, num_blocks=num_blocks, nbytes=len(payload), checksum=checksum
    )
    return header, payload


def _one_receiver(transport, lease_s=30.0, require_integrity: str = "none"):
    dst, _ = make_side(1, fill=False)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], require_integrity=require_integrity)
    ticket = make_ticket(
        "req-1", transport.name, [transport.serve(receiver)], dst.layouts[0], "m", [1, 2, 3, 4], 13, lease_s
    )
    receiver.expect(ticket)
    return receiver, ticket, dst


def test_the_ticket_s_secret_is_in_no_repr():
    from common.serving import ServeRequest, TicketIssued

    dst, _ = make_side(1, fill=False)
    ticket = make_ticket("req-1", "tcp", ["127.0.0.1:1"], dst.layouts[0], "m", [1, 2, 3, 4], 13, 30.0)
    as_dict = ticket.to_dict()
    for shown in (ticket, ServeRequest("req-1", [1], {}, kv_ticket=as_dict), TicketIssued("req-1", as_dict, "d0")):
        text = f"{shown!r} {shown!s}"
        assert "req-1" in text and repr(ticket.secret) not in text and ticket.secret.hex() not in text


def test_wrong_secret_is_refused_and_writes_nothing(transport):
    receiver, ticket, dst = _one_receiver(transport)
    header, payload = _layer0_chunk(num_heads=2)
    channel = transport.connect(ticket.receiver_endpoints[0])
    with pytest.raises(TransferRefused, match="signature"):
        channel.send(encode_header(header, b"not-the-secret" * 3), payload, 5)
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])
    assert receiver.refusals["bad_signature"] == 1
    assert receiver.poll("req-1").state is TransferState.PENDING  # an outsider cannot cancel the transfer


@pytest.mark.chaos
def test_expired_lease_fails_both_sides_and_writes_nothing(transport):
    receiver, ticket, dst = _one_receiver(transport, lease_s=0.3)
    src, _ = make_side(1, fill=True, shared=pulls(transport))
    time.sleep(0.35)
    sender = KVSender(src.layouts[0], "m", transport)
    sender.start(ticket, [1, 2, 3, 4])
    sender.send_layer("req-1", 0, src.caches[0][0])
    sender.finish("req-1", 1)
    rx, tx = wait_terminal([lambda: receiver.poll("req-1"), lambda: sender.poll("req-1")])
    assert rx.state is TransferState.FAILED and "lease" in rx.reason
    assert tx.state is TransferState.FAILED and "lease" in tx.reason
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])
    sender.close()


@pytest.mark.chaos
def test_corrupted_payload_fails_on_checksum(transport):
    receiver, ticket, dst = _one_receiver(transport)
    header, payload = _layer0_chunk(num_heads=2, checksum=12345)
    with pytest.raises(TransferRefused, match="checksum"):
        transport.connect(ticket.receiver_endpoints[0]).send(encode_header(header, ticket.secret), payload, 5)
    status = receiver.poll("req-1")
    assert status.state is TransferState.FAILED and "checksum" in status.reason
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])


@pytest.mark.parametrize("integrity", ["none", "crc32", "mac"])
@pytest.mark.parametrize(("sender_tp", "receiver_tp"), [(1, 1), (2, 1)])
def test_every_integrity_mode_moves_the_blocks_bit_exact(transport, integrity, sender_tp, receiver_tp):
    # (1, 1): in place where the backend can; (2, 1): resharded, gathered copies or pulled heads.
    receivers, senders, ticket, full, dst, src_blocks = transfer(
        transport, sender_tp, receiver_tp, total_kv_heads=2, integrity=integrity
    )
    states = wait_terminal(
        [lambda r=r: r.poll("req-1") for r in receivers] + [lambda s=s: s.poll("req-1") for s in senders]
    )
    assert all(s.state is TransferState.DONE for s in states), [(s.state, s.reason) for s in states]
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    for s in senders:
        s.close()


@pytest.mark.parametrize(
    ("sent", "required", "lands"), [("crc32", "mac", False), ("none", "crc32", False), ("mac", "crc32", True)]
)
def test_a_receiver_refuses_a_weaker_payload_check_than_it_requires(transport, sent, required, lands):
    """A sender configured apart from its receivers is found at the first chunk, not trusted."""
    src, dst, receiver, sender = _layer_by_layer(transport, 30.0, integrity=sent, require_integrity=required)
    for layer in range(3):
        sender.send_layer("req-1", layer, src.caches[0][layer])
    sender.finish("req-1", 5)
    rx, tx = wait_terminal([lambda: receiver.poll("req-1"), lambda: sender.poll("req-1")])
    if lands:
        assert rx.state is tx.state is TransferState.DONE, (rx, tx)
    else:
        assert rx.state is TransferState.FAILED and f"requires {required}" in rx.reason, rx
        assert tx.state is TransferState.FAILED, tx
        assert receiver.refusals["integrity"] >= 1
        assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])
    receiver.release("req-1")
    sender.close()


def test_a_batch_of_layers_landed_one_by_one_keeps_its_checks_for_a_receiver_that_requires_them(transport):
    """Layers 0 and 2 in one payload (not consecutive: the receiver lands them one at a time, after
    checking the batch whole) reach a receiver that requires crc32: checked once, not refused."""
    receiver, ticket, dst = _one_receiver(transport, require_integrity="crc32")
    layers = {0: torch.full((2, 4, 4, 2, 8), 1.0), 2: torch.full((2, 4, 4, 2, 8), 2.0)}
    parts = {layer: values.numpy().tobytes() for layer, values in layers.items()}
    batch = [[layer, -1, 0, zlib.crc32(part)] for layer, part in parts.items()]
    payload = b"".join(parts.values())
    header = layer_chunk_header(num_heads=2, num_blocks=4, nbytes=len(payload), batch=batch)
    transport.connect(ticket.receiver_endpoints[0]).send(encode_header(header, ticket.secret), payload, 5)
    assert receiver.refusals["integrity"] == 0 and receiver.poll("req-1").state is TransferState.TRANSFERRING
    for layer, values in layers.items():
        assert torch.equal(dst.caches[0][layer][:, [1, 2, 3, 4]], values)
    receiver.release("req-1")


def test_integrity_modes_are_ordered_and_the_payload_mac_is_not_a_header_mac():
    assert [at_least(check, "crc32") for check in (None, 7, b"x" * 16)] == [False, True, True]
    assert [at_least(check, "mac") for check in (None, 7, b"x" * 16)] == [False, False, True]
    assert at_least(None, "none")
    body = b"the same bytes under the same key"
    tag = payload_mac(b"k" * 32, body)
    assert tag[16:] != _mac(b"k" * 32, body)[:16] and _mac(b"k" * 32, body)[:16] not in tag
    with pytest.raises(ValueError, match="require_integrity='sha1'"):
        KVReceiver(*_receiver_parts(), require_integrity="sha1")


def _receiver_parts():
    dst, _ = make_side(1, fill=False)
    return dst.caches[0], dst.layouts[0]


@pytest.mark.chaos
def test_a_payload_changed_after_its_mac_was_taken_is_refused(transport):
    receiver, ticket, dst = _one_receiver(transport)
    header, payload = _layer0_chunk(num_heads=2)
    tampered = bytearray(payload)
    tampered[len(tampered) // 2] ^= 0x40
    header.checksum = payload_mac(ticket.secret, payload)
    with pytest.raises(TransferRefused, match="checksum"):
        transport.connect(ticket.receiver_endpoints[0]).send(encode_header(header, ticket.secret), bytes(tampered), 5)
    status = receiver.poll("req-1")
    assert status.state is TransferState.FAILED and "checksum" in status.reason
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])


def test_a_mac_under_another_key_is_refused_and_the_right_one_lands(transport):
    receiver, ticket, dst = _one_receiver(transport)
    header, payload = _layer0_chunk(num_heads=2)
    header.checksum = payload_mac(b"not the ticket's secret", payload)
    channel = transport.connect(ticket.receiver_endpoints[0])
    with pytest.raises(TransferRefused, match="checksum"):
        channel.send(encode_header(header, ticket.secret), payload, 5)
    assert receiver.poll("req-1").state is TransferState.FAILED

    receiver, ticket, dst = _one_receiver(transport)  # a fresh transfer, MAC'd under its own secret
    header.checksum = payload_mac(ticket.secret, payload)
    transport.connect(ticket.receiver_endpoints[0]).send(encode_header(header, ticket.secret), payload, 5)
    assert receiver.poll("req-1").state is not TransferState.FAILED
    assert torch.count_nonzero(dst.caches[0][0]) > 0


def test_mismatched_layout_is_refused_at_ticket_time(transport):
    _, ticket, _ = _one_receiver(transport)
    for bad, match in [
        (layout_for(1, 0, head_dim=16), "head_dim"),
        (layout_for(1, 0, dtype="bfloat16"), "dtype"),
        (layout_for(1, 0, block_size=8), "block size"),
    ]:
        with pytest.raises(TicketError, match=match):
            KVSender(bad, "m", transport).start(ticket, [1, 2, 3, 4])
    with pytest.raises(TicketError, match="model mismatch"):
        KVSender(layout_for(1, 0), "other-model", transport).start(ticket, [1, 2, 3, 4])


def test_many_concurrent_transfers(transport):
    src, full = make_side(2, fill=True, num_blocks=64, shared=pulls(transport))
    dst, _ = make_side(1, fill=False, num_blocks=64)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0])
    endpoint = transport.serve(receiver)
    senders = [KVSender(src.layouts[s], "m", transport) for s in range(2)]
    tickets = []
    for i in range(8):
        ticket = make_ticket(
            f"r{i}", transport.name, [endpoint], dst.layouts[0], "m", [40 + i * 3, 41 + i * 3, 42 + i * 3], 10, 30
        )
        receiver.expect(ticket)
        tickets.append(ticket)
    for i, ticket in enumerate(tickets):
        for sender in senders:
            sender.start(ticket, [i * 3, i * 3 + 1, i * 3 + 2])
    for layer in range(3):  # interleaved, as concurrent prefills would be
        for ticket in tickets:
            for s, sender in enumerate(senders):
                sender.send_layer(ticket.request_id, layer, src.caches[s][layer])
    for ticket in tickets:
        for sender in senders:
            sender.finish(ticket.request_id, 0)
    states = wait_terminal([lambda t=t: receiver.poll(t.request_id) for t in tickets])
    assert all(s.state is TransferState.DONE for s in states)
    for i, ticket in enumerate(tickets):
        assert_bit_exact(full, dst, [i * 3, i * 3 + 1, i * 3 + 2], ticket.block_ids, 3)
    for sender in senders:
        sender.close()


def test_a_chunk_with_fewer_heads_than_planned_is_refused(transport):
    _, ticket, dst = _one_receiver(transport)
    header, payload = _layer0_chunk(num_heads=1)
    with pytest.raises(TransferRefused, match="planned"):
        transport.connect(ticket.receiver_endpoints[0]).send(encode_header(header, ticket.secret), payload, 5)
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])


def test_payload_checks_per_mode():
    payload, key = bytes(range(256)) * 64, b"k" * 32
    parts = (payload[:1000], memoryview(payload)[1000:])  # a payload sent in pieces checks as one
    assert payload_check("none", key, *parts) is None
    assert payload_check("crc32", key, *parts) == zlib.crc32(payload)
    mac = payload_check("mac", key, *parts)
    assert isinstance(mac, bytes) and len(mac) == 32 and mac == payload_mac(key, payload, nonce=mac[:16])
    # A fresh nonce, so a fresh one-time Poly1305 key, for every payload: the same bytes tag apart.
    assert payload_mac(key, payload)[:16] != mac[:16] and payload_mac(key, payload)[16:] != mac[16:]
    assert not payload_matches(mac, b"j" * 32, payload)  # another ticket's secret
    changed = bytes([payload[0] ^ 1]) + payload[1:]
    for expected in (zlib.crc32(payload), mac):
        assert payload_matches(expected, key, *parts) and not payload_matches(expected, key, changed)
    # A tag moved to another nonce, or cut short, is refused.
    assert not payload_matches(bytes(16) + mac[16:], key, payload)
    assert not payload_matches(mac[:16], key, payload) and not payload_matches(mac[16:], key, payload)
    # Longer than a slice of the hash's updates (1 MiB): sliced or whole, one tag.
    big = bytes(range(256)) * (5 << 12)
    big_mac = payload_mac(key, memoryview(big)[:3_000_000], big[3_000_000:])
    assert payload_matches(big_mac, key, big)
    assert payload_matches(None, key, changed)
    with pytest.raises(ValueError, match="integrity='sha1'"):
        KVSender(layout_for(1, 0), "m", transport_named("inproc"), integrity="sha1")


# --- windows: a transfer's blocks leaving in consecutive ranges (a prefill's prompt chunks) ---


@pytest.mark.parametrize(("sender_tp", "receiver_tp"), [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("windows", [[1, 2, 1], [3, 1]])
def test_a_transfer_in_windows_lands_bit_exact(transport, sender_tp, receiver_tp, windows):
    # Fragmented source blocks and reversed reserved ones: every window is gathered and scattered.
    receivers, senders, ticket, full, dst, src_blocks = transfer(
        transport, sender_tp, receiver_tp, src_blocks=[9, 3, 4, 12], windows=windows
    )
    rx = wait_terminal([lambda r=r: r.poll("req-1") for r in receivers])
    tx = wait_terminal([lambda s=s: s.poll("req-1") for s in senders])
    assert all(s.state is TransferState.DONE for s in rx + tx), [(s.state, s.reason) for s in rx + tx]
    assert all(s.first_token_id == 42 and s.layers_complete == 3 for s in rx)
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    untouched = [b for b in range(dst.layouts[0].num_blocks) if b not in ticket.block_ids[: ticket.num_blocks]]
    assert all(torch.count_nonzero(layer[:, untouched]) == 0 for shard in dst.caches for layer in shard)
    assert [s.stats("req-1").num_windows for s in senders] == [len(windows)] * sender_tp
    assert senders[0].stats("req-1").num_layers == 3
    for s in senders:
        s.close()


def test_a_sender_that_finishes_with_blocks_unsent_fails_and_the_receiver_never_completes(transport):
    src, _, receiver, sender = _layer_by_layer(transport, lease_s=30.0, windows=[2])
    for layer in range(3):
        sender.send_layer("req-1", layer, src.caches[0][layer])
    sender.finish("req-1", 5)  # two of the ticket's four blocks sent
    (tx,) = wait_terminal([lambda: sender.poll("req-1")])
    assert tx.state is TransferState.FAILED and "2 of the ticket's 4 blocks" in tx.reason, tx
    assert receiver.poll("req-1").state is TransferState.TRANSFERRING  # no "done" reached it
    receiver.release("req-1")
    sender.close()


def test_cancel_fails_a_transfer_after_the_layers_queued_before_it(transport):
    src, dst, receiver, sender = _layer_by_layer(transport, lease_s=30.0, windows=[2])
    sender.send_layer("req-1", 0, src.caches[0][0])
    sender.cancel("req-1", "aborted mid-prompt")
    sender.send_layer("req-1", 1, src.caches[0][1])  # after the cancel: never sent
    (tx,) = wait_terminal([lambda: sender.poll("req-1")])
    assert tx.state is TransferState.FAILED and tx.reason == "aborted mid-prompt"
    assert tx.layers_sent == 1
    assert receiver.poll("req-1").state is TransferState.TRANSFERRING
    assert torch.count_nonzero(dst.caches[0][1]) == 0
    receiver.release("req-1")
    sender.close()


def test_a_chunk_whose_window_is_outside_the_ticket_is_refused(transport):
    receiver, ticket, dst = _one_receiver(transport)
    channel = transport.connect(ticket.receiver_endpoints[0])
    for offset, count in [(3, 2), (-1, 1), (0, 0)]:
        header, payload = _layer0_chunk(num_heads=2, block_offset=offset, num_blocks=count)
        with pytest.raises(TransferRefused, match="not among the ticket's 4"):
            channel.send(encode_header(header, ticket.secret), payload, 5)
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])
    assert receiver.refusals["shape"] == 3 and receiver.poll("req-1").state is TransferState.PENDING


@pytest.mark.parametrize("windows", [[[0, 2]], [[0, 2], [1, 3]], [[0, 2], [3, 1]], [[0, 4], [4, 1]], "x"])
def test_a_done_whose_windows_do_not_tile_the_ticket_fails_the_transfer(windows):
    transport = transport_named("tcp")
    try:
        receiver, ticket, _ = _one_receiver(transport)
        channel = transport.connect(ticket.receiver_endpoints[0])
        done = ChunkHeader(kind="done", request_id="req-1", sender_rank=0, sender_tp=1, receiver_rank=0)
        done.windows = windows
        channel.send(encode_header(done, ticket.secret), b"", 5)
        (rx,) = wait_terminal([lambda: receiver.poll("req-1")])
        assert rx.state is TransferState.FAILED and "do not tile" in rx.reason, rx
    finally:
        transport.shutdown()


def test_a_done_announcing_one_window_is_not_met_by_the_chunks_of_a_smaller_one():
    # Every layer of blocks [0, 2) lands, then the "done" announces the whole ticket as one window
    # [0, 4): blocks 2 and 3 never came, so the transfer fails instead of counting the smaller window.
    transport = transport_named("tcp")
    try:
        receiver, ticket, _ = _one_receiver(transport)
        channel = transport.connect(ticket.receiver_endpoints[0])
        for layer in range(3):
            header, payload = _layer0_chunk(num_heads=2, num_blocks=2)
            header.layer = layer
            channel.send(encode_header(header, ticket.secret), payload, 5)
        assert receiver.poll("req-1").layers_complete == 3
        done = ChunkHeader(kind="done", request_id="req-1", sender_rank=0, sender_tp=1, receiver_rank=0)
        done.first_token_id, done.windows = 7, [[0, 4]]
        channel.send(encode_header(done, ticket.secret), b"", 5)
        (rx,) = wait_terminal([lambda: receiver.poll("req-1")])
        assert rx.state is TransferState.FAILED and "3 chunks missing, 3 outside its windows" in rx.reason, rx
    finally:
        transport.shutdown()
