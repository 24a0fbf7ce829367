"""The ordering of KV transfers against compute on a GPU, checked where it can run without one.

On CUDA the sender records an event after each layer's KV write and its sending thread waits for
that event on a transfer stream of its own before reading the layer; a receiver lands chunks on
its own transfer stream and settles it before a chunk counts as landed. Streams and events need a
GPU (``bench.gpu_check`` runs the transfers there): here the stream functions are replaced by
recorders (a stand-in, the one mock in these tests) around real senders, receivers and transports,
and the order of what they recorded is checked."""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading

import torch

from kv_transfer import KVReceiver, TransferState, device_streams
from kv_transfer.backends.inproc import InProcTransport
from kv_transfer.backends.tcp import TcpTransport
from kv_transfer.device_streams import HostStaging
from kv_transfer.sending import worker
from tests.kv_transfer.harness import transfer, wait_terminal

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
    monkeypatch.setattr(worker, "wait_for", lambda event: rec.log("waited", event))
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
    """poll() takes the receiver's lock: apply() must settle its stream before letting go of it."""
    rec = Recorder()
    monkeypatch.setattr(receiver, "on_transfer_stream", rec.stream)
    real_landed = receiver.Completion.landed

    def landed(self, incoming, headers, keys, nbytes, in_place):
        rec.log("landed", tuple(h.layer for h in headers))
        return real_landed(self, incoming, headers, keys, nbytes, in_place)

    monkeypatch.setattr(receiver.Completion, "landed", landed)

    def settle(device):
        rec.log("settled", None)

    monkeypatch.setattr(receiver, "settle", settle)
    for transport in (InProcTransport(), TcpTransport()):
        rec.events.clear()
        receivers, senders, *_ = transfer(transport, 1, 1, num_layers=3)
        assert wait_terminal([functools.partial(receivers[0].poll, "req-1")])[0].state is TransferState.DONE
        kinds = [e[0] for e in rec.events]
        assert "landed" in kinds and kinds[-1] == "settled", kinds
        for i, kind in enumerate(kinds):  # each landing is followed by a settle before the next chunk
            if kind == "landed":
                assert "settled" in kinds[i + 1 :], kinds
        assert all(inside for kind, _, inside in rec.events if kind == "landed")  # on the transfer stream
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
        device_streams.wait_for(None)
        device_streams.settle(torch.device("cpu"))
    staging = HostStaging()
    assert staging.to_host(layer) is layer
    assert staging.to_device(layer, torch.device("cpu")) is layer
    small, large = staging.buffer("k", 10), staging.buffer("k", 100)
    assert small.numel() == 10 and large.numel() == 100 and staging.buffer("k", 50).data_ptr() == large.data_ptr()
