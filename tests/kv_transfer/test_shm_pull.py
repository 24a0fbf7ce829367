"""The shared-memory backend's one-copy path: a receiver reads a sender's cache in place, and only
what an authenticated header names, inside the region the sender shared."""

from __future__ import annotations

import mmap
import os
import threading
import time
import zlib

import msgpack
import pytest
import torch

from common.shared_memory import close_shared_region, create_shared_region, find_shared_region, map_shared_region
from engine.kv_cache_memory import allocate_kv_caches, release_kv_caches
from kv_transfer import KVReceiver, KVSender, TransferState, make_ticket
from kv_transfer.protocol import encode_header
from kv_transfer.transport import TransferRefused
from tests.kv_transfer.harness import PullShm, assert_bit_exact, layer_chunk_header, make_side, transfer, wait_terminal


@pytest.fixture
def transport():
    t = PullShm()
    yield t
    t.shutdown()


def _shm_files() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_a_shared_source_is_pulled_without_staging_and_leaves_nothing_behind(transport):
    before = _shm_files()
    receivers, senders, ticket, full, dst, src_blocks = transfer(transport, 2, 1, total_kv_heads=2, num_tokens=30)
    states = wait_terminal([lambda: receivers[0].poll("req-1")] + [lambda s=s: s.poll("req-1") for s in senders])
    assert all(s.state is TransferState.DONE for s in states), [(s.state, s.reason) for s in states]
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    assert _shm_files() <= before  # while connections are open: memfd regions have no name in /dev/shm
    for sender in senders:
        channels = list(sender._channels.values())
        assert channels and all(ch.staging_region is None for ch in channels)  # no staging copy was made
        sender.close()


def test_shared_kv_caches_are_zeroed_views_of_one_region():
    layers, region = allocate_kv_caches((2, 4, 4, 2, 8), 3, torch.bfloat16, torch.device("cpu"), shared=True)
    try:
        assert region is not None and all(torch.count_nonzero(layer) == 0 for layer in layers)
        layer_bytes = layers[0].numel() * layers[0].element_size()
        for i, layer in enumerate(layers):
            found = find_shared_region(layer.data_ptr(), layer_bytes)
            assert found is not None and found[0] is region and found[1] == i * layer_bytes
        assert find_shared_region(layers[-1].data_ptr() + 2, layer_bytes) is None  # runs past the end
    finally:
        release_kv_caches(region)
    assert find_shared_region(layers[0].data_ptr(), 1) is None


def test_a_peer_maps_the_region_read_only():
    region = create_shared_region(4096)
    try:
        region.buffer[:4] = b"kv!!"
        peer = map_shared_region(region.fd, 4096)
        assert peer[:4] == b"kv!!"
        with pytest.raises(TypeError):
            peer[:4] = b"nope"
        with pytest.raises(ValueError, match="holds 4096 bytes"):
            map_shared_region(region.fd, 8192)
    finally:
        close_shared_region(region)


def test_a_region_can_never_shrink_under_a_peer_and_an_unsealed_one_is_not_mapped():
    """7f34ac8: a sender could ftruncate its memfd under the receiver's mapping, and the
    receiver's next read of it raised SIGBUS (the whole decode replica died)."""
    import os

    region = create_shared_region(8192)
    try:
        peer = map_shared_region(region.fd, 8192)
        for size in (0, 4096, 16384):
            with pytest.raises(PermissionError):
                os.ftruncate(region.fd, size)
        assert bytes(peer[-4:]) == b"\0" * 4  # still readable to its end
    finally:
        close_shared_region(region)
    unsealed = os.memfd_create("stranger", os.MFD_CLOEXEC)
    try:
        os.ftruncate(unsealed, 8192)
        with pytest.raises(ValueError, match="not sealed"):
            map_shared_region(unsealed, 8192)
    finally:
        os.close(unsealed)


