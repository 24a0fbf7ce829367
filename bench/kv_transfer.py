"""KV transfer: GB/s and latency per backend, next to this machine's ceilings measured in the same run.

    python -m bench.kv_transfer [--backends inproc shm grpc torch] [--tokens 128 1024 8192] [--repeats 3]

Layouts: SmolLM2-135M (30 layers, 3 KV heads x 64, float32 as it runs on CPU) and an 8B-class
model (32 layers, 8 KV heads x 128, bfloat16). Ceilings: memcpy (torch copy of 1 GiB; the limit
for shared memory) and a raw loopback TCP stream (the limit for network backends). The overlap
column pushes the layers of the 1k-token SmolLM2 transfer behind a simulated per-layer compute
time longer than one layer's transfer, and reports the share of the transfer hidden by it.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time

import torch

from bench.common import print_table, write_json
from common.kv_layout import KVCacheLayout
from kv_transfer import KVReceiver, KVSender, TransferState, make_ticket
from kv_transfer.transport import available_backends, get_transport

LAYOUTS = {
    "smollm2-135m": dict(num_layers=30, total_kv_heads=3, head_dim=64, dtype="float32"),
    "8b-class": dict(num_layers=32, total_kv_heads=8, head_dim=128, dtype="bfloat16"),
}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BLOCK = 16


def memcpy_bandwidth(num_bytes: int = 1 << 30) -> float:
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    return num_bytes / best  # bytes copied per second (each byte read once and written once)


def tcp_bandwidth(num_bytes: int = 1 << 30, chunk: int = 4 << 20) -> float:
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


class Pair:
    """One sender and one receiver shard over a backend, with caches big enough for ``tokens``."""

    def __init__(self, backend: str, spec: dict, tokens: int) -> None:
        self.num_blocks = -(-tokens // BLOCK)
        self.layout = _layout(spec, self.num_blocks)
        dtype = _TORCH_DTYPES[spec["dtype"]]
        self.src = [torch.randn(self.layout.layer_shape).to(dtype) for _ in range(spec["num_layers"])]
        self.dst = [torch.zeros(self.layout.layer_shape, dtype=dtype) for _ in range(spec["num_layers"])]
        self.transport = get_transport(backend)
        self.receiver = KVReceiver(self.dst, self.layout, backend)
        self.endpoint = self.transport.serve(self.receiver)
        self.sender = KVSender(self.layout, "bench", self.transport, with_checksums=False)
        self.tokens = tokens
        self.count = 0

    def run(self, compute_per_layer_s: float = 0.0) -> tuple[float, float, float]:
        """One transfer; returns (seconds until the receiver is DONE, time to its first complete layer,
        seconds the simulated compute actually took)."""
        self.count += 1
        request_id = f"r{self.count}"
        blocks = list(range(self.num_blocks))
        ticket = make_ticket(
            request_id, self.transport.name, [self.endpoint], self.layout, "bench", blocks, self.tokens, 120
        )
        self.receiver.expect(ticket)
        start = time.perf_counter()
        compute = 0.0
        self.sender.start(ticket, blocks)
        for layer, kv in enumerate(self.src):
            if compute_per_layer_s:
                began = time.perf_counter()
                _busy_wait(compute_per_layer_s)  # the forward pass producing this layer
                compute += time.perf_counter() - began
            self.sender.send_layer(request_id, layer, kv)
        self.sender.finish(request_id, 0)
        first_layer = None
        while True:
            status = self.receiver.poll(request_id)
            if first_layer is None and status.layers_complete >= 1:
                first_layer = time.perf_counter() - start
            if status.state.is_terminal:
                break
            time.sleep(0.0002)
        elapsed = time.perf_counter() - start
        assert status.state is TransferState.DONE, status.reason
        self.receiver.release(request_id)
        self.sender.release(request_id)
        return elapsed, first_layer or elapsed, compute

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.src)

    def close(self) -> None:
        self.sender.close()
        self.transport.shutdown()


def _busy_wait(seconds: float) -> None:
    # Sleep, not spin: a real forward pass releases the GIL inside torch kernels as this does.
    time.sleep(seconds)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=available_backends())
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 8192])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    memcpy = memcpy_bandwidth()
    tcp = tcp_bandwidth()
    print(f"ceilings: memcpy {memcpy / 1e9:.1f} GB/s (bytes copied), loopback TCP {tcp / 1e9:.2f} GB/s")
    rows = []
    for backend in args.backends:
        ceiling = memcpy if backend in ("shm", "inproc") else tcp
        for name in args.layouts:
            for tokens in args.tokens:
                try:
                    pair = Pair(backend, LAYOUTS[name], tokens)
                except Exception as exc:  # a backend that cannot start here is reported, not fatal
                    rows.append({"backend": backend, "layout": name, "tokens": tokens, "note": f"{exc}"[:60]})
                    continue
                try:
                    pair.run()  # warm-up: connections, staging buffers
                    runs = [pair.run() for _ in range(args.repeats)]
                    best = min(t for t, _, _ in runs)
                    row = {
                        "backend": backend,
                        "layout": name,
                        "tokens": tokens,
                        "MB": pair.num_bytes / 1e6,
                        "ms": best * 1e3,
                        "first layer ms": min(f for _, f, _ in runs) * 1e3,
                        "GB/s": pair.num_bytes / best / 1e9,
                        "of ceiling": pair.num_bytes / best / ceiling,
                    }
                    if name == "smollm2-135m" and tokens == 1024:
                        per_layer = best / LAYOUTS[name]["num_layers"]
                        compute = 2 * per_layer  # compute per layer exceeds transfer per layer
                        overlapped, _, compute_total = pair.run(compute_per_layer_s=compute)
                        row["hidden %"] = 100 * max(0.0, min(1.0, (compute_total + best - overlapped) / best))
                    rows.append(row)
                finally:
                    pair.close()
    print_table(
        "KV transfer, one sender shard -> one receiver shard",
        rows,
        ["backend", "layout", "tokens", "MB", "ms", "first layer ms", "GB/s", "of ceiling", "hidden %", "note"],
    )
    payload = {"args": vars(args), "memcpy_bytes_per_s": memcpy, "tcp_bytes_per_s": tcp, "rows": rows}
    write_json("kv_transfer", payload)
    return payload


if __name__ == "__main__":
    main()
