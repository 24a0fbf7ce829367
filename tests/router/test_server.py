"""router.server's responses and metrics from a request's deltas: the TTFT breakdown of the last delta
reaches the usage (JSON and the streamed usage chunk) and the metrics once.

The constructor loads a tokenizer and starts an HTTP server; these tests need neither, so they build
a bare RouterServer with only what ``_tracked`` and its ResponseWriter read. The orchestrator
that makes the deltas is tested in test_orchestrator.py, the wire format in test_protocol.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from common.serving import StreamDelta, TTFTBreakdown
from router import openai_bodies as bodies
from router import protocol
from router.admin import AdminRoutes, Resizer
from router.auth import KeyRing
from router.context_length import ContextLength
from router.health import HealthCheck
from router.intake import Intake, TokenizedPrompt
from router.metrics import RouterMetrics
from router.responses import ResponseWriter
from router.server import RouterServer
from tests.router.test_metrics import MODEL, scrape

BREAKDOWN = TTFTBreakdown(0.0123456789, 0.25, None, 0.004)
PROMPT = [1, 2, 3]


class BareServer(RouterServer):
    def __init__(self) -> None:
        self.metrics = RouterMetrics("colocated", "smol")
        self.served_model = "smol"
        self.num_in_flight = 1  # _handle counts the request in before _tracked counts it out
        self.serving_replica: dict[str, tuple[str, str]] = {}
        self.responses = ResponseWriter("smol", lambda token_ids: "")

    def __del__(self) -> None:  # Serve's shutdown hook stops the HTTP server, which never started here
        pass


async def deltas() -> AsyncIterator[StreamDelta]:
    yield StreamDelta("r", [7], "a", replica_id="d0")
    yield StreamDelta("r", [8], "b", finish_reason="length", replica_id="d0", ttft_breakdown=BREAKDOWN)


def expected_usage() -> dict:
    return bodies.usage(len(PROMPT), 2, 0, BREAKDOWN)


def taken(parsed: protocol.ParsedRequest) -> Intake:
    return Intake(parsed, [TokenizedPrompt(PROMPT, "hi", parsed.sampling)])


def test_a_json_response_s_usage_carries_the_last_delta_s_breakdown_and_the_metric_counts_it_once():
    server = BareServer()
    parsed = protocol.parse_completion_request({"model": "smol", "prompt": "hi", "max_tokens": 2}, "smol")

    async def respond():
        tracked = server._tracked(deltas(), time.monotonic(), "internal-r", "r", len(PROMPT))
        first = await tracked.__anext__()
        return await server.responses.collect(taken(parsed), "cmpl-r", first, tracked, {})

    body = json.loads(asyncio.run(respond()).body)
    assert body["usage"] == expected_usage()
    assert body["usage"]["ttft_breakdown"]["queue_s"] == 0.012346
    samples = scrape(server.metrics)
    assert samples[("pdserve:time_to_first_token_other_seconds_count", MODEL)] == 1
    assert samples[("pdserve:time_to_first_token_other_seconds_sum", MODEL)] == 0.004


def test_two_requests_sent_with_one_request_id_are_tracked_apart():
    """A client's X-Request-Id is its own: two requests carrying the same one each keep their
    entry (status lists both, each leaves with its own end)."""
    server = BareServer()
    server.num_in_flight = 2

    async def run() -> None:
        first = server._tracked(deltas(), time.monotonic(), "internal-a", "same", len(PROMPT))
        second = server._tracked(deltas(), time.monotonic(), "internal-b", "same", len(PROMPT))
        await first.__anext__()
        await second.__anext__()
        assert server.serving_replica == {"internal-a": ("same", "d0"), "internal-b": ("same", "d0")}
        assert [d async for d in first]
        assert list(server.serving_replica) == ["internal-b"]
        assert [d async for d in second]
        assert server.serving_replica == {}

    asyncio.run(run())


def test_the_streamed_usage_chunk_carries_it_when_usage_is_asked_for():
    server = BareServer()
    request = {"model": "smol", "prompt": "hi", "max_tokens": 2, "stream": True}
    asked = protocol.parse_completion_request({**request, "stream_options": {"include_usage": True}}, "smol")
    not_asked = protocol.parse_completion_request(request, "smol")

    async def events(parsed) -> list[dict]:
        stream = deltas()
        first = await stream.__anext__()
        chunks = [c async for c in server.responses.sse(taken(parsed), "cmpl-r", first, stream)]
        return [json.loads(c[6:]) for c in chunks if c != bodies.SSE_DONE]

    *_, tail = asyncio.run(events(asked))
    assert tail["choices"] == [] and tail["usage"] == expected_usage()
    assert all("usage" not in event for event in asyncio.run(events(not_asked)))


class CountingPool:
    """A pool handle whose ``report`` answers after a moment, counting the calls; the first ``fail`` raise."""

    def __init__(self, max_model_len: int, fail: int = 0) -> None:
        self.max_model_len = max_model_len
        self.calls = 0
        self.fail = fail
        self.report = self

    def remote(self):
        self.calls += 1
        failing = self.calls <= self.fail

        async def answer() -> dict:
            await asyncio.sleep(0.01)
            if failing:
                raise TimeoutError("the pool did not answer")
            return {"max_model_len": self.max_model_len}

        return answer()


def test_a_burst_on_a_fresh_router_asks_the_pools_their_context_length_once(monkeypatch):
    from router import routing_state

    monkeypatch.setattr(routing_state, "_LATEST", {})
    context = ContextLength(CountingPool(8192), CountingPool(4096, fail=1))

    async def burst() -> list:
        return await asyncio.gather(*(context.get() for _ in range(50)), return_exceptions=True)

    first = asyncio.run(burst())  # the one ask fails: every waiter gets its error, none hangs
    assert all(isinstance(r, TimeoutError) for r in first) and context.prefill.calls == 1
    assert asyncio.run(burst()) == [4096] * 50  # asked again, once, and kept
    assert (context.decode.calls, context.prefill.calls) == (2, 2)


def test_a_prefill_pool_being_replaced_is_not_asked_and_its_answer_is_not_kept(monkeypatch):
    from router import routing_state

    monkeypatch.setattr(routing_state, "_LATEST", {"prefill": (0.0, {})})  # no replica left
    context = ContextLength(CountingPool(8192), CountingPool(4096))
    assert asyncio.run(context.get()) == 8192 and context.prefill.calls == 0
    routing_state.record("prefill", {"p1": {"engine_error": ""}})  # the replacement is up
    assert asyncio.run(context.get()) == 4096 and context.value == 4096


def test_a_full_pool_queue_met_before_any_pool_work_is_a_503():
    from ray.serve.exceptions import BackPressureError

    from router.http_edge import refusal

    error = refusal(BackPressureError(num_queued_requests=4, max_queued_requests=4))
    assert (error.status, error.type, error.headers) == (503, "service_unavailable", {"Retry-After": "1"})


def test_health_is_degraded_without_a_working_prefill_replica_and_down_without_a_decode_one(monkeypatch):
    from router import routing_state

    server = BareServer()
    server.mode, server.decode, server.prefill = "disagg", CountingPool(8192), CountingPool(8192)
    check = HealthCheck.for_pools(server.decode, server.prefill, 10.0)
    admin = AdminRoutes(KeyRing(), "smol", "disagg", server.metrics, check, Resizer(None, KeyRing(), ""), dict, 30.0)
    monkeypatch.setattr(routing_state, "_LATEST", {})

    def health() -> tuple[int, dict]:
        response = asyncio.run(admin.health())
        return response.status_code, json.loads(response.body)

    assert health() == (200, {"status": "ok", "mode": "disagg"})  # no report yet: each pool asked once
    assert (server.decode.calls, server.prefill.calls) == (1, 1)
    routing_state.record("decode", {"d0": {"engine_error": ""}})
    routing_state.record("prefill", {"p0": {"engine_error": "RuntimeError: a shard died"}})
    assert health() == (
        200,
        {"status": "degraded", "mode": "disagg", "pools_degraded": ["prefill: no working replica"]},
    )
    routing_state.record("decode", {})  # the only decode replica gone
    code, body = health()
    assert code == 503 and body["pools_down"] == ["decode: no working replica"]
    assert (server.decode.calls, server.prefill.calls) == (1, 1)  # fresh reports: no pool was asked
