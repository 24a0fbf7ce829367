"""The torch.distributed backend beyond the shared transfer tests: loopback-only serving, one pair
group per sender, bounded pairs and payloads, idle pairs, peers that stall or die mid-transfer
(real processes, SIGSTOP/SIGKILL), and CUDA payloads over NCCL (two GPUs; skipped without)."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import secrets
import signal
import threading
import time

import pytest
import torch

from kv_transfer import KVReceiver, KVSender, TransferState, make_ticket
from kv_transfer.backends import torch_dist
from kv_transfer.backends.torch_dist import TorchDistTransport
from kv_transfer.protocol import ChunkHeader, checksum, encode_header
from kv_transfer.transport import TransferRefused
from tests.kv_transfer.harness import (
    a_killed_receiver_fails_the_sender,
    assert_bit_exact,
    made_transports,
    make_side,
    transfer,
    wait_terminal,
    wait_until,
)

_LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


@pytest.fixture
def transports():
    yield from made_transports(TorchDistTransport)


def _serve_one(transport: TorchDistTransport, lease_s: float = 30.0):
    dst, _ = make_side(1, fill=False)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], "torch")
    ticket = make_ticket("req-1", "torch", [transport.serve(receiver)], dst.layouts[0], "m", [1, 2, 3, 4], 13, lease_s)
    receiver.expect(ticket)
    return receiver, ticket, dst


def _listening_sockets() -> dict[int, str]:
    """inode -> hex local address of every listening TCP socket this process holds (Linux /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[9]) in inodes:  # 0A: LISTEN
                    found[int(fields[9])] = fields[1].split(":")[0]
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc")
def test_store_and_gloo_listen_on_loopback_only(transports, monkeypatch):
    monkeypatch.setattr(torch_dist, "_devices", {})  # so this test's pair makes (and we see) its gloo listener
    before = set(_listening_sockets())
    transport = transports()
    _, ticket, _ = _serve_one(transport)
    assert ticket.receiver_endpoints[0].startswith("torch://127.0.0.1:")
    channel = transport.connect(ticket.receiver_endpoints[0])
    with contextlib.suppress(TransferRefused):  # an authentic header (its payload is refused): pairs up,
        channel.send(_signed_header(ticket), b"", 5)  # so the store and both gloo ends are live now
    assert channel.num_connects == 1
    new = {inode: address for inode, address in _listening_sockets().items() if inode not in before}
    assert len(new) >= 2, new  # the store and the gloo device
    assert set(new.values()) <= _LOOPBACK, new  # TCPStore alone would listen on every interface
    channel.close()


def test_two_senders_get_their_own_pair_groups(transports):
    transport = transports()
    receivers, senders, ticket, full, dst, src_blocks = transfer(transport, 2, 1)
    states = wait_terminal([lambda: receivers[0].poll("req-1")] + [lambda s=s: s.poll("req-1") for s in senders])
    assert all(s.state is TransferState.DONE for s in states), [(s.state, s.reason) for s in states]
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    assert transport.num_pairs() == 2  # one 2-rank group per sender channel, not one shared world
    for sender in senders:
        sender.close()
    assert wait_until(lambda: transport.num_pairs() == 0)  # a closed channel ends its receiver-side pair thread


def test_pairs_beyond_the_limit_are_refused(transports):
    transport = transports(max_pairs=1)
    _, ticket, _ = _serve_one(transport)
    first, second = (transport.connect(ticket.receiver_endpoints[0]) for _ in range(2))
    header = _signed_header(ticket)  # pairs (a ticket's), then its empty payload is refused
    with pytest.raises(TransferRefused, match="bytes"):
        first.send(header, b"", 5)
    with pytest.raises(ConnectionError, match="limit of 1 concurrent pairs"):
        second.send(header, b"", 5)
    first.close()
    assert wait_until(lambda: transport.num_pairs() == 0)
    with pytest.raises(TransferRefused, match="bytes"):  # a slot freed up
        second.send(header, b"", 5)
    second.close()


def test_oversized_payload_is_refused_and_the_pair_stays_usable(transports):
    transport = transports(max_payload_bytes=64)
    receiver, ticket, _ = _serve_one(transport)
    channel = transport.connect(ticket.receiver_endpoints[0])
    with pytest.raises(TransferRefused, match="exceeds this receiver's limit of 64"):
        channel.send(_signed_header(ticket), b"x" * 65, 5)
    with pytest.raises(TransferRefused, match="malformed"):  # the next chunk is read in step
        channel.send(b"junk", b"x" * 64, 5)
    assert transport.num_pairs() == 1
    assert receiver.poll("req-1").state is TransferState.PENDING
    channel.close()


def test_idle_pairs_close_and_senders_pair_again(transports):
    transport = transports(pair_idle_s=0.6)
    _, ticket, _ = _serve_one(transport)
    channel = transport.connect(ticket.receiver_endpoints[0])
    with pytest.raises(TransferRefused):
        channel.send(_signed_header(ticket), b"", 5)
    assert transport.num_pairs() == 1
    assert wait_until(lambda: transport.num_pairs() == 0, 3)  # the receiver closed the idle pair
    with pytest.raises(TransferRefused, match="bytes"):  # the sender notices and pairs afresh
        channel.send(_signed_header(ticket), b"", 5)
    assert transport.num_pairs() == 1
    channel.close()


