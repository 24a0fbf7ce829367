"""KV transfer: GB/s and latency per backend, next to this machine's ceilings measured in the same run.

    python -m bench.kv_transfer [--backends inproc shm shm-staged grpc torch] [--tokens 128 1024 8192]
                                [--repeats 3] [--fragmented] [--integrity none crc32 mac]

Layouts: SmolLM2-135M (30 layers, 3 KV heads x 64, float32 as it runs on CPU) and an 8B-class
model (32 layers, 8 KV heads x 128, bfloat16). The receiver runs in its own process, as a decode
replica does ("inproc" excepted). "shm" reads the sender's cache in place (a prefill engine
allocates it in shared memory for this backend); "shm-staged" sends from a private cache.

Ceilings: memcpy (torch copy of 1 GiB; the limit for shared memory), a raw loopback TCP stream
(the limit for network backends), both measured again next to each row (the best of two runs), and
what grpcio and gloo reach on their own here ("of library"). A transfer under 64 MB lasts a few
milliseconds, where a stream's GB/s is the wrong yardstick: "one-shot ms" is the floor for the same
bytes with nothing of ours — another process, already connected, takes them off a raw loopback
socket (network backends) or copies them out of shared memory on a go-byte (shm) and answers one
byte — and "of one-shot" is that floor over the backend's time.
The "hidden %" column pushes each transfer's layers behind a simulated per-layer compute time of
twice one layer's transfer, and reports the share of the transfer that compute hid; "first layer
ms" comes from that run: from the compute thread handing layer 0 over to the receiver having all
of it in its blocks. GB/s and "ms" come from back-to-back pushes (no compute), best of --repeats.
Transfers under 64 MB last milliseconds: they take the best of at least 10 pushes, and their
"hidden %" columns the median of 3 runs.

"One layer's transfer" is measured two ways. Back to back, a sender that falls behind sends the
layers queued together, so a layer costs the whole transfer over the number of layers ("hidden %").
Behind a forward pass, layers leave one at a time, each as its own chunk: "solo layer ms" hands
each layer over only once the previous one has left (been acknowledged; over tcp, which pipelines
chunks, been handed to the kernel), and "hidden % solo" uses twice that as the compute time — the
case the target names, compute per layer above transfer per layer. What is not hidden ("tail ms")
is the tail once the last layer is computed (that layer, the "done" and its round trip) plus the
time the compute thread spent handing layers over (a queue put each, which waits for the GIL while
the sending thread holds it). "hidden % bound" is the most any sender could hide there: the last
layer leaves only once it is computed, so its solo transfer is never hidden (1 - solo layer /
whole transfer); a short transfer's layers cost much more one by one than together.

``--integrity``: each row once per way of checking payloads (kv_transfer.protocol: none, crc32, or
mac, Poly1305 under a one-time key from the ticket's secret), both sides hashing as a deployment's would; "vs none"
is a row's back-to-back time over the same transfer's without a check, measured next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing as mp
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch

from bench.common import print_table, write_json
from common.kv_layout import KVCacheLayout
from engine.kv_cache_memory import allocate_kv_caches, release_kv_caches
from kv_transfer import KVReceiver, KVSender, KVTicket, TransferState, make_ticket
from kv_transfer.protocol import INTEGRITY_MODES
from kv_transfer.transport import available_backends, get_transport

LAYOUTS = {
    "smollm2-135m": dict(num_layers=30, total_kv_heads=3, head_dim=64, dtype="float32"),
    "8b-class": dict(num_layers=32, total_kv_heads=8, head_dim=128, dtype="bfloat16"),
}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BLOCK = 16


def memcpy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 3) -> float:
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return num_bytes / best  # bytes copied per second (each byte read once and written once)


def tcp_bandwidth(num_bytes: int = 1 << 30, chunk: int = 4 << 20, repeats: int = 3) -> float:
    """A raw loopback TCP stream, best of ``repeats`` (one slow run on this shared machine is noise)."""
    return max(_tcp_stream(num_bytes, chunk) for _ in range(repeats))


def _tcp_stream(num_bytes: int, chunk: int) -> float:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    received = [0]

    def drain():
        conn, _ = server.accept()
        buf = bytearray(chunk)
        view = memoryview(buf)
        while received[0] < num_bytes:
            n = conn.recv_into(view)
            if not n:
                break
            received[0] += n
        conn.close()

    thread = threading.Thread(target=drain)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    payload = memoryview(bytearray(chunk))
    start = time.perf_counter()
    sent = 0
    while sent < num_bytes:
        client.sendall(payload)
        sent += chunk
    thread.join()
    elapsed = time.perf_counter() - start
    client.close()
    server.close()
    return received[0] / elapsed


def _one_shot_peer(port: int, num_bytes: int, shm_name: str | None) -> None:
    """The receiving process of ``one_shot_seconds``: per go-byte, take ``num_bytes`` (off the
    socket, or copied out of the shared segment ``shm_name``) and answer one byte."""
    from multiprocessing import shared_memory

    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    dst = bytearray(num_bytes)
    view = memoryview(dst)
    segment = shared_memory.SharedMemory(shm_name) if shm_name else None
    src = torch.frombuffer(segment.buf, dtype=torch.uint8, count=num_bytes) if segment else None
    try:
        while conn.recv(1):
            if src is not None:
                torch.frombuffer(dst, dtype=torch.uint8).copy_(src)
            else:
                filled = 0
                while filled < num_bytes:
                    n = conn.recv_into(view[filled:])
                    if not n:
                        return
                    filled += n
            conn.sendall(b"k")
    finally:
        conn.close()
        del src
        if segment is not None:
            segment.close()


def one_shot_seconds(num_bytes: int, same_host: bool, repeats: int = 20) -> float:
    """The floor of one short transfer, with nothing of ours: another process, already connected,
    takes ``num_bytes`` and answers one byte — over a raw loopback socket (the network backends'
    floor) or by copying them out of shared memory when a byte says go (shm's). Best of ``repeats``.
    A stream's GB/s is the wrong ceiling for a few MB: a wake-up and a round trip are part of it."""
    from multiprocessing import shared_memory

    server = socket.socket()
    segment: shared_memory.SharedMemory | None = None
    peer = conn = None
    try:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(120)
        if same_host:  # written, as a cache is: untouched pages would all read one zero page
            segment = shared_memory.SharedMemory(create=True, size=num_bytes)
            torch.frombuffer(segment.buf, dtype=torch.uint8, count=num_bytes).fill_(1)
        peer = mp.get_context("spawn").Process(
            target=_one_shot_peer,
            args=(server.getsockname()[1], num_bytes, segment.name if segment else None),
            daemon=True,
        )
        peer.start()
        conn, _ = server.accept()
        conn.settimeout(60)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = memoryview(bytearray(num_bytes))
        times = []
        for _ in range(repeats + 2):  # two warm-ups
            start = time.perf_counter()
            conn.sendall(b"g")
            if segment is None:
                conn.sendall(payload)
            if conn.recv(1) != b"k":
                raise ConnectionError("the one-shot peer went away")
            times.append(time.perf_counter() - start)
        return min(times[2:])
    finally:
        if conn is not None:
            conn.close()  # the peer's recv ends: it exits
        server.close()
        if peer is not None:
            _reap(peer, 10)
        if segment is not None:
            segment.close()
            segment.unlink()


def _reap(process, wait_s: float) -> None:
    process.join(wait_s)
    if process.is_alive():
        process.kill()
        process.join(5)


def _grpc_stream_bandwidth(num_bytes: int = 512 << 20, piece: int = 1 << 20) -> float:
    """grpcio's own ceiling here: one client stream of raw byte messages to a server that drops
    them (no protobuf, no copies of ours), in one process as the transfer benches run."""
    import grpc

    from kv_transfer.backends.grpc_backend import _channel_options

    def drain(messages, context):
        for _ in messages:
            pass
        return b""

    server = grpc.server(ThreadPoolExecutor(max_workers=2), options=_channel_options(piece))
    handler = grpc.stream_unary_rpc_method_handler(drain, lambda b: b, lambda b: b)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Sink", {"Drain": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=_channel_options(piece))
    push = channel.stream_unary("/bench.Sink/Drain", lambda b: b, lambda b: b)
    data = bytes(piece)
    push(iter([data] * 16), timeout=60)  # warm-up
    best = min(_timed(lambda: push(iter([data] * (num_bytes // piece)), timeout=120)) for _ in range(2))
    channel.close()
    server.stop(0)
    return num_bytes / best


def _gloo_peer(port: int, num_bytes: int, chunk: int) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    group = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=60))
    buf = torch.empty(chunk, dtype=torch.uint8)
    for _ in range(3 * (num_bytes // chunk) + 1):
        group.recv([buf], 0, 0).wait()
    group.send([buf[:1]], 0, 1).wait()


def gloo_bandwidth(num_bytes: int = 512 << 20, chunk: int = 32 << 20) -> float:
    """torch.distributed's gloo send/recv between two processes on loopback: the torch backend's ceiling."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    peer = ctx.Process(target=_gloo_peer, args=(store.port, num_bytes, chunk), daemon=True)
    peer.start()
    try:
        group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=60))
        buf = torch.ones(chunk, dtype=torch.uint8)
        group.send([buf], 1, 0).wait()  # warm-up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(num_bytes // chunk):
                group.send([buf], 1, 0).wait()
            times.append(time.perf_counter() - start)
        group.recv([buf[:1]], 1, 1).wait()  # the peer has received everything
        return num_bytes / min(times)
    finally:
        _reap(peer, 30)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _layout(spec: dict, num_blocks: int) -> KVCacheLayout:
    return KVCacheLayout(
        num_layers=spec["num_layers"],
        num_kv_heads=spec["total_kv_heads"],
        head_dim=spec["head_dim"],
        block_size=BLOCK,
        num_blocks=num_blocks,
        dtype=spec["dtype"],
        total_kv_heads=spec["total_kv_heads"],
    )


def _receiver_process(conn, backend: str, spec: dict, tokens: int) -> None:
    """A decode shard in its own process, as deployed (no GIL shared with the sender): serves a
    receiver and registers the tickets the parent sends it."""
    num_blocks = -(-tokens // BLOCK)
    layout = _layout(spec, num_blocks)
    # Allocated as a decode engine allocates its cache (engine.kv_cache_memory).
    dst, _ = allocate_kv_caches(
        layout.layer_shape, spec["num_layers"], _TORCH_DTYPES[spec["dtype"]], torch.device("cpu")
    )
    transport = get_transport(backend)
    receiver = KVReceiver(dst, layout, backend)
    conn.send(transport.serve(receiver))
    while True:
        op, arg = conn.recv()
        if op == "expect":
            receiver.expect(KVTicket.from_dict(arg))
            conn.send(True)
        elif op == "finish":  # the sender saw DONE: confirm on this side, then forget the ticket
            status = receiver.poll(arg)
            stats = receiver.stats(arg)
            receiver.release(arg)
            conn.send((status.state.name, status.reason, stats.first_layer_time if stats else None))
        else:
            transport.shutdown()
            conn.send(True)
            return


class Pair:
    """One sender and one receiver shard over a backend, with caches big enough for ``tokens``.
    The receiver runs in a child process (as a decode replica would), except for "inproc"."""

    def __init__(
        self, backend: str, spec: dict, tokens: int, fragmented: bool = False, integrity: str = "none"
    ) -> None:
        self.num_blocks = -(-tokens // BLOCK)
        self.layout = _layout(spec, self.num_blocks)
        dtype = _TORCH_DTYPES[spec["dtype"]]
        # "shm": the source cache in shared memory, as a prefill engine allocates it for this
        # backend (the receiver pulls); "shm-staged": a private source, copied through staging.
        shared = backend == "shm"
        backend = backend.removesuffix("-staged")
        self.src, self._region = allocate_kv_caches(
            self.layout.layer_shape, spec["num_layers"], dtype, torch.device("cpu"), shared=shared
        )
        for layer in self.src:
            layer.copy_(torch.randn(self.layout.layer_shape))
        # A fresh cache hands out consecutive blocks; a long-running one, scattered ones.
        order = torch.randperm(self.num_blocks).tolist() if fragmented else list(range(self.num_blocks))
        self.src_blocks, self.dst_blocks = order, (order[::-1] if fragmented else order)
        self.transport = get_transport(backend)
        self.receiver: KVReceiver | None = None
        self.child = None
        if backend == "inproc":
            dst, _ = allocate_kv_caches(self.layout.layer_shape, spec["num_layers"], dtype, torch.device("cpu"))
            self.receiver = KVReceiver(dst, self.layout, backend)
            self.endpoint = self.transport.serve(self.receiver)
        else:
            ctx = mp.get_context("spawn")
            self.conn, child_conn = ctx.Pipe()
            self.child = ctx.Process(target=_receiver_process, args=(child_conn, backend, spec, tokens), daemon=True)
            self.child.start()
            if not self.conn.poll(120):
                raise TimeoutError("the receiver process did not start within 120 s")
            self.endpoint = self.conn.recv()
        self.sender = KVSender(self.layout, "bench", self.transport, integrity=integrity)
        self.tokens = tokens
        self.count = 0

    def _call(self, op: str, arg):
        self.conn.send((op, arg))
        if not self.conn.poll(60):
            raise TimeoutError(f"the receiver process did not answer {op!r}")
        return self.conn.recv()

    def run(self, compute_per_layer_s: float = 0.0, solo: bool = False) -> tuple[float, float, float]:
        """One transfer; returns (seconds until the sender saw DONE — every chunk and the final
        message acknowledged —, seconds until layer 0 sat in the receiver's blocks, seconds the
        simulated compute actually took). ``solo``: each layer is handed over only once the one
        before it was acknowledged (one layer per chunk)."""
        self.count += 1
        request_id = f"r{self.count}"
        ticket = make_ticket(
            request_id, self.transport.name, [self.endpoint], self.layout, "bench", self.dst_blocks, self.tokens, 120
        )
        if self.receiver is not None:
            self.receiver.expect(ticket)
        else:
            self._call("expect", ticket.to_dict())
        start = time.perf_counter()
        start_monotonic = time.monotonic()  # CLOCK_MONOTONIC: comparable with the receiver process's
        in_transfer_calls = 0.0  # what the transfer costs the compute thread (enqueueing layers)
        self.sender.start(ticket, self.src_blocks)
        layer0_handed = start_monotonic
        for layer, kv in enumerate(self.src):
            if compute_per_layer_s:
                _busy_wait(compute_per_layer_s)  # the forward pass producing this layer
            if layer == 0:
                layer0_handed = time.monotonic()
            began = time.perf_counter()
            self.sender.send_layer(request_id, layer, kv)
            in_transfer_calls += time.perf_counter() - began
            while solo and self.sender.poll(request_id).layers_sent <= layer:
                time.sleep(0.0001)
        began = time.perf_counter()
        self.sender.finish(request_id, 0)
        finished = time.perf_counter()
        in_transfer_calls += finished - began
        # Compute: the forward pass's own time, everything the compute thread did outside the
        # transfer's calls (the bench loop's bookkeeping included: a real forward pass has its own).
        compute = finished - start - in_transfer_calls if compute_per_layer_s else 0.0
        while True:
            status = self.sender.poll(request_id)
            if status.state.is_terminal:
                break
            time.sleep(0.0001)
        elapsed = time.perf_counter() - start
        assert status.state is TransferState.DONE, status.reason
        if self.receiver is not None:
            received = self.receiver.poll(request_id)
            stats = self.receiver.stats(request_id)
            first_layer_at = stats.first_layer_time if stats else None
            self.receiver.release(request_id)
            assert received.state is TransferState.DONE, received.reason
        else:
            state, reason, first_layer_at = self._call("finish", request_id)
            assert state == "DONE", reason
        self.sender.release(request_id)
        # From the forward pass handing layer 0 over to the receiver having all of it in its blocks.
        first_layer = first_layer_at - layer0_handed if first_layer_at is not None else elapsed
        return elapsed, first_layer, compute

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.src)

    def close(self) -> None:
        self.sender.close()
        if self.child is not None:
            with contextlib.suppress(Exception):
                self._call("stop", None)
            self.child.join(10)
            if self.child.is_alive():
                self.child.kill()
        self.transport.shutdown()
        release_kv_caches(self._region)


_SHORT_BYTES = 64e6


def _median_hidden(runs: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """The run whose transfer outlasted its compute by the median amount (the median "hidden %")."""
    return sorted(runs, key=lambda run: run[0] - run[2])[len(runs) // 2]


def _busy_wait(seconds: float) -> None:
    # Sleep, not spin: a real forward pass releases the GIL inside torch kernels as this does.
    time.sleep(seconds)


def _same_transfer(a: dict, b: dict) -> bool:
    return all(a.get(key) == b.get(key) for key in ("backend", "layout", "tokens"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=[*available_backends(), "shm-staged"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 8192])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fragmented", action="store_true", help="scattered block ids (a long-running cache)")
    parser.add_argument("--integrity", nargs="+", default=["none"], choices=list(INTEGRITY_MODES))
    args = parser.parse_args(argv)

    memcpy = memcpy_bandwidth()
    tcp = tcp_bandwidth()
    # What the libraries themselves reach here, on the same loopback, with nothing of ours around them.
    library = {"grpc": _grpc_stream_bandwidth() if "grpc" in args.backends else None}
    library["torch"] = gloo_bandwidth() if "torch" in args.backends else None
    print(f"ceilings: memcpy {memcpy / 1e9:.1f} GB/s (bytes copied), loopback TCP {tcp / 1e9:.2f} GB/s")
    for name, value in library.items():
        if value is not None:
            print(
                f"  bare {'grpcio stream' if name == 'grpc' else 'gloo send/recv'}: {value / 1e9:.2f} GB/s"
                f" = {value / tcp:.2f} of TCP"
            )
    rows = []
    for backend in args.backends:
        same_host = backend.split("-")[0] in ("shm", "inproc")
        for name in args.layouts:
            for tokens, integrity in itertools.product(args.tokens, args.integrity):
                try:
                    pair = Pair(backend, LAYOUTS[name], tokens, args.fragmented, integrity)
                except Exception as exc:  # a backend that cannot start here is reported, not fatal
                    row = {"backend": backend, "layout": name, "tokens": tokens, "integrity": integrity}
                    rows.append({**row, "note": f"{exc}"[:60]})
                    continue
                try:
                    pair.run()  # warm-up: connections, staging buffers
                    # The machine is shared and noisy: measure the ceiling again next to each row.
                    ceiling = memcpy_bandwidth(repeats=2) if same_host else tcp_bandwidth(512 << 20, repeats=2)
                    # A short transfer lasts milliseconds, at the mercy of a noisy scheduler: more samples.
                    short = pair.num_bytes < _SHORT_BYTES
                    runs = [pair.run() for _ in range(max(args.repeats, 10) if short else args.repeats)]
                    best = min(t for t, _, _ in runs)
                    per_layer = best / LAYOUTS[name]["num_layers"]
                    # Compute per layer exceeds transfer per layer: twice one layer's transfer.
                    overlapped, first_layer, compute_total = _median_hidden(
                        [pair.run(compute_per_layer_s=2 * per_layer) for _ in range(3 if short else 1)]
                    )
                    solo = min(pair.run(solo=True)[0] for _ in range(3 if short else 2)) / LAYOUTS[name]["num_layers"]
                    paced, _, paced_compute = _median_hidden(
                        [pair.run(compute_per_layer_s=2 * solo) for _ in range(3 if short else 1)]
                    )
                    one_shot, note = None, None
                    if short and backend != "inproc":
                        try:
                            one_shot = one_shot_seconds(pair.num_bytes, same_host)
                        except Exception as exc:  # the floor is context: its failure costs the row nothing else
                            note = f"one-shot floor failed: {exc}"[:60]
                    row = {
                        "backend": backend,
                        "layout": name,
                        "tokens": tokens,
                        "integrity": integrity,
                        "MB": pair.num_bytes / 1e6,
                        "ms": best * 1e3,
                        "first layer ms": first_layer * 1e3,
                        "GB/s": pair.num_bytes / best / 1e9,
                        "ceiling GB/s": ceiling / 1e9,
                        "of ceiling": pair.num_bytes / best / ceiling,
                    }
                    if one_shot is not None:
                        row["one-shot ms"] = one_shot * 1e3
                        row["of one-shot"] = one_shot / best
                    if library.get(backend):
                        row["of library"] = pair.num_bytes / best / library[backend]
                    row["hidden %"] = 100 * max(0.0, min(1.0, (compute_total + best - overlapped) / best))
                    row["solo layer ms"] = solo * 1e3
                    row["hidden % solo"] = 100 * max(0.0, min(1.0, (paced_compute + best - paced) / best))
                    row["tail ms"] = (paced - paced_compute) * 1e3  # not hidden: after compute, and handing layers over
                    # The last layer leaves only once computed: however fast the rest, its solo
                    # transfer stays unhidden (a short transfer's layers cost more one by one).
                    row["hidden % bound"] = 100 * max(0.0, 1 - solo / best)
                    unchecked = next((r for r in rows if r.get("integrity") == "none" and _same_transfer(r, row)), None)
                    if unchecked is not None:
                        row["vs none"] = row["ms"] / unchecked["ms"]
                    if note:
                        row["note"] = note
                    rows.append(row)
                finally:
                    pair.close()
    print_table(
        "KV transfer, one sender shard -> one receiver shard",
        rows,
        [
            "backend",
            "layout",
            "tokens",
            "integrity",
            "MB",
            "ms",
            "vs none",
            "first layer ms",
            "GB/s",
            "ceiling GB/s",
            "of ceiling",
            "of library",
            "one-shot ms",
            "of one-shot",
            "hidden %",
            "solo layer ms",
            "hidden % solo",
            "hidden % bound",
            "tail ms",
            "note",
        ],
    )
    payload = {
        "args": vars(args),
        "memcpy_bytes_per_s": memcpy,
        "tcp_bytes_per_s": tcp,
        "grpc_stream_bytes_per_s": library["grpc"],
        "gloo_bytes_per_s": library["torch"],
        "rows": rows,
    }
    write_json("kv_transfer", payload)
    return payload


if __name__ == "__main__":
    main()