def test_the_descriptor_a_receiver_gets_is_read_only(transport):
    # What _share sends: a read-only reopen of the region, which cannot be mapped writable or resized.
    region = create_shared_region(4096)
    read_only = os.open(f"/proc/self/fd/{region.fd}", os.O_RDONLY)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(read_only, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.ftruncate(read_only, 1 << 20)
        assert os.fstat(region.fd).st_size == 4096
    finally:
        os.close(read_only)
        close_shared_region(region)


@pytest.fixture
def pulled_chunk(transport):
    """A receiver expecting one request, a channel that has shared a source cache with it, and a
    function building a signed layer-0 header that points into that cache."""
    src, _ = make_side(1, fill=True, shared=True)
    dst, _ = make_side(1, fill=False)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], "shm")
    ticket = make_ticket("req-1", "shm", [transport.serve(receiver)], dst.layouts[0], "m", [1, 2, 3, 4], 13, 30)
    receiver.expect(ticket)
    channel = transport.connect(ticket.receiver_endpoints[0])
    region, offset = channel.pull_source(src.caches[0][0])
    layer = src.caches[0][0]

    def header(secret: bytes = ticket.secret, **changes) -> bytes:
        fields = dict(
            num_heads=2,
            num_blocks=4,
            nbytes=2 * 4 * 4 * 2 * 8 * 4,
            src_region=region,
            src_offset=offset,
            src_num_blocks=layer.shape[1],
            src_heads=2,
            src_block_ids=[7, 8, 9, 10],
        )
        return encode_header(layer_chunk_header(**{**fields, **changes}), secret)

    yield receiver, channel, header, src, dst
    channel.close()


def test_a_pulled_chunk_lands_exactly(pulled_chunk):
    receiver, channel, header, src, dst = pulled_chunk
    channel.send(header(), b"", 5)
    assert torch.equal(dst.caches[0][0][:, [1, 2, 3, 4]], src.caches[0][0][:, [7, 8, 9, 10]])
    assert receiver.poll("req-1").state is TransferState.TRANSFERRING


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(src_offset=1 << 40), "outside the shared region"),
        (dict(src_offset=-64), "outside the shared region"),
        (dict(src_region=999), "region 999 is unknown"),
        (dict(src_block_ids=[7, 8, 9, 10_000]), "source block ids out of range"),
        (dict(src_block_ids=[7, 8, 9]), "3 source blocks for 4"),
        (dict(src_heads=1), "source heads out of range"),
        (dict(nbytes=64), "expected"),
        (dict(batch=[[0, None, 0, None], [1, None, 0, None]]), "not \\[layer, region, offset, checksum\\]"),
    ],
)
def test_a_pulled_chunk_outside_its_bounds_is_refused_and_reads_nothing(pulled_chunk, changes, match):
    receiver, channel, header, _, dst = pulled_chunk
    with pytest.raises(TransferRefused, match=match):
        channel.send(header(**changes), b"", 5)
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])
    assert receiver.poll("req-1").state is TransferState.PENDING


def test_a_pulled_chunk_without_the_secret_is_refused(pulled_chunk):
    receiver, channel, header, _, dst = pulled_chunk
    with pytest.raises(TransferRefused, match="signature"):
        channel.send(header(secret=b"x" * 32), b"", 5)
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])
    assert receiver.refusals["bad_signature"] == 1


def test_a_pulled_chunk_with_a_wrong_checksum_fails_the_request(pulled_chunk):
    receiver, channel, header, src, _ = pulled_chunk
    good = zlib.crc32(src.caches[0][0][:, [7, 8, 9, 10]].contiguous().numpy().tobytes())
    with pytest.raises(TransferRefused, match="checksum"):
        channel.send(header(checksum=good ^ 1), b"", 5)
    status = receiver.poll("req-1")
    assert status.state is TransferState.FAILED and "checksum" in status.reason
    assert receiver.refusals["checksum"] == 1


