"""The tensor-parallel rendezvous store listens on loopback only (torch's TCPStore, left to itself,
binds every interface whatever host it is given)."""

from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads listening sockets from /proc")


def listening_addresses() -> set[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on, IPv4 and IPv6."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                # The kernel prints each 32-bit word of the address in host (little-endian) order.
                packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((str(ipaddress.ip_address(packed)), int(port, 16)))
    return found


def test_a_tensor_parallel_instance_listens_on_loopback_only(tiny_dir):
    from engine.llm import LLM

    before = listening_addresses()
    llm = LLM(str(tiny_dir), tensor_parallel_size=2, kv_cache_memory=8 * 2**20)
    try:
        opened = listening_addresses() - before
        assert opened, "the rank-0 store should listen while the instance lives"
        assert {address for address, _ in opened} == {"127.0.0.1"}, opened
    finally:
        llm.shutdown()
