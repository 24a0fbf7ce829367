"""The router's added latency per request, measured against null pools ("null engine" mode).

What: the time the router (``router.server.RouterServer``: parse, tokenize, admission, placement,
the orchestrator and its pool handle calls, SSE encoding) adds to a streamed request, as p50/p90/p99
of TTFT and E2E at a fixed open-loop rate (target: ≤ 1 ms p99 at 50 req/s).

How: a local Ray + Serve runs two applications side by side, each replica serving HTTP on a port
of its own (router.http_listener, as a cluster's router does; Serve's proxy is off):

    router  :port/v1/completions    ─▶ RouterServer (the real class, real tokenizer) ─▶ NullDecode, NullPrefill
    bypass  :port+1/v1/completions  ─▶ Bypass (FastAPI in a replica that writes the same SSE chunks itself)

``NullDecode.generate`` issues a ticket (disagg), waits for the "KV" to land, then yields
``max_tokens`` one-token deltas, at once or ``--token-interval-ms`` apart. ``NullPrefill.prefill``
"pushes the KV" (one UDP datagram to the decode replica, standing in for the real hand-off's
completion) and returns, so the router → prefill call stays on the TTFT path as in the real system,
at near-zero cost. In colocated mode there is one null pool, no ticket. The null pools use the
router's real request router (``router.serve_routing:PolicyRequestRouter``, least_loaded) with the
options cluster.app gives the real pools, and report through ``ReplicaReport`` like them. The load
is bench.load_client's open loop (the same seeded arrivals for both paths, after a warm-up), timed
as the client sees it.

    python -m bench.router_overhead [--rate 50] [--num-requests 500] [--max-tokens 8] [--warmup 20]
        [--mode disagg|colocated] [--arrival poisson|constant] [--token-interval-ms 0] [--port 0]
    pdserve bench router [same arguments]

Reading the result: the "bypass" row is an HTTP server in a replica (uvicorn and FastAPI); the
"router" row adds the router's own work and its two pool calls (one streaming). "router added" is
router minus bypass per percentile: a difference of percentiles, not the percentile of
per-request differences, so it approximates the added latency (exact for a constant shift). TTFT
is the cleanest comparison: with tokens all at once, the bypass writes its chunks back to back
(its ITL ≈ 0, E2E ≈ TTFT) while the router's come one delta at a time; ``--token-interval-ms``
(say 10, a decode step) paces both alike. ``--port`` is the router's; the bypass takes the next
one (0: free ones). Client, Serve and every replica share this host's cores, so contention is in
both rows, and CPU saturation shows as queueing.
Writes bench/results/router_overhead.json (summaries and every request's timings).
"""

# No `from __future__ import annotations`: FastAPI reads Bypass's annotations at run time, and a
# class pickled by value (run as __main__) brings no module globals to resolve strings against.
import argparse
import asyncio
import json
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import ray
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig

from bench.common import print_table, write_json
from bench.load_client import LoadResult, run_load
from bench.server_process import free_port
from bench.workloads import WorkloadRequest, arrival_times
from common.env import SERVE_PROCESS_ENV
from common.sampling_params import SamplingParams
from common.serving import PrefillResult, ReplicaReport, ServeRequest, StreamDelta, TicketIssued
from engine.model_loader import DEFAULT_MODEL_NAME, resolve_model_dir
from router import openai_bodies as bodies
from router.http_listener import HttpListener
from router.server import RouterServer

MODEL = DEFAULT_MODEL_NAME
PROMPT = "The capital of France is"
_TOKEN_ID, _TOKEN_TEXT = 1000, " x"  # any id of the vocabulary: the router forwards the text as is
_KV_WAIT_S = 30.0
PATHS = ("bypass", "router")
STATS = ("p50", "p90", "p99")


# ---------------------------------------------------------------- null pools
class _NullPool:
    """What the router (report) and Serve (record_routing_stats, check_health) ask a pool replica."""

    role = "decode"

    def __init__(self) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.num_running = 0
        self.report_seq = 0

    async def report(self) -> dict:
        # A fresh sequence number each time, as a live replica's: the router takes a replica whose
        # reports stop changing for a hung one (router.report_ages) and refuses its pool's requests.
        self.report_seq += 1
        return ReplicaReport(
            self.replica_id,
            self.role,
            num_running=self.num_running,
            num_kv_blocks_free=4096,
            num_kv_blocks_total=4096,
            max_model_len=2048,
            pid=os.getpid(),
            report_seq=self.report_seq,
        ).to_dict()

    async def record_routing_stats(self) -> dict:
        return await self.report()

    async def num_blocks_held(self) -> int:
        return 0

    def check_health(self) -> None:
        pass


class _KvLanded(asyncio.DatagramProtocol):
    """The decode side of the stand-in hand-off: a datagram naming a request means its KV landed."""

    def __init__(self, landed: dict[str, asyncio.Event]) -> None:
        self.landed = landed

    def datagram_received(self, data: bytes, addr: Any) -> None:
        event = self.landed.get(data.decode())
        if event is not None:
            event.set()


