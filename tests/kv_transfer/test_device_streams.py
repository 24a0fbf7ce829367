"""The ordering of KV transfers against compute on a GPU, checked where it can run without one.

On CUDA the sender records an event after each layer's KV write and its sending thread waits for
that event on a transfer stream of its own before reading the layer; a receiver lands chunks on
its own transfer stream and settles it before a chunk counts as landed. Streams and events need a
GPU (``bench.gpu_check`` runs the transfers there): here the stream functions are replaced by
recorders (a stand-in, the one mock in these tests) around real senders, receivers and transports,
and the order of what they recorded is checked."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import threading
import time

import pytest
import torch

from kv_transfer import KVReceiver, TransferState, device_streams
from kv_transfer.backends.inproc import InProcTransport
from kv_transfer.backends.tcp import TcpTransport
from kv_transfer.device_streams import HostStaging
from kv_transfer.sending import worker
from tests.kv_transfer.harness import assert_bit_exact, transfer, wait_terminal

# The modules (the package re-exports classes under some of their names).
sender = importlib.import_module("kv_transfer.sender")
receiver = importlib.import_module("kv_transfer.receiver")


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.lock = threading.Lock()
        self.inside: dict[int, int] = {}  # thread -> depth of on_transfer_stream

    def log(self, *event) -> None:
        with self.lock:
            self.events.append((*event, self.inside.get(threading.get_ident(), 0) > 0))

    @contextlib.contextmanager
    def stream(self, device):
        tid = threading.get_ident()
        self.inside[tid] = self.inside.get(tid, 0) + 1
        try:
            yield
        finally:
            self.inside[tid] -= 1


def test_each_layer_is_read_on_the_transfer_stream_only_after_its_ready_event(monkeypatch):
    rec = Recorder()
    made = iter(range(10**6))

    def ready(kv_layer):  # what layer_ready returns on CUDA: an event per layer, recorded in order
        event = f"event-{next(made)}"
        rec.log("recorded", event)
        return event

    monkeypatch.setattr(sender, "layer_ready", ready)
    monkeypatch.setattr(worker, "on_transfer_stream", rec.stream)
    monkeypatch.setattr(worker, "wait_for", lambda event, device: rec.log("waited", event))
    real_send = worker.Pusher.send_layers

    def send_layers(self, push, layers):
        rec.log("sent", [layer.ready for layer in layers])
        return real_send(self, push, layers)

    monkeypatch.setattr(worker.Pusher, "send_layers", send_layers)
    transport = InProcTransport()
    receivers, senders, *_ = transfer(transport, 1, 1, num_layers=4)
    assert wait_terminal([lambda: receivers[0].poll("req-1")])[0].state is TransferState.DONE
    waited = [e for e in rec.events if e[0] == "waited"]
    sent = [e for e in rec.events if e[0] == "sent"]
    assert [e[1] for e in waited] == [f"event-{i}" for i in range(4)]  # every layer's event, in order
    assert all(inside for *_, inside in waited + sent)  # both on the transfer stream
    for layers_sent in (e[1] for e in sent):  # a layer leaves only after its event was waited for
        for event in layers_sent:
            assert rec.events.index(next(e for e in waited if e[1] == event)) < rec.events.index(
                next(e for e in sent if event in e[1])
            )
    for s in senders:
        s.close()
    transport.shutdown()


def test_a_chunk_counts_as_landed_only_after_the_receivers_stream_settled(monkeypatch):
    """poll() takes the receiver's lock. A copied chunk (apply) lands on the transfer stream and is
    settled before the lock is let go; a chunk received in place (tcp: begin/end_direct) is settled
    before it is marked landed at all."""
    rec = Recorder()
    monkeypatch.setattr(receiver, "on_transfer_stream", rec.stream)
    real_landed = receiver.Completion.landed

    def landed(self, incoming, headers, keys, nbytes, in_place):
        rec.log("landed", in_place)
        return real_landed(self, incoming, headers, keys, nbytes, in_place)

    made: list[KVReceiver] = []
    real_init = KVReceiver.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    def settle(device):
        rec.log("settled", all(rx._lock.locked() for rx in made))

    monkeypatch.setattr(receiver.Completion, "landed", landed)
    monkeypatch.setattr(KVReceiver, "__init__", init)
    monkeypatch.setattr(receiver, "settle", settle)
    for transport, in_place in ((InProcTransport(), False), (TcpTransport(), True)):
        rec.events.clear()
        made.clear()
        receivers, senders, *_ = transfer(transport, 1, 1, num_layers=3)
        assert wait_terminal([functools.partial(receivers[0].poll, "req-1")])[0].state is TransferState.DONE
        events = [(kind, value) for kind, value, _ in rec.events]
        landings = [i for i, (kind, _) in enumerate(events) if kind == "landed"]
        assert landings and all(events[i][1] is in_place for i in landings), events
        for n, i in enumerate(landings):
            if in_place:  # settled since the previous landing, before this one
                assert ("settled", False) in events[(landings[n - 1] + 1 if n else 0) : i], events
            else:  # settled after it, with the lock still held
                assert events[i + 1] == ("settled", True), events
        for s in senders:
            s.close()
        transport.shutdown()


def test_a_transport_serves_a_gpu_cache_inside_the_receivers_landing_stream(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def landing_stream(self):
        entered.append(threading.current_thread().name)
        yield

    monkeypatch.setattr(KVReceiver, "landing_stream", landing_stream)
    transport = TcpTransport()
    receivers, senders, *_ = transfer(transport, 1, 1, num_layers=2)
    assert wait_terminal([lambda: receivers[0].poll("req-1")])[0].state is TransferState.DONE
    assert any(name.startswith("kv-tcp-conn") for name in entered), entered
    for s in senders:
        s.close()
    transport.shutdown()


def test_on_cpu_the_stream_functions_do_nothing_and_staging_passes_tensors_through():
    layer = torch.ones(2, 3)
    assert device_streams.layer_ready(layer) is None
    with device_streams.on_transfer_stream(torch.device("cpu")):
        device_streams.wait_for(None, torch.device("cpu"))
        device_streams.settle(torch.device("cpu"))
    staging = HostStaging()
    assert staging.to_host(layer) is layer
    assert staging.to_device(layer, torch.device("cpu")) is layer
    small, large = staging.buffer("k", 10), staging.buffer("k", 100)
    assert small.numel() == 10 and large.numel() == 100 and staging.buffer("k", 50).data_ptr() == large.data_ptr()


@pytest.mark.parametrize("integrity", ["none", "crc32", "mac"])
@pytest.mark.parametrize("batched", [False, True])
def test_a_payload_received_on_the_caches_device_lands_from_there_bit_exact(monkeypatch, integrity, batched):
    """What an NCCL receive hands ``apply``: the payload as a flat uint8 tensor on the cache's device
    (the CPU here), landed without a trip through host bytes; checked like bytes where it carries a
    check. Every chunk of a real transfer is handed over that way."""
    real_apply = KVReceiver.apply
    as_tensors = []

    def apply(self, raw_header, payload, regions=None):
        if not isinstance(payload, torch.Tensor) and len(payload):
            payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            as_tensors.append(payload.numel())
        return real_apply(self, raw_header, payload, regions)

    monkeypatch.setattr(KVReceiver, "apply", apply)
    if batched:  # the sender fell behind: several layers leave in one chunk
        monkeypatch.setattr(worker.SendWorker, "_layers_behind", _all_queued_layers(worker.SendWorker._layers_behind))
    transport = InProcTransport()
    receivers, senders, ticket, full, dst, src_blocks = transfer(transport, 1, 1, num_layers=4, integrity=integrity)
    (state,) = wait_terminal([functools.partial(receivers[0].poll, "req-1")])
    assert state.state is TransferState.DONE, state
    assert as_tensors, "no chunk went through the tensor path"
    assert_bit_exact(full, dst, src_blocks, ticket.block_ids, ticket.num_blocks)
    for s in senders:
        s.close()
    transport.shutdown()


def test_a_tensor_payload_that_fails_its_check_is_refused_and_writes_nothing():
    from kv_transfer import make_ticket
    from kv_transfer.protocol import ChunkHeader, encode_header, payload_check
    from kv_transfer.transport import TransferRefused
    from tests.kv_transfer.harness import make_side

    dst, _ = make_side(1, fill=False)
    rx = KVReceiver(dst.caches[0], dst.layouts[0], "inproc", require_integrity="crc32")
    ticket = make_ticket(
        "req-1", "inproc", ["inproc://x"], dst.layouts[0], "m", [1, 2], 2 * dst.layouts[0].block_size, 30
    )
    rx.expect(ticket)
    layout = dst.layouts[0]
    payload = torch.ones(2, 2, layout.block_size, layout.num_kv_heads, layout.head_dim).view(-1).view(torch.uint8)
    good = payload_check("crc32", ticket.secret, memoryview(payload.numpy()))
    header = ChunkHeader(
        kind="layer", request_id="req-1", sender_rank=0, sender_tp=1, receiver_rank=0, layer=0,
        num_heads=layout.num_kv_heads, num_blocks=2, nbytes=payload.numel(), checksum=good ^ 1,
    )  # fmt: skip
    with pytest.raises(TransferRefused, match="checksum"):
        rx.apply(encode_header(header, ticket.secret), payload.clone())
    assert all(torch.count_nonzero(layer) == 0 for layer in dst.caches[0])
    # The same chunk with its true checksum, to another request: checked over the tensor's bytes, it lands.
    ticket = make_ticket("req-2", "inproc", ["inproc://x"], layout, "m", [3, 4], 2 * layout.block_size, 30)
    rx.expect(ticket)
    good = payload_check("crc32", ticket.secret, memoryview(payload.numpy()))
    header = dataclasses.replace(header, request_id="req-2", checksum=good)
    rx.apply(encode_header(header, ticket.secret), payload.clone())
    assert torch.count_nonzero(dst.caches[0][0]) > 0


def _all_queued_layers(real):
    """``_layers_behind`` as if the sender fell behind: it waits until every layer is queued."""

    def layers_behind(self, first, held):
        deadline = time.monotonic() + 5
        while self._queue.qsize() < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        return real(self, first, held)

    return layers_behind