def test_a_wrong_checksum_inside_a_pulled_batch_fails_the_request_after_the_layers_before_it(pulled_chunk):
    receiver, channel, header, src, _ = pulled_chunk
    body = msgpack.unpackb(msgpack.unpackb(header())["body"])
    layer_bytes = src.caches[0][0].numel() * 4
    crcs = [zlib.crc32(src.caches[0][i][:, [7, 8, 9, 10]].contiguous().numpy().tobytes()) for i in range(3)]
    crcs[1] ^= 1  # layer 1 arrives corrupted
    batch = [[i, body["src_region"], body["src_offset"] + i * layer_bytes, crcs[i]] for i in range(3)]
    with pytest.raises(TransferRefused, match="checksum mismatch in layer 1"):
        channel.send(header(batch=batch, checksum=crcs[0]), b"", 5)
    status = receiver.poll("req-1")
    assert status.state is TransferState.FAILED and "checksum mismatch in layer 1" in status.reason
    assert receiver.refusals["checksum"] == 1
    stats = receiver.stats("req-1")
    assert stats is not None and stats.num_bytes == 2 * 4 * 4 * 2 * 8 * 4  # layer 0 counted as landed, only


def test_a_pulled_chunk_with_the_right_checksum_lands(pulled_chunk):
    _, channel, header, src, dst = pulled_chunk
    good = zlib.crc32(src.caches[0][0][:, [7, 8, 9, 10]].contiguous().numpy().tobytes())
    channel.send(header(checksum=good), b"", 5)
    assert torch.equal(dst.caches[0][0][:, [1, 2, 3, 4]], src.caches[0][0][:, [7, 8, 9, 10]])


def test_sender_checksums_cover_pulled_chunks(transport):
    receivers, senders, ticket, full, dst, src_blocks = transfer(transport, 1, 1, integrity="crc32")
    (status,) = wait_terminal([lambda: receivers[0].poll("req-1")])
    assert status.state is TransferState.DONE
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    assert receivers[0].refusals["checksum"] == 0
    senders[0].close()


def test_a_private_tensor_is_not_pulled(transport):
    channel = transport.connect("shm:///nonexistent/recv.sock")
    assert channel.pull_source(torch.zeros(2, 4, 4, 2, 8)) is None  # no region: staged, nothing sent
    shared, region = allocate_kv_caches((2, 4, 4, 2, 8), 1, torch.float32, torch.device("cpu"), shared=True)
    try:
        assert channel.pull_source(shared[0][:, 1:3]) is None  # not contiguous: staged
    finally:
        release_kv_caches(region)


def test_sender_and_receiver_agree_on_a_sender_without_regions(transport):
    # A KVSender whose cache is private still works over the same transport (staged copies).
    src, full = make_side(1, fill=True)
    dst, _ = make_side(1, fill=False)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], "shm")
    ticket = make_ticket("req-1", "shm", [transport.serve(receiver)], dst.layouts[0], "m", [1, 2, 3, 4], 13, 30)
    receiver.expect(ticket)
    sender = KVSender(src.layouts[0], "m", transport)
    sender.start(ticket, [7, 8, 9, 10])
    for layer, kv in enumerate(src.caches[0]):
        sender.send_layer("req-1", layer, kv)
    sender.finish("req-1", 3)
    assert wait_terminal([lambda: receiver.poll("req-1")])[0].state is TransferState.DONE
    assert all(ch.staging_region is not None for ch in sender._channels.values())
    assert_bit_exact(full, dst, [7, 8, 9, 10], ticket.block_ids, 4)
    sender.close()


def test_a_late_refusal_of_a_pulled_chunk_fails_its_own_request_only(transport):
    # Pulled chunks are posted without waiting; their verdicts come back later, in order. A refusal
    # must fail the request it belongs to, not whichever request the sender is busy with by then.
    src, full = make_side(1, fill=True, shared=True)
    dst, _ = make_side(1, fill=False)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], "shm")
    endpoint = transport.serve(receiver)
    known = make_ticket("known", "shm", [endpoint], dst.layouts[0], "m", [1, 2, 3, 4], 13, 30)
    stranger = make_ticket("stranger", "shm", [endpoint], dst.layouts[0], "m", [5, 6, 7, 8], 13, 30)
    receiver.expect(known)  # "stranger" was never registered: its chunks are refused
    sender = KVSender(src.layouts[0], "m", transport)
    for ticket, blocks in ((stranger, [7, 8, 9, 10]), (known, [11, 12, 13, 14])):
        sender.start(ticket, blocks)
    for layer, kv in enumerate(src.caches[0]):
        for ticket in (stranger, known):
            sender.send_layer(ticket.request_id, layer, kv)
    for ticket in (stranger, known):
        sender.finish(ticket.request_id, 0)
    bad, good = wait_terminal([lambda: sender.poll("stranger"), lambda: sender.poll("known")])
    assert bad.state is TransferState.FAILED and "no ticket" in bad.reason
    assert good.state is TransferState.DONE, good.reason
    assert wait_terminal([lambda: receiver.poll("known")])[0].state is TransferState.DONE
    assert_bit_exact(full, dst, [11, 12, 13, 14], known.block_ids, 4)
    assert torch.count_nonzero(torch.stack([layer[:, [5, 6, 7, 8]] for layer in dst.caches[0]])) == 0
    sender.close()


