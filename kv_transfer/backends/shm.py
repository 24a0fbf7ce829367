"""Same-host transport: KV crosses through shared memory, control messages through a Unix socket.

Memory is shared as anonymous memfd regions (common.shared_memory), passed once per connection
as a file descriptor (SCM_RIGHTS) and mapped read-only by the receiver: nothing is left in
/dev/shm if either process dies, and the receiver can read the sender's memory but never write it.

Two paths, chosen per chunk by the sender:

    pull (one copy):   the sender's KV cache lives in a shared region (the engine allocates it
                       there when its pool sends over shm). The signed header names the blocks;
                       the receiver verifies it, then copies those blocks straight from the
                       sender's cache into its reserved blocks.
        sender ── socket: {signed header: region, offset, block ids} ──▶ receiver ── copy ──▶ KV
    staged (two copies): any other tensor. The sender gathers the blocks into its staging region;
                       the receiver verifies the header, then copies from staging into its blocks.
        sender ── copy ──▶ staging region ── copy ──▶ receiver KV blocks
           └── socket: {signed header, staging region, nbytes} ──▶

Either way the sender waits for the receiver's verdict {ok, reason} before the next chunk, so the
source stays untouched while it is read, and an unauthenticated chunk writes nothing.
"""

from __future__ import annotations

import array
import contextlib
import logging
import mmap
import os
import select
import socket
import struct
import tempfile
import threading
import time
from collections import deque

import msgpack
import torch

from common import env
from common.openmp import run_tensor_ops_serially
from common.shared_memory import (
    SharedRegion,
    close_shared_region,
    create_shared_region,
    find_shared_region,
    map_shared_region,
)
from kv_transfer.receiver import KVReceiver
from kv_transfer.transport import KVChannel, KVTransport, TransferRefused

logger = logging.getLogger(__name__)


def _host_id() -> str:
    """This host's identity for shm endpoints: PDSERVE_HOST_ID if set, else the kernel's boot id
    (two containers of one kernel share it, and /dev/shm may not be shared between them: the
    connect then fails plainly), else the host name."""
    configured = env.host_id()
    if configured:
        return configured
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


HOST_ID = _host_id()
_LEN = struct.Struct("!I")
_MAX_MESSAGE = 1 << 20  # control messages are small; anything bigger is refused
_MAX_REGIONS = 64  # regions one connection may map (a cache per shard, a staging buffer)
_MAX_MAPPED_BYTES = 1 << 40  # address space one connection may map
_FDS_SPACE = socket.CMSG_SPACE(array.array("i", [0]).itemsize)
_MAX_POSTED = 64  # pulled chunks in flight per connection before the sender waits for a verdict


def _send_msg(sock: socket.socket, obj: dict, fd: int | None = None) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    frame = _LEN.pack(len(data)) + data
    if fd is None:
        sock.sendall(frame)
        return
    sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    if sent < len(frame):
        sock.sendall(frame[sent:])


