"""The local cluster's claim on its HTTP port: one cluster per port on a host, TIME_WAIT no obstacle."""

from __future__ import annotations

import os
import socket
import time

import pytest

from cluster.app import lock_port, wait_port_free
from common.errors import ConfigError


def test_wait_port_free_refuses_a_listener_not_connections_in_time_wait():
    with socket.socket() as listener:
        # As the router's (router.http_listener): Linux lets a bind past TIME_WAIT only when the
        # closed connection's socket had SO_REUSEADDR too.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve on 127.0.0.1:{port}"):
            wait_port_free("127.0.0.1", port, timeout_s=0.5)
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the listening side closes first: its end goes to TIME_WAIT
        client.close()
    started = time.monotonic()
    wait_port_free("127.0.0.1", port, timeout_s=5)
    assert time.monotonic() - started < 1


def test_one_local_cluster_per_port_on_a_host(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CORE_LOCK_DIR", str(tmp_path / "pdserve-cores"))
    first = lock_port(18_555)
    try:
        with pytest.raises(ConfigError, match=rf"another pdserve on this host \(pid {os.getpid()}\)"):
            lock_port(18_555)
        os.close(lock_port(18_556))  # another port is free
    finally:
        os.close(first)
    os.close(lock_port(18_555))  # released with its descriptor
