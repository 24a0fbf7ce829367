"""Where KV endpoints listen and what tickets name: an advertised host for the backends dialed by
host and port, and shm endpoints that say which host they are on, so a prefill replica on another
host fails its hand-off with a reason instead of a missing socket file."""

from __future__ import annotations

import socket

import pytest

from cluster.cluster_config import load_cluster_config
from common.errors import ConfigError
from kv_transfer.backends.shm import HOST_ID, SharedMemoryTransport
from kv_transfer.connector import TransferConnector
from kv_transfer.receiver import KVReceiver
from kv_transfer.transport import advertised
from tests.kv_transfer.harness import make_side


@pytest.mark.parametrize(
    ("endpoint", "host", "expected"),
    [
        ("tcp://127.0.0.1:5000", "10.0.0.7", "tcp://10.0.0.7:5000"),
        ("grpc://0.0.0.0:6000", "decode-0.example", "grpc://decode-0.example:6000"),
        ("torch://[::1]:7000", "fd00::7", "torch://[fd00::7]:7000"),
        ("tcp://[::1]:7000", "[fd00::7]", "tcp://[fd00::7]:7000"),
        ("tcp://127.0.0.1:5000", None, "tcp://127.0.0.1:5000"),
        ("shm:///tmp/pdserve-kv-x/recv.sock?host=abc", "10.0.0.7", "shm:///tmp/pdserve-kv-x/recv.sock?host=abc"),
        ("inproc://3", "10.0.0.7", "inproc://3"),
    ],
)
def test_an_advertised_host_replaces_the_bound_one_where_peers_dial_host_and_port(endpoint, host, expected):
    assert advertised(endpoint, host) == expected


def test_a_receiver_bound_on_loopback_is_named_by_its_advertised_host_and_reachable_there():
    side, _ = make_side(1, fill=False)
    connector = TransferConnector(
        layout=side.layouts[0],
        kv_caches=side.caches[0],
        model_id="m",
        backend="tcp",
        receive=True,
        host="127.0.0.1",
        advertise_host="localhost",
    )
    try:
        assert connector.endpoint is not None and connector.endpoint.startswith("tcp://localhost:")
        port = int(connector.endpoint.rpartition(":")[2])
        socket.create_connection(("localhost", port), timeout=5).close()
    finally:
        connector.close()


@pytest.mark.parametrize("backend", ["tcp", "grpc", "auto"])
def test_a_receiver_on_every_interface_starts_and_is_named_by_its_advertised_host(backend):
    """The multi-host set-up docs/security.md gives (kv_host 0.0.0.0 and an advertised address): each
    backend dialed by host binds every interface, and the ticket's endpoint is the advertised one.
    (tcp and auto refused the wildcard once, so every decode replica failed at start.)"""
    side, _ = make_side(1, fill=False)
    options = {"layout": side.layouts[0], "kv_caches": side.caches[0], "model_id": "m", "backend": backend}
    connector = TransferConnector(**options, receive=True, host="0.0.0.0", advertise_host="127.0.0.1")
    try:
        endpoint = connector.endpoint
        assert endpoint is not None and "0.0.0.0" not in endpoint and "://127.0.0.1:" in endpoint, endpoint
        socket.create_connection(("127.0.0.1", int(endpoint.rpartition(":")[2])), timeout=5).close()
    finally:
        connector.close()
    with pytest.raises(ValueError, match="advertise_host"):
        TransferConnector(**options, receive=True, host="0.0.0.0")


def test_an_shm_endpoint_of_another_host_is_refused_with_the_reason():
    transport = SharedMemoryTransport()
    side, _ = make_side(1, fill=False)
    endpoint = transport.serve(KVReceiver(side.caches[0], side.layouts[0], "shm"))
    try:
        assert endpoint.endswith(f"?host={HOST_ID}")
        transport.connect(endpoint).close()  # this host's: a channel as ever
        elsewhere = endpoint.replace(HOST_ID, "another-boot-id")
        with pytest.raises(ConnectionError, match=r"on another host .*use transport tcp, grpc or torch"):
            transport.connect(elsewhere)
    finally:
        transport.shutdown()