class _Reader:
    """Reads length-prefixed msgpack messages, collecting any descriptors passed along with them."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fds: list[int] = []

    def _recv_exact(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            data, ancillary, _flags, _addr = self.sock.recvmsg(n - got, _FDS_SPACE, socket.MSG_CMSG_CLOEXEC)
            for level, kind, raw in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
                    self.fds.extend(fds)
            if not data:
                raise ConnectionError("peer closed the connection")
            chunks.append(data)
            got += len(data)
        return b"".join(chunks)

    def message(self) -> dict:
        (size,) = _LEN.unpack(self._recv_exact(_LEN.size))
        if size > _MAX_MESSAGE:
            raise ConnectionError(f"control message of {size} bytes refused")
        return msgpack.unpackb(self._recv_exact(size), raw=False)

    def take_fd(self) -> int | None:
        fd = self.fds.pop(0) if self.fds else None
        self.close_fds()  # at most one descriptor per message; never keep strays
        return fd

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


class _Connection(threading.Thread):
    """Receiver side of one sender's channel: the sender's regions, mapped read-only."""

    def __init__(self, sock: socket.socket, receiver: KVReceiver, idle_timeout_s: float) -> None:
        super().__init__(name="kv-shm-conn", daemon=True)
        self.sock = sock
        self.receiver = receiver
        self.idle_timeout_s = idle_timeout_s
        self.maps: dict[int, mmap.mmap] = {}
        self.tensors: dict[int, torch.Tensor] = {}

    def run(self) -> None:
        run_tensor_ops_serially()  # lands KV: the engine thread owns the process's OpenMP team
        self.sock.settimeout(self.idle_timeout_s)
        reader = _Reader(self.sock)
        try:
            while True:
                msg = reader.message()
                verdict = {"ok": True, "reason": ""}
                try:
                    if msg.get("op") == "region":
                        self._map(msg, reader.take_fd())
                    else:
                        reader.close_fds()
                        self.receiver.apply(msg["header"], self._payload(msg), self.tensors)
                except TransferRefused as exc:
                    verdict = {"ok": False, "reason": str(exc)}
                except Exception as exc:  # a malformed message fails this chunk, not the thread
                    verdict = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}
                _send_msg(self.sock, verdict)
        except (ConnectionError, OSError, ValueError):
            pass  # peer gone or idle: drop the connection
        finally:
            reader.close_fds()
            self.sock.close()
            # Dropped, never closed: torch.frombuffer holds no buffer export, so close() would unmap
            # memory a tensor may still view. The mapping goes with its last reference.
            self.tensors.clear()
            self.maps.clear()

    def _map(self, msg: dict, fd: int | None) -> None:
        if fd is None:
            raise ValueError("a region message came without its descriptor")
        try:
            region_id, nbytes = int(msg["id"]), int(msg["nbytes"])
            self._forget(msg.get("replaces"))
            if len(self.maps) >= _MAX_REGIONS:
                raise ValueError(f"a connection maps at most {_MAX_REGIONS} regions")
            if sum(len(m) for m in self.maps.values()) + nbytes > _MAX_MAPPED_BYTES:
                raise ValueError(f"a connection maps at most {_MAX_MAPPED_BYTES} bytes")
            mapping = map_shared_region(fd, nbytes)
        finally:
            os.close(fd)  # the mapping keeps the memory; the descriptor is no longer needed
        self._forget(region_id)
        self.maps[region_id] = mapping
        self.tensors[region_id] = torch.frombuffer(mapping, dtype=torch.uint8)

    def _forget(self, region_id) -> None:
        if region_id is None:
            return
        self.tensors.pop(int(region_id), None)
        self.maps.pop(int(region_id), None)  # unmapped with its last reference (see run)

    def _payload(self, msg: dict) -> memoryview | bytes:
        nbytes = int(msg.get("nbytes", 0))
        if nbytes == 0:
            return b""
        mapping = self.maps.get(int(msg["region"]))
        if mapping is None:
            raise ValueError(f"staging region {msg['region']} was never shared")
        if nbytes > len(mapping):
            raise ValueError(f"{nbytes} bytes do not fit the {len(mapping)}-byte staging region")
        return memoryview(mapping)[:nbytes]


class _ShmChannel(KVChannel):
    def __init__(self, path: str, initial_bytes: int) -> None:
        self.path = path
        self.initial_bytes = initial_bytes
        self.sock: socket.socket | None = None
        self.reader: _Reader | None = None
        self.staging_region: SharedRegion | None = None
        self.shared: set[int] = set()  # regions the receiver has mapped on this connection
        self.replaced_staging: int | None = None  # the receiver may unmap it when the new one arrives
        self.posted: deque[tuple[str, float]] = deque()  # (tag, deadline) of posted chunks, in order
        self.late_failures: list[tuple[str, Exception]] = []

    # --- pull: the receiver reads the tensor in place ----------------------------------------
    def pull_source(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        return self.pull_sources([tensor])[0]

    def pull_sources(self, tensors: list[torch.Tensor]) -> list[tuple[int, int] | None]:
        found = [
            find_shared_region(t.data_ptr(), t.numel() * t.element_size())
            if t.device.type == "cpu" and t.is_contiguous()
            else None
            for t in tensors
        ]
        if any(f is not None for f in found):
            self._connect(timeout_s=30.0)  # once (a readiness check each): a fresh connection has shared nothing
        sources: list[tuple[int, int] | None] = []
        for f in found:
            if f is None:
                sources.append(None)
                continue
            region, offset = f
            if region.region_id not in self.shared:
                self._share(region, timeout_s=30.0)
            sources.append((region.region_id, offset))
        return sources

    def post(self, header, tag, timeout_s):
        """Pulled chunks stream without a round trip each: the receiver answers them in order."""
        if len(self.posted) >= _MAX_POSTED:
            self._read_posted_verdict()
        self._connect(timeout_s)
        try:
            assert self.sock is not None
            self.sock.settimeout(timeout_s)
            _send_msg(self.sock, {"op": "chunk", "header": bytes(header), "region": -1, "nbytes": 0})
        except TimeoutError as exc:
            self._broken(exc)
            raise
        except OSError as exc:
            self._broken(exc)
            raise ConnectionError(f"KV receiver at {self.path} went away: {exc}") from exc
        self.posted.append((tag, time.monotonic() + timeout_s))
        return True

    def collect(self, wait, timeout_s):
        while self.posted and (wait or self._readable()):
            try:
                self._read_posted_verdict()
            except (TimeoutError, ConnectionError):
                break  # every outstanding tag has been failed by _broken
        if self.posted and time.monotonic() > self.posted[0][1]:  # overdue: the receiver is stuck
            self._broken(TimeoutError("no verdict within the chunk's deadline"))
        failures, self.late_failures = self.late_failures, []
        return failures

    @property
    def num_posted(self) -> int:
        return len(self.posted)

    def _readable(self) -> bool:
        return self.sock is not None and bool(select.select([self.sock], [], [], 0)[0])

    def _read_posted_verdict(self) -> None:
        """The oldest posted chunk's verdict, waited for until that chunk's own deadline (not the
        deadline of whatever is being sent now: a request with little lease left must not fail
        the chunks of others)."""
        assert self.sock is not None and self.reader is not None
        self.sock.settimeout(max(0.05, self.posted[0][1] - time.monotonic()))
        try:
            verdict = self.reader.message()
        except TimeoutError as exc:
            self._broken(exc)
            raise
        except (OSError, ValueError) as exc:
            self._broken(exc)
            raise ConnectionError(f"KV receiver at {self.path} went away: {exc}") from exc
        tag, _ = self.posted.popleft()
        if not verdict["ok"]:
            self.late_failures.append((tag, TransferRefused(verdict["reason"])))

    def _broken(self, exc: Exception) -> None:
        """The connection died with verdicts outstanding: each of those chunks failed."""
        reason = exc if isinstance(exc, TimeoutError) else ConnectionError(f"KV receiver at {self.path}: {exc}")
        self.late_failures.extend((tag, reason) for tag, _ in self.posted)
        self.posted.clear()
        self.close_connection()

    # --- staged: a copy through this channel's own region --------------------------------------
    def staging(self, nbytes: int) -> torch.Tensor | None:
        if not nbytes:
            return None
        region = self.staging_region
        if region is None or region.nbytes < nbytes:
            replaced = region
            region = create_shared_region(max(self.initial_bytes, nbytes), "pdserve-kv-staging")
            self.staging_region = region
            if replaced is not None:
                self.replaced_staging = replaced.region_id if replaced.region_id in self.shared else None
                self._drop(replaced)
        return torch.frombuffer(region.buffer, dtype=torch.uint8, count=nbytes)

    def send(self, header, payload, timeout_s, tag=None):
        nbytes = len(payload)
        if nbytes:
            staging = self.staging(nbytes)
            assert staging is not None
            staging.copy_(torch.frombuffer(payload, dtype=torch.uint8, count=nbytes))
        self.send_staged(header, nbytes, timeout_s)

    def send_staged(self, header, nbytes, timeout_s, tag=None):
        self._connect(timeout_s)  # first: a fresh connection has shared nothing yet
        region = self.staging_region if nbytes else None
        if region is not None and region.region_id not in self.shared:
            self._share(region, timeout_s, replaces=self.replaced_staging)
            self.replaced_staging = None
        message = {"op": "chunk", "header": bytes(header), "region": region.region_id if region else -1}
        self._call({**message, "nbytes": nbytes}, timeout_s)

    # --- the connection -----------------------------------------------------------------------
    def _share(self, region: SharedRegion, timeout_s: float, replaces: int | None = None) -> None:
        message = {"op": "region", "id": region.region_id, "nbytes": region.nbytes, "replaces": replaces}
        # A read-only descriptor of the region: the receiver can neither map it writable nor resize it.
        read_only = os.open(f"/proc/self/fd/{region.fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._call(message, timeout_s, fd=read_only)
        finally:
            os.close(read_only)
        self.shared.add(region.region_id)

    def _drop(self, region: SharedRegion) -> None:
        self.shared.discard(region.region_id)
        close_shared_region(region)  # the mapping goes with its last reference, never under a live view

    def _connect(self, timeout_s: float) -> None:
        if self.sock is not None and not self.posted and self._readable():
            self.close_connection()  # nothing is owed to us, so this is EOF: the receiver closed an idle connection
        if self.sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise ConnectionError(f"no KV receiver at {self.path}: {exc}") from exc
            self.sock, self.reader = sock, _Reader(sock)
            self.shared.clear()  # a new connection has mapped nothing yet

    def _call(self, message: dict, timeout_s: float, fd: int | None = None) -> None:
        """One message and its verdict, after the verdicts of chunks posted before it."""
        while self.posted:
            self._read_posted_verdict()  # failures wait in late_failures for collect()
        self._connect(timeout_s)
        assert self.sock is not None and self.reader is not None
        self.sock.settimeout(timeout_s)
        try:
            _send_msg(self.sock, message, fd)
            verdict = self.reader.message()
        except TimeoutError:
            self.close_connection()
            raise
        except OSError as exc:
            self.close_connection()
            raise ConnectionError(f"KV receiver at {self.path} went away: {exc}") from exc
        if not verdict["ok"]:
            raise TransferRefused(verdict["reason"])

    def close_connection(self) -> None:
        self.posted.clear()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            self.reader = None
        self.shared.clear()

    def close(self) -> None:
        self.close_connection()
        if self.staging_region is not None:
            self._drop(self.staging_region)
            self.staging_region = None


class SharedMemoryTransport(KVTransport):
    name = "shm"

    def __init__(self, staging_bytes: int = 64 << 20, max_connections: int = 64, idle_timeout_s: float = 300.0):
        self.staging_bytes = staging_bytes
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self._servers: list[tuple[socket.socket, str, threading.Thread]] = []
        self._connections: list[_Connection] = []
        self._closed = threading.Event()

    def serve(self, receiver: KVReceiver, host: str = "127.0.0.1") -> str:
        # Same-host only: a Unix socket in a private temp dir; `host` does not apply.
        path = os.path.join(tempfile.mkdtemp(prefix="pdserve-kv-"), "recv.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(self.max_connections)
        server.settimeout(0.2)
        thread = threading.Thread(target=self._accept, args=(server, receiver), name="kv-shm-accept", daemon=True)
        thread.start()
        self._servers.append((server, path, thread))
        return f"shm://{path}?host={HOST_ID}"

    def _accept(self, server: socket.socket, receiver: KVReceiver) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._connections = [c for c in self._connections if c.is_alive()]
            if len(self._connections) >= self.max_connections:
                sock.close()  # bounded: refuse instead of queueing without limit
                continue
            conn = _Connection(sock, receiver, self.idle_timeout_s)
            self._connections.append(conn)
            conn.start()

    def connect(self, endpoint: str) -> KVChannel:
        if not endpoint.startswith("shm://"):
            raise ValueError(f"not a shared-memory endpoint: {endpoint}")
        path, _, host = endpoint.removeprefix("shm://").partition("?host=")
        if host and host != HOST_ID:
            raise ConnectionError(
                f"the KV receiver {endpoint} is on another host ({host}; this one is {HOST_ID}): shm moves KV only "
                "between processes of one host; use transport tcp, grpc or torch across hosts"
            )
        return _ShmChannel(path, self.staging_bytes)

    def shutdown(self) -> None:
        self._closed.set()
        for server, path, thread in self._servers:
            server.close()
            thread.join(timeout=2)
            with contextlib.suppress(OSError):
                os.unlink(path)
                os.rmdir(os.path.dirname(path))
        self._servers.clear()
        for conn in self._connections:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
