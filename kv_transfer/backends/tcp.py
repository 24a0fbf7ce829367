"""TCP transport: chunks over plain sockets, from the sender's cache straight into the receiver's blocks.

    sender channel                                   receiver endpoint
    connect (once; again after an error or idling) ──▶ accept thread: a thread per connection, or
                                                   ◀── greeting [ok | unavailable: at its limit]
    per chunk: head [magic, header_len, payload_len, timeout_ms, in_place] + header + payload
               one sendmsg() of the cache's own pieces ──▶ head checked before anything is allocated
                                                       in place: begin_direct() → recv_into() the
                                                                 reserved blocks, run by run
                                                       copied:   recv_into() a reused buffer → apply()
                                                   ◀── verdict [status, closing?, reason]

Why a socket beside gRPC and gloo: the bytes of a chunk sent in place are never copied in user
space. The sender hands the kernel the runs of its cache (``sendmsg`` of memoryviews); the receiver
reads them into the reserved blocks (``recv_into``). Small pieces cost nothing extra (one system
call carries up to 512 of them), so short transfers go in place too, where gloo (~70 us a message)
copies them into one message. On this machine a bare gloo send reaches ~0.4 of a raw TCP stream and
a bare grpcio stream 0.3-0.6; this path is that raw stream.

Refusals cost no round trip on the way: the payload follows its header at once, and a receiver that
refuses the chunk from a valid ticket (expired lease, a duplicate, a cache that cannot take it in
place) reads the payload and drops it before answering. A payload above ``max_payload_bytes`` or
from no valid ticket is answered and the connection closed instead (the verdict says so: the sender
takes a fresh connection for its next chunk); a malformed head closes it.

Pipelining: a request's layer chunks follow one another without waiting for their verdicts, which
the sender reads as they come; its "done" waits for all of them (see ``_TcpChannel``).

Deadlines: every send and receive carries the chunk's deadline (the sender's ``timeout_s``; on the
receiver, no later than ``idle_s`` nor, for a chunk received in place, the ticket's lease).
``KVReceiver.release`` cuts a payload in flight short by shutting its socket down, so nothing lands
in blocks that were handed back. The sender opens a fresh connection after any error mid-chunk (the
stream's position is lost) and after idling half the receiver's ``idle_s``.

Trust: every length is checked against the receiver's limits, and the header authenticated (signed
msgpack, ``KVReceiver.check_header``), before a payload is read or anything allocated for it;
payloads are raw bytes; nothing is unpickled. A chunk without a valid ticket (bad signature, unknown
request, malformed header) closes its connection, so forged chunks cannot hold connection slots.
A sender turned away (every slot taken) retries until its deadline. The stream is plaintext: serve
on loopback or a trusted network.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from common.errors import ConfigError
from common.openmp import run_tensor_ops_serially
from kv_transfer.receiver import DirectWrite, KVReceiver, NotInPlace
from kv_transfer.transport import KVChannel, KVTransport, TransferRefused

logger = logging.getLogger(__name__)

SCHEME = "tcp://"
_MAGIC = b"KVT1"
_HEAD = struct.Struct("<4sIQIB")  # magic, header_len, payload_len, timeout_ms, in_place
_VERDICT = struct.Struct("<B?H")  # status, closing (the receiver closes the connection), reason_len; then the reason
_MAX_HEADER_BYTES = 64 << 10
_MAX_REASON_BYTES = 1024
_OK, _REFUSED, _UNAVAILABLE, _DECLINED = 0, 1, 2, 3
_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)
# Chunks awaiting their verdict per connection: their verdicts (<= ~1 KB each, ~34 KB in all with
# the current chunk's) fit the receive buffer (128 KB by default on Linux), so a receiver never
# blocks writing one while its sender blocks writing a chunk.
_MAX_POSTED = 32
_BOUNCE_BYTES = 4 << 20  # a GPU cache is received through host memory in slices of this size
_DISCARD_BYTES = 1 << 20
_ACCEPT_POLL_S = 0.2  # how soon shutdown() stops the accept thread
_ACCEPT_RETRY_S = 0.1  # after a failed accept (no descriptors left, say)
_BUSY_RETRY_S = (0.01, 0.2)  # a sender turned away at its first, and longest, wait before trying again


@dataclass(frozen=True)
class TcpConfig:
    max_connections: int = 256  # senders connected to one served endpoint; more wait for a free slot
    max_payload_bytes: int = 1 << 30  # a larger chunk is refused before anything is allocated
    max_reused_bytes: int = 64 << 20  # a connection keeps its receive buffer up to this size
    connect_timeout_s: float = 10.0
    idle_s: float = 60.0  # a connection without a chunk for this long is closed
    # Until a connection's first chunk proves its sender holds a ticket here (a header signed with
    # its secret), it is on probation: closed unless that chunk comes within first_chunk_s, and one
    # peer address holds at most max_probation_per_peer of them (idle or forged sockets from one
    # host cannot fill the endpoint's slots, nor hold one for long).
    first_chunk_s: float = 5.0
    max_probation_per_peer: int = 16

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_payload_bytes", "max_probation_per_peer"):
            if getattr(self, name) < 1:
                raise ConfigError(f"tcp KV transport: {name}={getattr(self, name)} must be at least 1")
        if self.max_reused_bytes < 0:
            raise ConfigError(f"tcp KV transport: max_reused_bytes={self.max_reused_bytes} must be >= 0")
        for name in ("connect_timeout_s", "idle_s", "first_chunk_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"tcp KV transport: {name}={getattr(self, name)} must be a positive number")


# --- socket helpers: every call bounded by a deadline (time.monotonic) ------------------------


def _time_left(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"{what}: timed out")
    return left


def _recv_into(sock: socket.socket, view: memoryview, deadline: float, what: str) -> None:
    _recv_scattered(sock, [view], deadline, what)


def _recv_new(sock: socket.socket, nbytes: int, deadline: float, what: str) -> bytearray:
    data = bytearray(nbytes)
    _recv_into(sock, memoryview(data), deadline, what)
    return data


def _send_all(sock: socket.socket, buffers: list[memoryview], deadline: float, what: str) -> None:
    """Everything in ``buffers``, in order, with as few system calls as the kernel allows (no copy)."""
    pending = [b for b in buffers if len(b)]
    first = 0
    while first < len(pending):
        sock.settimeout(_time_left(deadline, what))
        first = _advance(pending, first, sock.sendmsg(pending[first : first + _IOV_MAX]))


def _recv_scattered(sock: socket.socket, buffers: list[memoryview], deadline: float, what: str) -> None:
    """Fill ``buffers`` in order from the stream, many per system call (the mirror of ``_send_all``)."""
    pending = [b for b in buffers if len(b)]
    first = 0
    while first < len(pending):
        sock.settimeout(_time_left(deadline, what))
        received = sock.recvmsg_into(pending[first : first + _IOV_MAX])[0]
        if received == 0:
            raise ConnectionError(f"{what}: the peer closed the connection")
        first = _advance(pending, first, received)


def _advance(pending: list[memoryview], first: int, nbytes: int) -> int:
    """Past ``nbytes`` moved from ``pending[first:]``: the index of the first buffer not yet full
    (which is trimmed to what it still lacks)."""
    while nbytes:
        if nbytes >= len(pending[first]):
            nbytes -= len(pending[first])
            first += 1
        else:
            pending[first] = pending[first][nbytes:]
            nbytes = 0
    return first


def _send_verdict(sock: socket.socket, status: int, reason: str, deadline: float, closing: bool = False) -> None:
    """Also the greeting. ``closing``: the connection ends after it (the sender must not reuse it)."""
    data = reason.encode()[:_MAX_REASON_BYTES]
    head = _VERDICT.pack(status, closing, len(data))
    _send_all(sock, [memoryview(head), memoryview(data)], deadline, "sending a verdict")


def _recv_verdict(sock: socket.socket, deadline: float, what: str) -> tuple[int, str, bool]:
    status, closing, reason_len = _VERDICT.unpack(_recv_new(sock, _VERDICT.size, deadline, what))
    if reason_len > _MAX_REASON_BYTES or status not in (_OK, _REFUSED, _UNAVAILABLE, _DECLINED):
        raise ConnectionError(f"{what}: malformed verdict (status {status}, reason of {reason_len} bytes)")
    return status, _recv_new(sock, reason_len, deadline, what).decode(errors="replace"), closing


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, as a flat byte view (no copy)."""
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)  # bf16 has no numpy dtype
    return memoryview(t.numpy()).cast("B")


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    if not endpoint.startswith(SCHEME):
        raise ValueError(f"not a TCP KV endpoint: {endpoint!r} (expected tcp://host:port)")
    host, _, port = endpoint.removeprefix(SCHEME).rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not a TCP KV endpoint: {endpoint!r} (expected tcp://host:port)")
    return host.strip("[]"), int(port)


# --- receiver side ---------------------------------------------------------------------------


class _Endpoint:
    """One served receiver: a listener on ``host``, an accept thread and a thread per connection."""

    def __init__(self, receiver: KVReceiver, host: str, config: TcpConfig) -> None:
        if not host:
            raise ValueError("serve on an address: the empty host would bind every interface unasked")
        self.receiver = receiver
        self.config = config
        self.host = host
        try:
            self._listener = socket.create_server(
                (host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=128
            )
        except OSError as exc:
            raise ConnectionError(f"cannot bind a KV transfer listener on {host}: {exc}") from exc
        self._listener.settimeout(_ACCEPT_POLL_S)
        self.port = self._listener.getsockname()[1]
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._probation: dict[socket.socket, str] = {}  # connections with no authentic chunk yet -> peer
        self._accept = threading.Thread(target=self._accept_loop, name=f"kv-tcp-accept-{self.port}", daemon=True)
        self._accept.start()

    @property
    def num_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def _accept_loop(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self.stopped.is_set():
                    return
                # Out of descriptors or memory for now: the endpoint must outlive it.
                logger.warning("tcp KV transport on port %d: accept failed (%s); retrying", self.port, exc)
                self.stopped.wait(_ACCEPT_RETRY_S)
                continue
            try:
                self._admit(conn)
            except Exception:
                logger.exception("tcp KV transport on port %d could not admit a sender", self.port)
                self._forget(conn)

    def _admit(self, conn: socket.socket) -> None:
        cfg = self.config
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        deadline = time.monotonic() + cfg.connect_timeout_s
        peer = _peer_address(conn)
        reason = ""
        with self._lock:
            on_probation = sum(1 for p in self._probation.values() if p == peer)
            if self.stopped.is_set() or len(self._connections) >= cfg.max_connections:
                reason = f"receiver at its limit of {cfg.max_connections} connections"
            elif on_probation >= cfg.max_probation_per_peer:
                reason = f"{on_probation} connections from {peer} have sent no authentic chunk yet"
            else:
                thread = threading.Thread(target=self._serve, args=(conn,), name="kv-tcp-conn", daemon=True)
                self._connections[conn] = thread
                self._probation[conn] = peer
        admitted = not reason
        try:
            if not admitted:
                logger.warning("tcp KV transport on port %d turned a sender away: %s", self.port, reason)
                _send_verdict(conn, _UNAVAILABLE, reason, deadline, closing=True)
                conn.close()
                return
            _send_verdict(conn, _OK, "", deadline)
        except OSError:  # the sender gave up already
            self._forget(conn)
            return
        thread.start()

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.pop(conn, None)
            self._probation.pop(conn, None)
        conn.close()

    def _trust(self, conn: socket.socket) -> None:
        with self._lock:
            self._probation.pop(conn, None)

    def _serve(self, conn: socket.socket) -> None:
        run_tensor_ops_serially()  # lands KV: the engine thread owns the process's OpenMP team
        try:
            buffer = bytearray(0)  # reused: apply() has copied the payload out when it returns
            with self.receiver.landing_stream():  # a GPU cache's bounce copies off the compute stream
                # The first chunk comes soon or never; its header is authentic, or the connection
                # closes (_UNTRUSTED); then the connection may idle between transfers.
                buffer = self._serve_chunk(conn, buffer, self.config.first_chunk_s)
                self._trust(conn)
                while not self.stopped.is_set():
                    buffer = self._serve_chunk(conn, buffer, self.config.idle_s)
        except (TimeoutError, ConnectionError, OSError) as exc:  # idle, the sender left, or broke the protocol
            logger.debug("tcp KV connection on port %d closed: %s", self.port, exc)
        except Exception:
            logger.exception("tcp KV connection on port %d failed", self.port)
        finally:
            self._forget(conn)

    def _serve_chunk(self, conn: socket.socket, buffer: bytearray, wait_s: float) -> bytearray:
        cfg = self.config
        head = bytearray(_HEAD.size)
        _recv_into(conn, memoryview(head), time.monotonic() + wait_s, "waiting for the next chunk")
        magic, header_len, payload_len, timeout_ms, in_place = _HEAD.unpack(head)
        if magic != _MAGIC or not 0 < header_len <= _MAX_HEADER_BYTES or in_place > 1:
            raise ConnectionError(f"malformed chunk head ({magic!r}, {header_len}-byte header)")
        deadline = time.monotonic() + min(max(timeout_ms, 1) / 1000, cfg.idle_s)
        header = bytes(_recv_new(conn, header_len, deadline, "receiving a chunk header"))
        outcome: _Outcome
        if self.stopped.is_set():
            outcome = _Outcome(_UNAVAILABLE, "receiver shut down", consumed=False, close=True)
        elif in_place:
            outcome = self._receive_in_place(conn, header, payload_len, deadline)
        elif payload_len > cfg.max_payload_bytes:
            reason = f"payload of {payload_len} bytes exceeds this receiver's limit of {cfg.max_payload_bytes}"
            outcome = _Outcome(_REFUSED, reason, consumed=False, close=True)
        else:
            buffer, outcome = self._receive_copied(conn, header, payload_len, buffer, deadline)
        if not outcome.consumed and not outcome.close:
            if payload_len > cfg.max_payload_bytes:  # not worth skipping: close instead
                outcome = replace(outcome, close=True)
            else:
                _discard(conn, payload_len, deadline)
        _send_verdict(conn, outcome.status, outcome.reason, deadline, closing=outcome.close)
        if outcome.close:
            raise ConnectionError(f"closed after a refused chunk: {outcome.reason}")
        return buffer

    def _receive_copied(
        self, conn: socket.socket, header: bytes, nbytes: int, buffer: bytearray, deadline: float
    ) -> tuple[bytearray, _Outcome]:
        """A payload into the connection's reused buffer, then ``apply``; nothing is allocated for
        a chunk whose header is not authentic or whose size its ticket could not hold."""
        if not nbytes:  # nothing to allocate or read (a "done"): apply() authenticates it, once
            return buffer, _refusal(lambda: self.receiver.apply(header, b""), consumed=True) or _Outcome(_OK, "")
        refused = _refusal(lambda: self.receiver.check_header(header, nbytes), consumed=False)
        if refused is not None:
            return buffer, refused
        if nbytes > self.config.max_reused_bytes:
            received = bytearray(nbytes)
        else:
            if len(buffer) < nbytes:
                buffer = bytearray(nbytes)
            received = buffer
        payload = memoryview(received)[:nbytes]
        _recv_into(conn, payload, deadline, "receiving a chunk payload")
        return buffer, _refusal(lambda: self.receiver.apply(header, payload), consumed=True) or _Outcome(_OK, "")

    def _receive_in_place(self, conn: socket.socket, header: bytes, nbytes: int, deadline: float) -> _Outcome:
        def abort() -> None:  # release() during the payload: nothing more lands in these blocks
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

        try:
            write = self.receiver.begin_direct(header, nbytes, None, abort=abort)
        except NotInPlace as exc:
            return _Outcome(_DECLINED, str(exc), consumed=False)
        except Exception as exc:
            return _outcome_of(exc, consumed=False)
        deadline = min(deadline, time.monotonic() + write.lease_left_s)
        try:
            _recv_targets(conn, write, deadline)
        except BaseException as exc:
            with contextlib.suppress(TransferRefused):
                self.receiver.end_direct(write, received=False, reason=str(exc) or type(exc).__name__)
            raise
        return _refusal(lambda: self.receiver.end_direct(write, received=True), consumed=True) or _Outcome(_OK, "")

    def shutdown(self, join_s: float) -> None:
        self.stopped.set()
        self._accept.join(timeout=join_s)
        self._listener.close()
        with self._lock:
            connections = dict(self._connections)
        for conn in connections:  # wakes threads waiting in recv: they see a closed peer and exit
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        end = time.monotonic() + join_s
        for thread in connections.values():
            thread.join(timeout=max(0.0, end - time.monotonic()))


def _recv_targets(conn: socket.socket, write: DirectWrite, deadline: float) -> None:
    """The payload, straight into the targets in order (a GPU target through a host bounce buffer)."""
    views = write.views()
    if views is not None:
        _recv_scattered(conn, views, deadline, "receiving a chunk payload")
        return
    bounce = _bounce_buffer()
    for target in write.targets:
        for start in range(0, target.numel(), _BOUNCE_BYTES):
            part = target[start : start + _BOUNCE_BYTES]
            _recv_into(conn, _bytes_of(bounce[: part.numel()]), deadline, "receiving a chunk payload")
            part.copy_(bounce[: part.numel()])


_per_connection = threading.local()  # a connection is served by its own thread


def _bounce_buffer() -> torch.Tensor:
    """This connection's host buffer for a GPU cache, allocated once (pinned memory is slow to get)."""
    bounce = getattr(_per_connection, "bounce", None)
    if bounce is None:
        bounce = _per_connection.bounce = torch.empty(
            _BOUNCE_BYTES, dtype=torch.uint8, pin_memory=torch.cuda.is_available()
        )
    return bounce


def _peer_address(conn: socket.socket) -> str:
    try:
        return str(conn.getpeername()[0])
    except OSError:
        return "?"


def _discard(conn: socket.socket, nbytes: int, deadline: float) -> None:
    sink = memoryview(bytearray(min(nbytes, _DISCARD_BYTES)))
    while nbytes:
        step = min(nbytes, len(sink))
        _recv_into(conn, sink[:step], deadline, "skipping a refused chunk's payload")
        nbytes -= step


# Refusals that say the sender holds no valid ticket here: its connection is closed rather than
# kept (an unauthenticated peer must not hold connection slots by sending forged chunks).
_UNTRUSTED = frozenset({"malformed", "unknown_ticket", "bad_signature"})


@dataclass(frozen=True)
class _Outcome:
    status: int
    reason: str
    consumed: bool = True  # the payload was read off the connection (if not: skipped, or the connection closed)
    close: bool = False


def _refusal(land: Callable[[], None], consumed: bool) -> _Outcome | None:
    """None if ``land`` succeeds; otherwise the verdict that says why. ``consumed``: whether the
    chunk's payload has been read off the connection by then."""
    try:
        land()
        return None
    except Exception as exc:
        return _outcome_of(exc, consumed)


def _outcome_of(exc: Exception, consumed: bool) -> _Outcome:
    if isinstance(exc, TransferRefused):
        return _Outcome(_REFUSED, str(exc), consumed, close=exc.kind in _UNTRUSTED)
    logger.error("a KV chunk failed in the receiver", exc_info=exc)
    return _Outcome(_UNAVAILABLE, f"receiver error: {type(exc).__name__}: {exc}", consumed)


# --- sender side -----------------------------------------------------------------------------


class _Unread(Exception):
    """A chunk sent behind a refusal that closed the connection: the receiver never read it."""


class _TcpChannel(KVChannel):
    """One connection to a receiver endpoint, opened on first use; one sender thread at a time.

    Pipelined: a chunk sent with a tag returns once the kernel holds its bytes (its memory may be
    reused then), and its verdict is read later, in order (``collect``, or before the next chunk
    that waits for its own). The receiver answers every chunk of a connection in turn, so a
    request's layers stream without a round trip each. Only one request's chunks are outstanding at
    a time (the verdicts are read before another request's chunk leaves), so whatever ends the
    connection — a refusal that closes it, ``release()`` cutting a payload short — fails no other
    request. At most ``_MAX_POSTED`` verdicts are outstanding (see there)."""

    in_place_min_piece_bytes = 0  # a piece costs no message of its own here: small ones go in place too
    pipelines = True

    def __init__(self, endpoint: str, config: TcpConfig) -> None:
        self.endpoint = endpoint
        self.host, self.port = _split_endpoint(endpoint)
        self.config = config
        self.sends_in_place = True  # until the receiver declines it once
        self._in_place_accepted = False  # in-place chunks wait for their verdict until one is accepted
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._last_used = 0.0
        self._posted: deque[tuple[str, float]] = deque()  # (tag, deadline) of chunks awaiting a verdict
        self._late: list[tuple[str, Exception]] = []  # failures of posted chunks, until collected

    @property
    def num_posted(self) -> int:
        return len(self._posted)

    def send(self, header: bytes, payload: memoryview | bytes, timeout_s: float, tag: str | None = None) -> None:
        view = memoryview(payload)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        verdict = self._exchange(header, [view], len(view), False, timeout_s, tag)
        if verdict is not None:
            _raise_for(self.endpoint, *verdict)

    def send_pieces(self, header: bytes, pieces: list[torch.Tensor], timeout_s: float, tag: str | None = None) -> bool:
        if not self.sends_in_place or any(piece.device.type != "cpu" for piece in pieces):
            return False
        return self._send_in_place([_bytes_of(piece) for piece in pieces], header, timeout_s, tag)

    def send_spans(
        self,
        header: bytes,
        layers: list[torch.Tensor],
        spans: list[tuple[int, int]],
        timeout_s: float,
        tag: str | None = None,
    ) -> bool:
        if not self.sends_in_place or any(kv.device.type != "cpu" for kv in layers):
            return False
        parts = []
        for kv in layers:  # one memoryview per layer, sliced: no tensor op per piece
            flat = _bytes_of(kv)
            parts += [flat[offset : offset + length] for offset, length in spans]
        return self._send_in_place(parts, header, timeout_s, tag)

    def _send_in_place(self, parts: list[memoryview], header: bytes, timeout_s: float, tag: str | None) -> bool:
        """``parts``: views of the cache, contiguous runs of blocks."""
        # Until the receiver has taken one chunk in place, wait for the verdict: a refusal to take
        # chunks in place then falls back to copies instead of failing the request.
        verdict = self._exchange(
            header, parts, sum(len(p) for p in parts), True, timeout_s, tag if self._in_place_accepted else None
        )
        if verdict is None:
            return True
        status, reason = verdict
        if status == _DECLINED:
            logger.info("%s takes no chunks in place (%s): sending copies", self.endpoint, reason)
            self.sends_in_place = False
            return False
        _raise_for(self.endpoint, status, reason)
        self._in_place_accepted = True
        return True

    def collect(self, wait: bool, timeout_s: float) -> list[tuple[str, Exception]]:
        with self._lock:
            if self._posted:
                try:
                    self._settle(everything=wait)
                    if self._posted and time.monotonic() > self._posted[0][1]:  # overdue: the receiver is stuck
                        raise TimeoutError("no verdict within the chunk's deadline")
                except OSError as exc:
                    self._broken(ConnectionError(f"{self.endpoint}: {exc}"))
            failures, self._late = self._late, []
            return failures

    def _exchange(
        self, header: bytes, parts: list[memoryview], nbytes: int, in_place: bool, timeout_s: float, tag: str | None
    ) -> tuple[int, str] | None:
        """Send one chunk; its verdict (status, reason), or None if posted under ``tag``."""
        if len(header) > _MAX_HEADER_BYTES:
            raise TransferRefused(f"chunk header of {len(header)} bytes exceeds the {_MAX_HEADER_BYTES} allowed")
        deadline = time.monotonic() + timeout_s
        head = _HEAD.pack(_MAGIC, len(header), nbytes, min(int(timeout_s * 1000), 0xFFFFFFFF), in_place)
        with self._lock:
            try:
                try:
                    return self._exchange_once(head, header, parts, deadline, tag)
                except _Unread:
                    # The receiver closed the connection after refusing an earlier chunk, before
                    # reading this one: safe to send again, on a fresh connection.
                    return self._exchange_once(head, header, parts, deadline, tag)
            except _Unread as exc:
                raise ConnectionError(f"{self.endpoint}: {exc}") from None
            except TimeoutError:
                self._broken(TimeoutError(f"no verdict from {self.endpoint} within {timeout_s:.1f}s"))
                raise TimeoutError(f"no verdict from {self.endpoint} within {timeout_s:.1f}s") from None
            except OSError as exc:
                self._broken(ConnectionError(f"{self.endpoint}: {exc}"))
                raise ConnectionError(f"{self.endpoint}: {exc}") from None

    def _exchange_once(
        self, head: bytes, header: bytes, parts: list[memoryview], deadline: float, tag: str | None
    ) -> tuple[int, str] | None:
        """One attempt at ``_exchange``. Lock held. Raises _Unread if the chunk was sent behind a
        refusal that closed the connection (the receiver never read it), OSError if it broke."""
        # Verdicts that arrived meanwhile; at the cap, wait for the oldest. Only one request's
        # chunks are ever outstanding: before another's chunk, every verdict is read, so a refusal
        # that closes the connection (or a payload cut short by release()) costs no other request.
        other_request = any(posted_tag != tag for posted_tag, _ in self._posted)
        self._settle(other_request, len(self._posted) >= _MAX_POSTED, limit=deadline)
        sock = self._connection(deadline)
        try:
            _send_all(sock, [memoryview(head), memoryview(header), *parts], deadline, "sending a chunk")
        except (BrokenPipeError, ConnectionResetError) as exc:
            if self._posted:
                with contextlib.suppress(OSError):
                    self._settle(everything=True, limit=deadline)  # why it closed, if still readable
                if self._sock is None:
                    raise _Unread("closed after refusing an earlier chunk") from None
                raise ConnectionError(f"the receiver closed the connection ({exc})") from None
            # The receiver answered and closed early (a chunk over its limit): read why.
            status, reason, _ = _recv_verdict(sock, min(deadline, time.monotonic() + 1.0), "reading a refusal")
            self._drop()
            return status, reason
        self._last_used = time.monotonic()
        if tag is not None:
            self._posted.append((tag, deadline))
            return None
        self._settle(everything=True, limit=deadline)  # the verdicts of earlier chunks come first
        if self._sock is None:
            raise _Unread("closed after refusing an earlier chunk")
        status, reason, closing = _recv_verdict(sock, deadline, "waiting for the receiver's verdict")
        if closing:  # a refusal that ends the connection: the next chunk takes a fresh one
            self._drop()
        return status, reason

    def _settle(self, everything: bool, at_least_one: bool = False, limit: float = float("inf")) -> None:
        """Read posted chunks' verdicts in order: all of them (``everything``), else those already
        here (and the oldest, ``at_least_one``). Each waits until its own chunk's deadline, and no
        later than ``limit`` (the deadline of a chunk being sent now: a request must not outlive its
        lease waiting on another's). Lock held; raises OSError if the connection broke."""
        while self._posted and self._sock is not None:
            if not (everything or at_least_one or _readable(self._sock)):
                return
            at_least_one = False
            tag, deadline = self._posted[0]
            wait_until = min(max(deadline, time.monotonic() + 0.05), limit)
            status, reason, closing = _recv_verdict(self._sock, wait_until, "waiting for a posted chunk's verdict")
            self._posted.popleft()
            if status == _DECLINED:  # this receiver takes copies only: the next chunks are copied
                self.sends_in_place = False
            if status != _OK:
                self._late.append((tag, _error_for(self.endpoint, status, reason)))
            if closing:  # the chunks after that one were never read
                self._broken(ConnectionError(f"{self.endpoint} closed the connection after refusing a chunk: {reason}"))

    def _broken(self, error: Exception) -> None:
        """The connection is gone: every chunk still awaiting its verdict failed with ``error``."""
        self._late.extend((tag, error) for tag, _ in self._posted)
        self._posted.clear()
        self._drop()

    def _connection(self, deadline: float) -> socket.socket:
        """The open connection, or a new one (after idling, or once the receiver has closed it). Lock held."""
        sock = self._sock
        idle = time.monotonic() - self._last_used > self.config.idle_s / 2
        # With verdicts outstanding the connection is in use (and readable: they are arriving).
        if sock is not None and not self._posted and (idle or _readable(sock)):
            self._drop()  # idle (the receiver closes such connections) or closed by the receiver
        wait = _BUSY_RETRY_S[0]
        while self._sock is None:
            status, reason = self._connect(deadline)
            if status == _OK:
                break
            # Turned away before sending anything (every slot taken): safe to try again, until the deadline.
            if time.monotonic() + wait >= deadline:
                raise ConnectionError(f"{self.endpoint} turned this sender away: {reason}")
            time.sleep(wait)
            wait = min(2 * wait, _BUSY_RETRY_S[1])
        assert self._sock is not None
        return self._sock

    def _connect(self, deadline: float) -> tuple[int, str]:
        """One connection attempt: the receiver's greeting, with the connection kept if it is OK."""
        try:
            timeout = min(self.config.connect_timeout_s, _time_left(deadline, f"connecting to {self.endpoint}"))
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except TimeoutError:
            raise TimeoutError(f"connecting to {self.endpoint}: timed out") from None
        except OSError as exc:
            raise ConnectionError(f"no KV receiver at {self.endpoint}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            status, reason, _ = _recv_verdict(
                sock, min(deadline, time.monotonic() + self.config.connect_timeout_s), "connecting"
            )
        except OSError as exc:
            sock.close()
            raise ConnectionError(f"{self.endpoint} did not greet: {exc}") from None
        if status == _OK:
            self._sock = sock
            self.num_connects += 1
        else:
            sock.close()
        return status, reason

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def close(self) -> None:
        # Not under the lock first: a chunk in flight holds it until its deadline. Shutting the
        # socket down ends that exchange at once (it fails with ConnectionError and drops it).
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._drop()


def _error_for(endpoint: str, status: int, reason: str) -> Exception:
    if status in (_REFUSED, _DECLINED):
        return TransferRefused(reason)
    return ConnectionError(f"{endpoint}: {reason}")


def _raise_for(endpoint: str, status: int, reason: str) -> None:
    if status != _OK:
        raise _error_for(endpoint, status, reason)


def _readable(sock: socket.socket) -> bool:
    """Whether a read would not block. With no verdict outstanding the receiver sends nothing, so
    then readable means it closed the connection."""
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


class TcpTransport(KVTransport):
    name = "tcp"

    def __init__(self, config: TcpConfig | None = None, **options) -> None:
        self.config = config if config is not None else TcpConfig(**options)
        self._endpoints: list[_Endpoint] = []

    def serve(self, receiver: KVReceiver, host: str = "127.0.0.1") -> str:
        """Binds ``host`` (loopback unless the caller asks otherwise) on a free port. A wildcard
        (0.0.0.0, ::) binds every interface; no peer dials it, so the caller names the endpoint
        by an address it is reachable at (``kv_transfer.transport.advertised``)."""
        endpoint = _Endpoint(receiver, host, self.config)
        self._endpoints.append(endpoint)
        address = f"[{host}]" if ":" in host else host
        return f"{SCHEME}{address}:{endpoint.port}"

    def connect(self, endpoint: str) -> KVChannel:
        return _TcpChannel(endpoint, self.config)

    def num_connections(self) -> int:
        """Senders connected to this transport's endpoints (a gauge for metrics)."""
        return sum(endpoint.num_connections for endpoint in self._endpoints)

    def shutdown(self, join_s: float = 1.0) -> None:
        """Stops accepting, closes every connection and joins their threads for up to ``join_s``."""
        for endpoint in self._endpoints:
            endpoint.shutdown(join_s)
        self._endpoints.clear()


__all__ = ["TcpConfig", "TcpTransport"]
