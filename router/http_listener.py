"""An ASGI app served over HTTP from inside a Ray Serve replica, on a socket of the replica's own.

The router replica is the HTTP server: a streamed token goes from it to the client, not through
Serve's proxy first (that hop cost ~0.8 ms of CPU per token in the proxy, plus the replica's side
of it, taken from the engine's cores on a CPU host). Serve's own direct ingress binds without
SO_REUSEADDR and gives a port up for good after one failed bind; this socket takes

- SO_REUSEADDR: a router restarted after a crash binds although its old connections are in TIME_WAIT;
- SO_REUSEPORT: a router started while another still listens (a replacement Serve starts before
  the unhealthy one is gone, a second replica on the host) binds beside it, and the kernel
  spreads new connections over both until the old one closes. (A redeploy of a single router
  stops the old one first: for the moments between its close and the new one's bind, new
  connections are refused.)

Binding happens in the constructor, so a port that cannot be had fails the replica at start, with
the reason; so does reading the TLS key and certificate (HTTPS, ``TlsFiles``). ``stop`` closes the
listening socket first (new connections go to the other replicas on the port), then lets
responses in flight finish within its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger(__name__)


def listening_socket(host: str, port: int, share_port: bool = True, backlog: int = 2048) -> socket.socket:
    """A bound, listening, non-blocking TCP socket on host:port (port 0: any free one)."""
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if share_port and hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def with_header_deadline(protocol_class: type[asyncio.Protocol], timeout_s: float) -> type[asyncio.Protocol]:
    """``protocol_class`` (uvicorn's h11 or httptools protocol) closing a connection whose request
    headers are not complete ``timeout_s`` after it opened or after its last response ended.
    uvicorn has no such deadline: sockets that connect and send nothing, or trickle a header a
    byte at a time, would stay and count against ``limit_concurrency`` (then /health gets 503)."""

    class HeaderDeadline(protocol_class):  # type: ignore[valid-type, misc]
        def connection_made(self, transport):  # type: ignore[no-untyped-def]
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def _arm_header_deadline(self) -> None:
            # The request in progress now: a new one's headers replace it when they are complete.
            self.loop.call_later(timeout_s, self._header_deadline_passed, self.cycle)

        def _header_deadline_passed(self, cycle_then: Any) -> None:
            if self.cycle is cycle_then and not self.transport.is_closing():
                self.transport.close()

    HeaderDeadline.__name__ = f"{protocol_class.__name__}WithHeaderDeadline"
    return HeaderDeadline


@dataclass(frozen=True)
class TlsFiles:
    """The PEM key and certificate the listener serves HTTPS with (uvicorn's ssl_keyfile/ssl_certfile)."""

    keyfile: str
    certfile: str

    @classmethod
    def of(cls, keyfile: str | None, certfile: str | None) -> TlsFiles | None:
        return cls(keyfile, certfile) if keyfile is not None and certfile is not None else None


class _ReplicaServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The process is Ray's worker: its signal handlers stay Ray's.
        yield


class HttpListener:
    """Serves ``app`` on host:port from the running event loop until ``stop``.

    ``max_connections`` bounds the connections and requests the server holds at once (beyond it
    uvicorn answers 503); the app's own admission control is meant to answer before that."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        max_connections: int = 4096,
        keep_alive_s: float = 5.0,
        drain_timeout_s: float = 600.0,
        header_timeout_s: float = 10.0,
        tls: TlsFiles | None = None,
        access_log: bool = False,
    ) -> None:
        self.socket = listening_socket(host, port)
        self.host, self.port = host, self.socket.getsockname()[1]
        self.scheme = "https" if tls is not None else "http"
        config = uvicorn.Config(
            app,
            lifespan="off",
            access_log=access_log,
            log_config=None,
            limit_concurrency=max_connections,
            timeout_keep_alive=int(keep_alive_s),
            timeout_graceful_shutdown=int(drain_timeout_s),
            server_header=False,
            http=with_header_deadline(AutoHTTPProtocol, header_timeout_s),
            ssl_keyfile=tls.keyfile if tls is not None else None,
            ssl_certfile=tls.certfile if tls is not None else None,
        )
        if access_log:
            # uvicorn writes a line only where its access logger has a handler; its Config turns
            # propagation off, process-wide, when a listener is made without the log.
            logging.getLogger("uvicorn.access").propagate = True
        if tls is not None:
            _load_tls(config, tls, self.socket)
        self._server = _ReplicaServer(config)
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> None:
        """Begin serving on the running loop (the caller's: a replica's user-code loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self.socket]))
            self._task.add_done_callback(self._closed)
            logger.info("serving %s on %s:%d", self.scheme.upper(), self.host, self.port)

    def _closed(self, task: asyncio.Task) -> None:
        # A server that ended on its own must not keep a listening socket: with SO_REUSEPORT the
        # kernel would go on handing it a share of new connections that nobody accepts.
        self.socket.close()
        if not self._stopping:
            logger.error("the HTTP server on %s:%d stopped: %r", self.host, self.port, self.failure())

    @property
    def serving(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def accepting(self) -> bool:
        """Whether its listening socket takes new connections (False once ``stop`` closed it,
        while responses in flight may still drain)."""
        return any(server.is_serving() for server in getattr(self._server, "servers", ()))

    def failure(self) -> BaseException | None:
        """Why the server stopped on its own, if it did."""
        if self._stopping or self._task is None or not self._task.done():
            return None
        if self._task.cancelled():
            return RuntimeError("the HTTP server was cancelled")
        return self._task.exception() or RuntimeError("the HTTP server exited")

    async def stop(self) -> None:
        """Stop accepting, let responses in flight end (within drain_timeout_s), close."""
        self._stopping = True
        if self._task is None:
            self.socket.close()
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self.socket.close()


def _load_tls(config: uvicorn.Config, tls: TlsFiles, sock: socket.socket) -> None:
    """The key and certificate read now (uvicorn would read them when it starts serving, where a
    bad file ends the server instead of failing the constructor with the reason)."""
    try:
        config.load()
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        sock.close()
        raise ValueError(
            f"cannot serve HTTPS with router.ssl_keyfile={tls.keyfile!r} and router.ssl_certfile={tls.certfile!r}: "
            f"{exc}"
        ) from exc