@pytest.mark.parametrize("shared", [False, True], ids=["staged", "pulled"])
def test_a_connection_the_receiver_closed_while_idle_is_reopened(shared):
    transport = PullShm(idle_timeout_s=0.3)
    src, full = make_side(1, fill=True, shared=shared)
    dst, _ = make_side(1, fill=False)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], "shm")
    endpoint = transport.serve(receiver)
    sender = KVSender(src.layouts[0], "m", transport)
    try:
        for i, blocks in enumerate(([1, 2, 3, 4], [5, 6, 7, 8])):
            ticket = make_ticket(f"r{i}", "shm", [endpoint], dst.layouts[0], "m", blocks, 13, 30)
            receiver.expect(ticket)
            sender.start(ticket, [7, 8, 9, 10])
            for layer, kv in enumerate(src.caches[0]):
                sender.send_layer(ticket.request_id, layer, kv)
            sender.finish(ticket.request_id, 0)
            status = wait_terminal([lambda t=ticket: sender.poll(t.request_id)])[0]
            assert status.state is TransferState.DONE, status.reason
            assert_bit_exact(full, dst, [7, 8, 9, 10], blocks, 4)
            time.sleep(0.6)  # the receiver drops the idle connection
    finally:
        sender.close()
        transport.shutdown()


def test_layers_queued_behind_a_busy_sender_leave_in_one_chunk(transport, monkeypatch):
    gate, posted = threading.Event(), []
    connect = transport.connect

    def gated_connect(endpoint):
        channel = connect(endpoint)
        pull_sources, post = channel.pull_sources, channel.post

        def slow_pull_sources(tensors):
            gate.wait(10)  # the sender is busy while the forward pass queues more layers
            return pull_sources(tensors)

        def recording_post(header, tag, timeout_s):
            posted.append(msgpack.unpackb(msgpack.unpackb(header)["body"]))
            return post(header, tag, timeout_s)

        channel.pull_sources, channel.post = slow_pull_sources, recording_post
        return channel

    monkeypatch.setattr(transport, "connect", gated_connect)
    receivers, senders, ticket, full, dst, src_blocks = transfer(transport, 1, 1, num_layers=6)
    gate.set()
    assert wait_terminal([lambda: senders[0].poll("req-1")])[0].state is TransferState.DONE
    layers = [entry[0] for chunk in posted for entry in (chunk["batch"] or [[chunk["layer"]]])]
    assert sorted(layers) == list(range(6)) and len(posted) <= 2  # 6 layers, at most 2 messages
    assert receivers[0].poll("req-1").layers_complete == 6
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    senders[0].close()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(batch=[[0, 1, 0]]), "not \\[layer, region, offset, checksum\\]"),
        (dict(batch=[["0", 1, 0, None]]), "not \\[layer, region, offset, checksum\\]"),
        (dict(batch=[[0, 1, 0, None]] * 40), "a batch of 40 layers"),
        (dict(batch=[[0, 1, 0, None]], src_region=-1), "a batch of 1 layers"),
    ],
)
def test_a_malformed_batch_is_refused_and_writes_nothing(pulled_chunk, changes, match):
    receiver, channel, header, _, dst = pulled_chunk
    with pytest.raises(TransferRefused, match=match):
        channel.send(header(**changes), b"", 5)
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])
    assert receiver.refusals["malformed"] == 1