def test_the_cluster_config_carries_the_kv_hosts_to_the_decode_connector():
    config = load_cluster_config(None, {"transport": "tcp", "kv_host": "0.0.0.0", "kv_advertise_host": "10.0.0.7"})
    options = config.engine_config("decode").kv_connector.options
    assert options["host"] == "0.0.0.0" and options["advertise_host"] == "10.0.0.7"
    assert load_cluster_config().engine_config("decode").kv_connector.options["host"] == "127.0.0.1"
    with pytest.raises(ConfigError, match="kv_advertise_host"):
        load_cluster_config(None, {"kv_host": "0.0.0.0"})
    # torch's pairs use the bound address itself: no wildcard, nothing else advertised.
    for hosts in ({"kv_host": "0.0.0.0", "kv_advertise_host": "10.0.0.7"}, {"kv_advertise_host": "10.0.0.7"}):
        with pytest.raises(ConfigError, match="transport=torch binds the address senders dial"):
            load_cluster_config(None, {"transport": "torch", **hosts})
    assert load_cluster_config(None, {"transport": "torch", "kv_host": "10.0.0.7"}).kv_host == "10.0.0.7"


@pytest.mark.parametrize(("shared", "sender_host"), [(True, None), (False, None), (False, "another-boot-id")])
def test_auto_sends_over_shm_to_a_receiver_on_this_host_and_over_tcp_to_one_elsewhere(shared, sender_host):
    from kv_transfer import TransferState, make_ticket
    from kv_transfer.backends.auto import AutoTransport, split_endpoint
    from kv_transfer.sender import KVSender
    from tests.kv_transfer.harness import assert_bit_exact, wait_terminal

    served, sending = AutoTransport(), AutoTransport(host_id=sender_host)
    src, full = make_side(1, fill=True, shared=shared)
    dst, _ = make_side(1, fill=False)
    receiver = KVReceiver(dst.caches[0], dst.layouts[0], "auto")
    sender = KVSender(src.layouts[0], "m", sending)
    try:
        endpoint = served.serve(receiver)
        local, network = split_endpoint(endpoint)
        assert local == f"{local.partition('?')[0]}?host={HOST_ID}" and network.startswith("tcp://127.0.0.1:")
        assert sending.is_local(endpoint) is (sender_host is None)
        ticket = make_ticket("req-1", "auto", [endpoint], dst.layouts[0], "m", [1, 2, 3, 4], 13, 30.0)
        receiver.expect(ticket)
        sender.start(ticket, [7, 8, 9, 10])
        for layer in range(dst.layouts[0].num_layers):
            sender.send_layer("req-1", layer, src.caches[0][layer])
        sender.finish("req-1", 5)
        rx, tx = wait_terminal([lambda: receiver.poll("req-1"), lambda: sender.poll("req-1")])
        assert rx.state is TransferState.DONE and tx.state is TransferState.DONE, (rx, tx)
        assert_bit_exact(full, dst, [7, 8, 9, 10], ticket.block_ids, ticket.num_blocks)
        # Which way the chunks went: over the network only for a sender on another host.
        assert served.network.num_connections() == (0 if sender_host is None else 1)
    finally:
        sender.close()
        sending.shutdown()
        served.shutdown()


def test_an_auto_endpoint_is_advertised_by_its_tcp_half_and_a_malformed_one_refused(caplog):
    from kv_transfer.backends.auto import AutoTransport

    # This host's id but a socket out of sight (a container beside this one): over the network,
    # where a loopback address reaches the receiver only if both "hosts" are one machine: said once.
    unseen = f"auto://shm:///nonexistent/pdserve-kv-x/recv.sock?host={HOST_ID}|tcp://127.0.0.1:5000"
    transport = AutoTransport()
    assert not transport.is_local(unseen)
    for _ in range(2):
        transport.connect(unseen).close()
    assert [r.message.count("set kv_host to node") for r in caplog.records] == [1]
    transport.shutdown()

    endpoint = "auto://shm:///tmp/pdserve-kv-x/recv.sock?host=abc|tcp://0.0.0.0:5000"
    assert advertised(endpoint, "10.0.0.7") == "auto://shm:///tmp/pdserve-kv-x/recv.sock?host=abc|tcp://10.0.0.7:5000"
    assert advertised(endpoint, None) == endpoint
    for bad in ("tcp://127.0.0.1:5000", "auto://tcp://127.0.0.1:5000", "auto://shm:///x?host=abc"):
        with pytest.raises(ValueError, match="not an auto endpoint"):
            AutoTransport().connect(bad)
