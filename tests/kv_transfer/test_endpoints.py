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