def test_a_batch_lands_every_layer_it_names(pulled_chunk):
    receiver, channel, header, src, dst = pulled_chunk
    layer_bytes = src.caches[0][0].numel() * 4  # the shard's layers sit back to back in its region
    body = msgpack.unpackb(msgpack.unpackb(header())["body"])
    batch = [[layer, body["src_region"], body["src_offset"] + layer * layer_bytes, None] for layer in range(3)]
    channel.send(header(batch=batch), b"", 5)
    for layer in range(3):
        assert torch.equal(dst.caches[0][layer][:, [1, 2, 3, 4]], src.caches[0][layer][:, [7, 8, 9, 10]])
    assert receiver.poll("req-1").layers_complete == 3


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1]], ids=["consecutive", "out of order"])
@pytest.mark.parametrize("stacked", [True, False], ids=["one allocation", "a tensor per layer"])
def test_a_batch_lands_the_same_whatever_the_layer_order_and_cache_allocation(transport, order, stacked):
    src, full = make_side(1, fill=True, shared=True)
    dst, _ = make_side(1, fill=False)
    if not stacked:
        dst.caches[0] = [layer.clone() for layer in dst.caches[0]]
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], "shm")
    assert (receiver._stacked is not None) == stacked
    ticket = make_ticket("req-1", "shm", [transport.serve(receiver)], dst.layouts[0], "m", [9, 3, 4, 5], 13, 30)
    receiver.expect(ticket)
    channel = transport.connect(ticket.receiver_endpoints[0])
    sources = [channel.pull_source(src.caches[0][layer]) for layer in range(3)]
    header = layer_chunk_header(
        layer=order[0],
        num_heads=2,
        num_blocks=4,
        nbytes=2 * 4 * 4 * 2 * 8 * 4,
        src_region=sources[order[0]][0],
        src_offset=sources[order[0]][1],
        src_num_blocks=src.caches[0][0].shape[1],
        src_heads=2,
        src_block_ids=[7, 8, 9, 30],
        batch=[[layer, *sources[layer], None] for layer in order],
    )
    channel.send(encode_header(header, ticket.secret), b"", 5)
    assert_bit_exact(full, dst, [7, 8, 9, 30], [9, 3, 4, 5], 4)
    assert receiver.poll("req-1").layers_complete == 3
    untouched = [b for b in range(dst.layouts[0].num_blocks) if b not in (9, 3, 4, 5)]
    assert all(torch.count_nonzero(layer[:, untouched]) == 0 for layer in dst.caches[0])
    channel.close()


def test_a_late_refusal_is_reported_under_its_own_tag(pulled_chunk):
    # Verdicts of posted chunks come back in order; collect() names the chunk each belongs to.
    _, channel, header, src, dst = pulled_chunk
    assert channel.post(header(request_id="nobody"), "nobody", 5)  # no such ticket: refused
    assert channel.post(header(), "req-1", 5)  # accepted
    failures = channel.collect(wait=True, timeout_s=5)
    assert [(tag, type(error).__name__) for tag, error in failures] == [("nobody", "TransferRefused")]
    assert "no ticket" in str(failures[0][1])
    assert torch.equal(dst.caches[0][0][:, [1, 2, 3, 4]], src.caches[0][0][:, [7, 8, 9, 10]])
    assert not channel.posted