def test_shutdown_refuses_new_senders_at_once(transports):
    transport = transports()
    _, ticket, _ = _serve_one(transport)
    transport.shutdown()
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="no KV receiver"):
        transport.connect(ticket.receiver_endpoints[0]).send(b"junk", b"", 5)
    assert time.monotonic() - start < 1


# --- peers in other processes --------------------------------------------------------------


def _receiver_process(out: mp.Queue, lease_s: float) -> None:
    dst, _ = make_side(1, fill=False)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], "torch")
    transport = TorchDistTransport()
    ticket = make_ticket("req-1", "torch", [transport.serve(receiver)], dst.layouts[0], "m", [1, 2, 3, 4], 13, lease_s)
    receiver.expect(ticket)
    out.put(ticket)
    time.sleep(120)  # stopped or killed by the test long before


def _sender_process(tickets: mp.Queue, progress: mp.Queue) -> None:
    src, _ = make_side(1, fill=True)
    sender = KVSender(src.layouts[0], "m", TorchDistTransport())
    progress.put("ready")
    ticket = tickets.get(timeout=60)  # made once this process is up, so a short lease covers only the transfer
    sender.start(ticket, [7, 8, 9, 10])
    sender.send_layer(ticket.request_id, 0, src.caches[0][0])
    while sender.poll(ticket.request_id).layers_sent < 1:
        time.sleep(0.01)
    progress.put(1)
    time.sleep(120)  # killed before sending the other layers


@pytest.fixture
def receiver_process():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver_process, args=(out, 30.0), daemon=True)
    proc.start()
    yield proc, out.get(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.join(10)


@pytest.mark.slow
def test_stalled_receiver_times_out_instead_of_hanging(transports, receiver_process):
    proc, ticket = receiver_process
    channel = transports().connect(ticket.receiver_endpoints[0])
    with pytest.raises(TransferRefused, match="bytes"):
        channel.send(_signed_header(ticket), b"x" * 1024, 5)  # paired (its payload refused)
    os.kill(proc.pid, signal.SIGSTOP)  # alive but silent, like a wedged host
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        channel.send(_signed_header(ticket), b"x" * (4 << 20), 1.0)
    assert time.monotonic() - start < 3
    channel.close()
    # A sender that pairs only now, with the receiver stopped, gives up within its deadline too.
    start = time.monotonic()
    with pytest.raises((TimeoutError, ConnectionError)):
        transports().connect(ticket.receiver_endpoints[0]).send(_signed_header(ticket), b"x", 1.0)
    assert time.monotonic() - start < 3


@pytest.mark.slow
def test_receiver_killed_mid_transfer_fails_the_sender_within_the_lease(transports, receiver_process):
    proc, ticket = receiver_process
    kill = lambda: (proc.kill(), proc.join(10))  # noqa: E731
    _, seconds = a_killed_receiver_fails_the_sender(transports(), ticket, kill, [7, 8, 9, 10], layers_before=1)
    assert seconds < 5


@pytest.mark.slow
def test_sender_killed_mid_transfer_fails_the_receiver_at_lease_expiry(transports):
    ctx = mp.get_context("spawn")
    tickets, progress = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_sender_process, args=(tickets, progress), daemon=True)
    proc.start()
    try:
        transport = transports()
        assert progress.get(timeout=60) == "ready"
        receiver, ticket, _ = _serve_one(transport, lease_s=3)
        tickets.put(ticket)
        progress.get(timeout=10)
        assert receiver.poll("req-1").state is TransferState.TRANSFERRING
        assert transport.num_pairs() == 1
        proc.kill()
        proc.join(10)
        assert wait_until(lambda: transport.num_pairs() == 0, 3)  # the pair thread saw the peer go and exited
        (status,) = wait_terminal([lambda: receiver.poll("req-1")], timeout_s=10)
        assert status.state is TransferState.FAILED and "lease expired" in status.reason
    finally:
        proc.kill()


