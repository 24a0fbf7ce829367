"""The decode replica's KV listener abused while real hand-offs run through it, on a real cluster.

    tcp    300 sockets from another address (127.0.0.2: another host, as the listener sees it)
           that connect and never send a chunk
    grpc   8 Push streams from that address that send nothing and set no deadline
    torch  a stranger's writes to the pairing store: the old pair counter pushed a million ahead,
           ids with no hello and junk pushed on the id queue

Each abuse is kept up from before the first hand-off to after the last: what the listener closes
is opened again at once. Meanwhile the long prompts' KV goes through that same listener: every
answer equals transformers', no hand-off fails (none is recomputed, no attempt retried), and no
replica holds a block afterwards. The listeners' own limits (probation slots per peer, calls per
peer, pairing by announced ids) are unit-tested in tests/kv_transfer; this is the same abuse with
the cluster's own senders, tickets and settings.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import secrets
import socket
import threading
import time
import urllib.request

import pytest

from tests.cluster.serving import MODEL, LocalCluster, get_json, post
from tests.conftest import PROMPTS, long_text

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.timeout(900)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def cluster():
    local = LocalCluster()
    yield local
    local.shutdown()


@pytest.fixture(scope="module")
def expected(greedy_text):
    return lambda prompt: greedy_text(prompt, MAX_TOKENS)


def decode_kv_endpoint(cluster: LocalCluster) -> tuple[str, int]:
    """The decode replica's KV listener: the one socket its process listens on at 127.0.0.1 (Ray's
    and Serve's own listen on every interface; gRPC's socket is dual-stack, ::ffff:127.0.0.1).
    Polled: right after a redeploy the status may still carry the replaced replica's report."""
    import psutil

    deadline = time.monotonic() + 60
    while True:
        (decode,) = cluster.status()["pools"]["decode"]
        ours = [
            c.laddr.port
            for c in psutil.net_connections(kind="tcp")
            if c.pid == decode["pid"]
            and c.status == psutil.CONN_LISTEN
            and c.laddr.ip.removeprefix("::ffff:") == "127.0.0.1"
        ]
        if len(ours) == 1:
            return "127.0.0.1", ours[0]
        assert time.monotonic() < deadline, (decode["pid"], ours)
        time.sleep(0.5)


class Abuser:
    """Keeps up one kind of abuse from its own thread until ``stop``: what the listener closes or
    cancels is opened again at once, as a determined peer would."""

    def __init__(self, transport: str, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.stop = threading.Event()
        self.rounds = 0
        target = {"tcp": self._idle_sockets, "grpc": self._silent_streams, "torch": self._poison_pairing}[transport]
        self.thread = threading.Thread(target=target, daemon=True)

    def __enter__(self) -> Abuser:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop.set()
        self.thread.join(60)

    def _idle_sockets(self, count: int = 300) -> None:
        """``count`` sockets from 127.0.0.2 (another host, as the listener sees it) that connect and
        never send a chunk; each one closed is replaced."""
        held: list[socket.socket] = []
        try:
            while not self.stop.is_set():
                held = [sock for sock in held if not _closed_by_peer(sock)]
                for _ in range(count - len(held)):
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    sock.settimeout(5)
                    sock.bind(("127.0.0.2", 0))
                    with contextlib.suppress(OSError):
                        sock.connect((self.host, self.port))
                    held.append(sock)
                self.rounds += 1
                self.stop.wait(0.2)
        finally:
            for sock in held:
                sock.close()

    def _silent_streams(self, count: int = 8) -> None:
        """``count`` Push calls that send nothing and set no deadline, from 127.0.0.2 (through a
        forwarder: gRPC's client cannot pick its source address); each one ended is replaced."""
        import grpc

        from protos import kv_transfer_pb2_grpc

        def nothing():
            self.stop.wait(120)
            return
            yield

        with (
            Forwarder(self.host, self.port, source="127.0.0.2") as forwarder,
            grpc.insecure_channel(f"127.0.0.1:{forwarder.port}") as channel,
        ):
            push = kv_transfer_pb2_grpc.KVTransferStub(channel).Push
            calls: list = []
            while not self.stop.is_set():
                calls = [call for call in calls if not call.done()]
                calls += [push.future(nothing()) for _ in range(count - len(calls))]
                self.rounds += 1
                self.stop.wait(0.2)

    def _poison_pairing(self) -> None:
        """A stranger's writes to the pairing store, every 0.2 s: the old pair counter pushed a
        million ahead (7f34ac8: pairing stopped), ids with no hello and junk on the id queue."""
        import torch.distributed as dist

        stranger = dist.TCPStore(self.host, self.port, is_master=False, timeout=datetime.timedelta(seconds=10))
        while not self.stop.is_set():
            stranger.add("pairs/next", 10**6)
            stranger.queue_push("pairs/queue", secrets.token_hex(16))
            stranger.queue_push("pairs/queue", b"\xff not an id")
            self.rounds += 1
            self.stop.wait(0.2)


class Forwarder:
    """Relays each connection made to it to ``host:port`` from the ``source`` address."""

    def __init__(self, host: str, port: int, source: str) -> None:
        self.target, self.source = (host, port), source
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._sockets: list[socket.socket] = []

    def __enter__(self) -> Forwarder:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.target, source_address=(self.source, 0))
            except OSError:
                return
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def transfer_failures(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("pdserve:kv_transfer_failures"))


@pytest.mark.parametrize("transport", ["tcp", "grpc", "torch"])
def test_real_hand_offs_complete_while_the_kv_listener_is_abused(cluster, expected, transport):
    cluster.ensure(mode="disagg", transport=transport)
    url = cluster.url
    prompts = [f"{long_text(1)} {p}" for p in PROMPTS]
    host, port = decode_kv_endpoint(cluster)
    failures_before = transfer_failures(url)

    def one(prompt: str) -> tuple[int, str]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        code, _, answer = post(url + "/v1/completions", body, timeout=120)
        return code, answer["choices"][0]["text"] if code == 200 else str(answer)

    with Abuser(transport, host, port) as abuser:
        while abuser.rounds < 2:  # the abuse is in place before the first hand-off
            time.sleep(0.1)
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(one, prompts * 3))
        took = time.monotonic() - started
    assert answers == [(200, expected(p)) for p in prompts * 3], answers
    assert transfer_failures(url) == failures_before  # every hand-off went through, none recomputed
    print(f"{transport}: {len(answers)} hand-offs under abuse in {took:.1f} s, {abuser.rounds} rounds of it")
    status = get_json(url + "/pdserve/status")
    assert status["retries"] == 0, status["retries"]
    cluster.wait_idle()