class NullDecode(_NullPool):
    def __init__(self, colocated: bool, token_interval_s: float = 0.0) -> None:
        super().__init__()
        self.colocated = colocated
        self.token_interval_s = token_interval_s
        self.role = "colocated" if colocated else "decode"
        self.landed: dict[str, asyncio.Event] = {}
        self._endpoint: asyncio.Future | None = None  # opened on the loop that runs generate

    async def _kv_port(self) -> int:
        if self._endpoint is None:  # no await before this assignment: concurrent first calls share it
            loop = asyncio.get_running_loop()
            opening = loop.create_datagram_endpoint(lambda: _KvLanded(self.landed), local_addr=("127.0.0.1", 0))
            self._endpoint = asyncio.ensure_future(opening)
        transport, _ = await self._endpoint
        return transport.get_extra_info("sockname")[1]

    async def generate(self, request: ServeRequest) -> AsyncIterator[TicketIssued | StreamDelta]:
        rid, max_tokens = request.request_id, SamplingParams.from_dict(request.sampling).max_tokens
        if not self.colocated:
            landed = self.landed[rid] = asyncio.Event()
            try:
                yield TicketIssued(rid, {"request_id": rid, "kv_port": await self._kv_port()}, self.replica_id)
                await asyncio.wait_for(landed.wait(), _KV_WAIT_S)
            finally:
                del self.landed[rid]
        self.num_running += 1
        try:
            for i in range(max_tokens):
                if i and self.token_interval_s:
                    await asyncio.sleep(self.token_interval_s)
                finish = "length" if i == max_tokens - 1 else None
                yield StreamDelta(rid, [_TOKEN_ID], _TOKEN_TEXT, finish_reason=finish, replica_id=self.replica_id)
        finally:
            self.num_running -= 1


class NullPrefill(_NullPool):
    role = "prefill"

    def __init__(self) -> None:
        super().__init__()
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    async def prefill(self, request: ServeRequest) -> PrefillResult:
        assert request.kv_ticket is not None, f"{request.request_id}: prefill without a ticket"
        self.socket.sendto(request.request_id.encode(), ("127.0.0.1", request.kv_ticket["kv_port"]))
        return PrefillResult(request.request_id, _TOKEN_ID, 0, replica_id=self.replica_id)


# ---------------------------------------------------------------- the bypass: an HTTP server in a replica
async def _sse_chunks(model: str, max_tokens: int, token_interval_s: float) -> AsyncIterator[bytes]:
    response_id, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
    for i in range(max_tokens):
        if i and token_interval_s:
            await asyncio.sleep(token_interval_s)
        finish = "length" if i == max_tokens - 1 else None
        yield bodies.sse(bodies.completion_chunk(response_id, model, created, _TOKEN_TEXT, finish))
    yield bodies.sse(bodies.usage_chunk(response_id, model, created, bodies.usage(5, max_tokens)))
    yield bodies.SSE_DONE


class Bypass:
    def __init__(self, port: int, token_interval_s: float = 0.0) -> None:
        self.token_interval_s = token_interval_s
        api = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        api.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.listener = HttpListener(api, "127.0.0.1", port)
        self.listener.start()

    async def __del__(self) -> None:
        await self.listener.stop()

    async def completions(self, request: Request) -> StreamingResponse:
        body = json.loads(await request.body())
        chunks = _sse_chunks(body["model"], int(body["max_tokens"]), self.token_interval_s)
        return StreamingResponse(chunks, media_type="text/event-stream")


# ---------------------------------------------------------------- deployment
def _pool_options(name: str) -> dict:
    # cluster.app._pool_deployment's Serve options (bench may not import cluster: it is the layer above).
    router_config = RequestRouterConfig(
        request_router_class="router.serve_routing:PolicyRequestRouter",
        request_router_kwargs={"policy": "least_loaded", "role": name, "block_size": 16},
        request_routing_stats_period_s=1.0,
        request_routing_stats_timeout_s=5.0,
    )
    return {
        "name": name,
        "num_replicas": 1,
        "max_ongoing_requests": 256,
        "max_queued_requests": 256,
        "ray_actor_options": {"num_cpus": 0},
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        "request_router_config": router_config,
    }


# As cluster.app gives the router, and the bypass alike (their HTTP requests are not Serve's: this
# bounds only calls through their handles).
_INGRESS_OPTIONS = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}, "max_ongoing_requests": 2048}


def router_app(port: int, mode: str, token_interval_s: float = 0.0) -> Any:
    """RouterServer bound as cluster.app.build_app binds it, to null pools."""
    colocated = mode == "colocated"
    decode = serve.deployment(NullDecode).options(**_pool_options("colocated" if colocated else "decode"))
    prefill = None if colocated else serve.deployment(NullPrefill).options(**_pool_options("prefill")).bind()
    router_args = (MODEL, str(resolve_model_dir(None)), mode, 600.0, 1, 1024, "127.0.0.1", port)
    router = serve.deployment(RouterServer).options(**_INGRESS_OPTIONS, name="router")
    return router.bind(decode.bind(colocated, token_interval_s), prefill, *router_args)