def _cuda_receiver_process(out: mp.Queue, sent: mp.Queue) -> None:
    dst, _ = make_side(1, fill=False)
    caches = [layer.to("cuda:1") for layer in dst.caches[0]]
    receiver = KVReceiver(caches, dst.layouts[0], "torch")
    transport = TorchDistTransport()
    ticket = make_ticket("req-1", "torch", [transport.serve(receiver)], dst.layouts[0], "m", [1, 2, 3, 4], 13, 30)
    receiver.expect(ticket)
    out.put(ticket)
    expected = sent.get(timeout=120)  # the layer's bytes, once the sender has its verdict
    status = receiver.poll("req-1")
    landed = caches[0][:, 1:5].contiguous().cpu().numpy().tobytes()
    out.put((status.state.name, status.layers_complete, landed == expected))
    time.sleep(120)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_payload_travels_over_nccl(transports):
    # NCCL refuses two ranks on one device, so receiver and sender sit on different GPUs.
    ctx = mp.get_context("spawn")
    out, sent = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_cuda_receiver_process, args=(out, sent), daemon=True)
    proc.start()
    try:
        ticket = out.get(timeout=120)
        layer = torch.randn(2, ticket.num_blocks, 4, 2, 8, device="cuda:0")
        payload = layer.view(torch.uint8).flatten()
        header = ChunkHeader(
            kind="layer", request_id="req-1", sender_rank=0, sender_tp=1, receiver_rank=0, layer=0, num_heads=2,
            num_blocks=ticket.num_blocks, nbytes=payload.numel(), checksum=checksum(payload.cpu().numpy().tobytes()),
        )  # fmt: skip
        channel = transports().connect(ticket.receiver_endpoints[0])
        channel.send(encode_header(header, ticket.secret), payload, 30)  # the receiver checked the CRC
        channel.close()
        sent.put(layer.contiguous().cpu().numpy().tobytes())
        # The receiver's own view: the layer landed, byte for byte, in the reserved blocks on its GPU.
        assert out.get(timeout=60) == ("TRANSFERRING", 1, True)
    finally:
        proc.kill()


def _pair_by_hand(endpoint: str, hello: bytes) -> dict:
    """A sender's pairing, its hello as given: the receiver's verdict."""
    import msgpack
    import torch.distributed as dist

    host, _, port = endpoint.removeprefix("torch://").rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))
    pair_id = secrets.token_hex(16)
    store.set(f"pair/{pair_id}/hello", hello)
    store.queue_push("pairs/queue", pair_id)
    store.wait([f"pair/{pair_id}/verdict"], datetime.timedelta(seconds=10))
    return msgpack.unpackb(store.get(f"pair/{pair_id}/verdict"))


def _signed_header(ticket, secret: bytes | None = None) -> bytes:
    header = ChunkHeader(
        kind="layer", request_id=ticket.request_id, sender_rank=0, sender_tp=1, receiver_rank=0,
        layer=0, num_heads=2, num_blocks=ticket.num_blocks, nbytes=0,
    )  # fmt: skip
    return encode_header(header, secret or ticket.secret)


def test_only_a_sender_holding_a_ticket_pairs_and_nccl_only_with_kv_on_gpus_at_both_ends(transports):
    import msgpack

    transport = transports()
    receiver, ticket, _ = _serve_one(transport)
    endpoint = ticket.receiver_endpoints[0]
    header = _signed_header(ticket)
    # A sender whose KV is on a GPU, to a receiver whose cache is on the host: no NCCL.
    verdict = _pair_by_hand(endpoint, msgpack.packb({"device": "cuda", "gpu": "GPU-x", "header": header}))
    assert verdict["ok"] and verdict["device"] == "cpu" and verdict["nccl"] is False
    # No header, a forged one, another request's: no pair (7f34ac8 paired anyone who reached the store).
    for hello in (b"", msgpack.packb({"device": "cpu"}), msgpack.packb({"header": _signed_header(ticket, b"x" * 32)})):
        verdict = _pair_by_hand(endpoint, hello)
        assert not verdict["ok"] and verdict["refused"], verdict
    assert receiver.refusals["bad_signature"] == 1
    # A channel on the host pairs without NCCL; a chunk it cannot sign never pairs.
    channel = transports().connect(endpoint)
    with pytest.raises(TransferRefused):
        channel.send(b"junk", b"x", 5)
    assert channel.num_connects == 0
    channel.close()


def test_strangers_writing_to_the_pairing_store_do_not_hold_pairing_up(transports):
    """Unauthenticated writes to the store, every 50 ms, from before the sender pairs until its
    transfer is done: the old pair counter pushed a million ahead (7f34ac8 paired by that counter:
    one push stalled pairing for a deadline, pushes every half second stopped it), ids announced with
    no hello behind them, and bytes that are no id at all. Pairing skips them and the transfer lands."""
    import torch.distributed as dist

    stop, rounds = threading.Event(), []

    def poison(ticket) -> None:
        host, _, port = ticket.receiver_endpoints[0].removeprefix("torch://").rpartition(":")
        stranger = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))

        def keep_at_it() -> None:
            while not stop.wait(0.05):
                stranger.add("pairs/next", 10**6)
                stranger.queue_push("pairs/queue", secrets.token_hex(16))
                stranger.queue_push("pairs/queue", b"\xff not an id")
                rounds.append(1)

        threading.Thread(target=keep_at_it, daemon=True).start()
        while len(rounds) < 3:
            time.sleep(0.02)

    transport = transports(connect_timeout_s=4.0)
    try:
        receivers, senders, ticket, full, dst, src_blocks = transfer(transport, 1, 1, before_send=poison)
        states = wait_terminal([lambda: receivers[0].poll("req-1"), lambda: senders[0].poll("req-1")])
    finally:
        stop.set()
    assert all(s.state is TransferState.DONE for s in states), [(s.state, s.reason) for s in states]
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    (endpoint,) = transport._endpoints
    assert endpoint.num_ids_skipped >= 6  # the stranger's ids were popped and passed over
    senders[0].close()