@pytest.mark.parametrize(
    "layers_and_offsets",
    [[(1, 2), (2, 3)], [(2, 2), (0, 3)]],  # (layer, offset in layers): one group running past; a valid then a bad one
    ids=["one group", "second group"],
)
def test_a_batch_running_past_the_region_is_refused_and_writes_nothing(pulled_chunk, layers_and_offsets):
    receiver, channel, header, src, dst = pulled_chunk
    body = msgpack.unpackb(msgpack.unpackb(header())["body"])
    layer_bytes = src.caches[0][0].numel() * 4  # the region holds layers 0-2 back to back
    batch = [
        [layer, body["src_region"], body["src_offset"] + at * layer_bytes, None] for layer, at in layers_and_offsets
    ]
    with pytest.raises(TransferRefused, match="outside the shared region"):
        channel.send(header(layer=batch[0][0], src_offset=batch[0][2], batch=batch), b"", 5)
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])
    assert receiver.poll("req-1").layers_complete == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batch_of_scattered_blocks_lands_bit_exact(transport, dtype):
    # 16 scattered blocks: too many runs to coalesce, so the stacked copy takes the index kernels.
    shape = dict(num_blocks=40, dtype=dtype)
    src, full = make_side(1, fill=True, shared=True, **shape)
    dst, _ = make_side(1, fill=False, **shape)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], "shm")
    src_ids = [31, 2, 19, 5, 38, 11, 0, 27, 8, 14, 33, 21, 6, 25, 17, 36]
    dst_ids = [4, 29, 12, 0, 35, 18, 9, 23, 1, 39, 15, 7, 30, 20, 26, 10]
    ticket = make_ticket("req-1", "shm", [transport.serve(receiver)], dst.layouts[0], "m", dst_ids, 64, 30)
    receiver.expect(ticket)
    channel = transport.connect(ticket.receiver_endpoints[0])
    sources = [channel.pull_source(src.caches[0][layer]) for layer in range(3)]
    header = layer_chunk_header(
        layer=0,
        num_heads=2,
        num_blocks=16,
        nbytes=2 * 16 * 4 * 2 * 8 * src.caches[0][0].element_size(),
        src_region=sources[0][0],
        src_offset=sources[0][1],
        src_num_blocks=40,
        src_heads=2,
        src_block_ids=src_ids,
        batch=[[layer, *sources[layer], None] for layer in range(3)],
    )
    channel.send(encode_header(header, ticket.secret), b"", 5)
    assert_bit_exact(full, dst, src_ids, dst_ids, 16)
    untouched = [b for b in range(40) if b not in dst_ids]
    assert all(torch.count_nonzero(layer[:, untouched]) == 0 for layer in dst.caches[0])
    channel.close()


def test_a_batch_lets_go_of_the_lock_between_groups_and_stops_if_its_request_ended(pulled_chunk, monkeypatch):
    import kv_transfer.receiver as receiver_module

    class CountingLock:
        def __init__(self) -> None:
            self.lock, self.acquired = threading.Lock(), 0

        def acquire(self) -> bool:
            self.acquired += 1
            return self.lock.acquire()

        def release(self) -> None:
            self.lock.release()

        def __enter__(self):
            return self.acquire()

        def __exit__(self, *exc) -> None:
            self.release()

    receiver, channel, header, src, dst = pulled_chunk
    monkeypatch.setattr(receiver_module, "_MAX_LOCKED_COPY_BYTES", 1)  # one layer per lock hold
    receiver._lock = lock = CountingLock()
    holds, landed = [], receiver._landed

    def landed_then_check(incoming, layer_headers, keys, nbytes, **how):
        landed(incoming, layer_headers, keys, nbytes, **how)
        holds.append(([h.layer for h in layer_headers], lock.lock.locked(), lock.acquired))
        if layer_headers[-1].layer == 1:  # meanwhile, elsewhere, the request fails (say, its lease ran out)
            receiver._fail(incoming, "ended elsewhere")

    monkeypatch.setattr(receiver, "_landed", landed_then_check)
    body = msgpack.unpackb(msgpack.unpackb(header())["body"])
    layer_bytes = src.caches[0][0].numel() * 4
    batch = [[layer, body["src_region"], body["src_offset"] + layer * layer_bytes, None] for layer in range(3)]
    with pytest.raises(TransferRefused, match="ended during its batch"):
        channel.send(header(batch=batch), b"", 5)
    # Layers 0 and 1 landed, each under its own hold of the lock; layer 2 was never written.
    assert holds == [([0], True, 1), ([1], True, 2)] and lock.acquired == 3
    assert torch.equal(dst.caches[0][1][:, [1, 2, 3, 4]], src.caches[0][1][:, [7, 8, 9, 10]])
    assert torch.count_nonzero(dst.caches[0][2]) == 0