def start(port: int, bypass_port: int, mode: str, token_interval_s: float = 0.0) -> None:
    """Ray (owned by this process, as cluster.app.start_ray starts it) and Serve with both apps."""
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process; the benchmark starts (and stops) its own")
    for name, value in SERVE_PROCESS_ENV.items():  # as a local cluster's
        os.environ.setdefault(name, value)
    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, namespace="pdserve-bench", log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        serve.run(router_app(port, mode, token_interval_s), name="router", route_prefix=None)
        bypass = serve.deployment(Bypass).options(**_INGRESS_OPTIONS, name="bypass")
        serve.run(bypass.bind(bypass_port, token_interval_s), name="bypass", route_prefix=None)
    except BaseException:
        shutdown()  # a failed start leaves no Ray behind for the next user of this process
        raise


def shutdown() -> None:
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


# ---------------------------------------------------------------- load and report
def workload(num_requests: int, rate: float, max_tokens: int, arrival: str, seed: int) -> list[WorkloadRequest]:
    arrivals = arrival_times(arrival, rate, num_requests, np.random.default_rng(seed))
    return [WorkloadRequest(float(t), PROMPT, 5, max_tokens) for t in arrivals]


async def measure(base_url: str, args: argparse.Namespace) -> LoadResult:
    """Warm up (first tokenizer call, the router's max_model_len lookup, connections), then measure."""
    shape = (args.rate, args.max_tokens, args.arrival)
    if args.warmup:
        await run_load(base_url, MODEL, workload(args.warmup, *shape, args.seed + 1), timeout_s=60.0, progress=False)
    return await run_load(
        base_url, MODEL, workload(args.num_requests, *shape, args.seed), timeout_s=60.0, progress=False
    )


def _row(path: str, summary: dict) -> dict:
    row: dict[str, Any] = {"path": path}
    for metric in ("ttft", "e2e"):
        for stat in STATS:
            value = summary.get(f"{stat}_{metric}_s")
            row[f"{metric} {stat}"] = None if value is None else value * 1000
    itl = summary.get("mean_itl_s")
    row["itl mean"] = None if itl is None else itl * 1000
    row["req/s"], row["errors"] = summary.get("request_throughput"), summary.get("failed")
    return row


def added(router: dict, bypass: dict) -> dict[str, float | None]:
    """Router minus bypass, per percentile, in ms (an approximation: see the module docstring)."""
    keys = [f"{m} {s}" for m in ("ttft", "e2e") for s in STATS] + ["itl mean"]
    return {k: None if router[k] is None or bypass[k] is None else router[k] - bypass[k] for k in keys}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=50.0, help="requests/s, open loop")
    parser.add_argument("--num-requests", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens (text chunks) per response")
    parser.add_argument("--warmup", type=int, default=20, help="requests per path before measuring")
    parser.add_argument("--arrival", choices=("poisson", "constant"), default="poisson")
    parser.add_argument("--mode", choices=("disagg", "colocated"), default="disagg")
    parser.add_argument(
        "--token-interval-ms", type=float, default=0.0, help="gap between a response's tokens (0: all at once)"
    )
    parser.add_argument("--port", type=int, default=0, help="Serve's HTTP port (0: a free one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.max_tokens < 1 or args.warmup < 0:
        parser.error("--num-requests and --max-tokens must be >= 1, --warmup >= 0")
    if args.port and not 0 < args.port < 65535:
        parser.error("--port must be in 1..65534 (the bypass takes the next one)")
    port = args.port or free_port()
    bypass_port = args.port + 1 if args.port else free_port()
    while bypass_port == port:  # both bind with SO_REUSEPORT: one port would mix their requests
        bypass_port = free_port()
    start(port, bypass_port, args.mode, args.token_interval_ms / 1000)
    try:
        urls = {"bypass": f"http://127.0.0.1:{bypass_port}/v1", "router": f"http://127.0.0.1:{port}/v1"}
        results = {path: asyncio.run(measure(urls[path], args)) for path in PATHS}
    finally:
        shutdown()
    rows = {path: _row(path, results[path].summary()) for path in PATHS}
    router_added = added(rows["router"], rows["bypass"])
    columns = ["path", *(f"{m} {s}" for m in ("ttft", "e2e") for s in STATS), "itl mean", "req/s", "errors"]
    title = f"router overhead, ms ({args.mode}, {args.rate:g} req/s offered, {args.max_tokens} tokens/request)"
    print_table(title, [*rows.values(), {"path": "router added (≈)", **router_added}], columns)
    payload = {
        "config": vars(args) | {"port": port, "bypass_port": bypass_port},
        "router_added_ms": router_added,
        "paths": {path: results[path].to_json() for path in PATHS},
    }
    write_json("router_overhead", payload)
    return payload


if __name__ == "__main__":
    main()
