"""Same-host transport: payloads cross through a shared-memory staging buffer, headers through a
Unix socket. No serialization of tensors: the sender copies a chunk's bytes into its staging
buffer once, the receiver verifies the header and copies from the mapped buffer straight into
its KV blocks. The sender never maps the receiver's cache, so an unauthenticated chunk writes
nothing.

    sender ── copy ──▶ staging shm (owned by the sender's channel) ── copy ──▶ receiver KV blocks
       └── socket: {header, shm name, nbytes} ───────────────────▶ verdict {ok, reason} ◀──┘
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import tempfile
import threading
import uuid
from multiprocessing import resource_tracker, shared_memory

import msgpack
import torch

from kv_transfer.receiver import KVReceiver
from kv_transfer.transport import KVChannel, KVTransport, TransferRefused

logger = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
_MAX_MESSAGE = 1 << 20  # control messages are small; anything bigger is refused


def _send_msg(sock: socket.socket, obj: dict) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        part = sock.recv(n - got)
        if not part:
            raise ConnectionError("peer closed the connection")
        chunks.append(part)
        got += len(part)
    return b"".join(chunks)


def _recv_msg(sock: socket.socket) -> dict:
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if size > _MAX_MESSAGE:
        raise ConnectionError(f"control message of {size} bytes refused")
    return msgpack.unpackb(_recv_exact(sock, size), raw=False)


def _attach(name: str) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name)
    # The sender owns (and unlinks) the segment; stop this process's tracker from unlinking it too.
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _close_quietly(shm: shared_memory.SharedMemory) -> None:
    with contextlib.suppress(BufferError):  # a view of the last chunk may still be alive; the mapping goes with it
        shm.close()


class _Connection(threading.Thread):
    """Receiver side of one sender's channel."""

    def __init__(self, sock: socket.socket, receiver: KVReceiver, idle_timeout_s: float) -> None:
        super().__init__(name="kv-shm-conn", daemon=True)
        self.sock = sock
        self.receiver = receiver
        self.idle_timeout_s = idle_timeout_s
        self.segments: dict[str, shared_memory.SharedMemory] = {}

    def run(self) -> None:
        self.sock.settimeout(self.idle_timeout_s)
        try:
            while True:
                msg = _recv_msg(self.sock)
                verdict = {"ok": True, "reason": ""}
                try:
                    payload = self._payload(msg)
                    self.receiver.apply(msg["header"], payload)
                except TransferRefused as exc:
                    verdict = {"ok": False, "reason": str(exc)}
                except Exception as exc:  # a malformed message fails this chunk, not the thread
                    verdict = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}
                _send_msg(self.sock, verdict)
        except (ConnectionError, OSError, ValueError):
            pass  # peer gone or idle: drop the connection
        finally:
            self.sock.close()
            for shm in self.segments.values():
                _close_quietly(shm)

    def _payload(self, msg: dict) -> memoryview | bytes:
        nbytes = int(msg["nbytes"])
        if nbytes == 0:
            return b""
        name = str(msg["shm"])
        shm = self.segments.get(name)
        if shm is None:
            for old in self.segments.values():  # the sender grew its buffer: the old one is gone
                _close_quietly(old)
            self.segments = {name: (shm := _attach(name))}
        if nbytes > shm.size:
            raise ValueError(f"{nbytes} bytes do not fit the {shm.size}-byte staging buffer")
        return shm.buf[:nbytes]


class _ShmChannel(KVChannel):
    def __init__(self, path: str, initial_bytes: int) -> None:
        self.path = path
        self.initial_bytes = initial_bytes
        self.sock: socket.socket | None = None
        self.shm: shared_memory.SharedMemory | None = None

    def _staging(self, nbytes: int) -> shared_memory.SharedMemory:
        if self.shm is None or self.shm.size < nbytes:
            if self.shm is not None:
                self.shm.close()
                self.shm.unlink()
            size = max(self.initial_bytes, nbytes)
            self.shm = shared_memory.SharedMemory(name=f"pdkv-{uuid.uuid4().hex[:16]}", create=True, size=size)
        return self.shm

    def staging(self, nbytes: int) -> torch.Tensor | None:
        return torch.frombuffer(self._staging(nbytes).buf, dtype=torch.uint8, count=nbytes) if nbytes else None

    def send(self, header, payload, timeout_s):
        nbytes = len(payload)
        if nbytes:
            # torch's copy is multi-threaded; a memoryview slice assignment is one plain memcpy.
            staging = self.staging(nbytes)
            assert staging is not None
            staging.copy_(torch.frombuffer(payload, dtype=torch.uint8, count=nbytes))
        self.send_staged(header, nbytes, timeout_s)

    def send_staged(self, header, nbytes, timeout_s):
        if self.sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise ConnectionError(f"no KV receiver at {self.path}: {exc}") from exc
            self.sock = sock
        name = self.shm.name if nbytes and self.shm is not None else ""
        self.sock.settimeout(timeout_s)
        try:
            _send_msg(self.sock, {"header": bytes(header), "shm": name, "nbytes": nbytes})
            verdict = _recv_msg(self.sock)
        except TimeoutError:
            self.close()
            raise
        except OSError as exc:
            self.close()
            raise ConnectionError(f"KV receiver at {self.path} went away: {exc}") from exc
        if not verdict["ok"]:
            raise TransferRefused(verdict["reason"])

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()
            self.shm = None


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
        return f"shm://{path}"

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
        return _ShmChannel(endpoint.removeprefix("shm://"), self.staging_bytes)

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
