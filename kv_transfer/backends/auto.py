"""Shared memory to a receiver on this host, TCP to one elsewhere: the transport of a cluster whose
pools may span nodes.

A receiver is served on both backends at once, and its endpoint names both:

    auto://<shm endpoint, with its host id>|<tcp endpoint>

Each sender compares the shm endpoint's host id with its own (``shm.HOST_ID``: the kernel's boot
id, or PDSERVE_HOST_ID) and connects over shm when they match and the receiver's socket is in
sight (two containers of one kernel share the boot id but not their files), over TCP otherwise. So a
decode replica's ticket serves every prefill replica, on its node or not, and ``shm`` is chosen
only where it can work. Both backends land chunks in the same ``KVReceiver``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from kv_transfer.transport import KVChannel, KVTransport, get_transport

if TYPE_CHECKING:
    from kv_transfer.receiver import KVReceiver

SCHEME = "auto://"
logger = logging.getLogger(__name__)
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_SEPARATOR = "|"  # in neither a shm endpoint (a temp dir's socket path) nor a tcp host:port


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """(shm endpoint, tcp endpoint) of an auto endpoint."""
    local, separator, network = endpoint.removeprefix(SCHEME).partition(_SEPARATOR)
    if not endpoint.startswith(SCHEME) or not separator or not local.startswith("shm://"):
        raise ValueError(f"not an auto endpoint (auto://<shm endpoint>|<tcp endpoint>): {endpoint}")
    return local, network


def join_endpoint(local: str, network: str) -> str:
    return f"{SCHEME}{local}{_SEPARATOR}{network}"


class AutoTransport(KVTransport):
    name = "auto"

    def __init__(self, host_id: str | None = None) -> None:
        """``host_id``: this side's host, as shm endpoints name theirs (default: shm's HOST_ID)."""
        self._host_id = host_id
        self._local: KVTransport | None = None
        self._network: KVTransport | None = None
        self._warned_loopback = False

    @property
    def local(self) -> KVTransport:
        if self._local is None:
            self._local = get_transport("shm")
        return self._local

    @property
    def network(self) -> KVTransport:
        if self._network is None:
            self._network = get_transport("tcp")
        return self._network

    @property
    def host_id(self) -> str:
        if self._host_id is None:
            from kv_transfer.backends.shm import HOST_ID

            self._host_id = HOST_ID
        return self._host_id

    def serve(self, receiver: KVReceiver, host: str = "127.0.0.1") -> str:
        """Serves ``receiver`` over shm and over TCP bound on ``host``."""
        return join_endpoint(self.local.serve(receiver, host), self.network.serve(receiver, host))

    def connect(self, endpoint: str) -> KVChannel:
        local, network = split_endpoint(endpoint)
        if self.is_local(endpoint):
            return self.local.connect(local)
        host = network.removeprefix("tcp://").rpartition(":")[0].strip("[]")
        if host in _LOOPBACK and not self._warned_loopback:
            # It dials this host's own loopback: right only for "hosts" that are one machine
            # (PDSERVE_HOST_ID in a test); elsewhere the cause of the refusal that follows.
            self._warned_loopback = True
            logger.warning(
                "the KV receiver %s is on another host but names a loopback address: if that host is "
                "another machine, set kv_host to node (each decode replica's node address)",
                endpoint,
            )
        return self.network.connect(network)

    def is_local(self, endpoint: str) -> bool:
        """Whether a sender here reaches ``endpoint``'s receiver over shared memory: the same host,
        and its socket in sight (two containers of one kernel share the boot id, not their files)."""
        local, _ = split_endpoint(endpoint)
        path, _, host = local.removeprefix("shm://").partition("?host=")
        return host == self.host_id and os.path.exists(path)

    def shutdown(self) -> None:
        for transport in (self._local, self._network):
            if transport is not None:
                transport.shutdown()
