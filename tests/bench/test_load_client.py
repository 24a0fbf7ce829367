"""The open-loop load client (bench.load_client) against a scripted in-process OpenAI streaming server.

The fake server answers each request by a script chosen by its prompt: text after TTFT seconds, then
more text every GAP seconds, a usage chunk (with pdserve's TTFT breakdown for the prompts in
BREAKDOWNS) and [DONE], as uvicorn does (chunked transfer encoding), or close-delimited, or an HTTP
error. It logs when it actually wrote each chunk: the client's timings must match those closely,
and the script loosely, since this machine's other tenants can delay a timer by tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from bench.load_client import LoadResult, RequestRecord, print_summary, run_load, ttft_breakdown_summary
from bench.slo import SLO
from bench.workloads import WorkloadRequest

TTFT, GAP, NUM_TOKENS = 0.2, 0.05, 5
TOLERANCE = 0.03  # client-measured vs server-logged times
SCRIPT_TOLERANCE = 0.1  # client-measured vs scripted times
# usage.ttft_breakdown by prompt, as pdserve sends it: "slow" (TTFT 0.5 s) queued, "fast" (0.2 s) computed.
BREAKDOWNS = {
    "slow": {"queue_s": 0.4, "prefill_s": 0.05, "kv_transfer_exposed_s": 0.01, "other_s": 0.02},
    "fast": {"queue_s": 0.01, "prefill_s": 0.15, "kv_transfer_exposed_s": None, "other_s": 0.03},
}


@dataclass
class Stream:
    """What the server did for one request, in perf_counter seconds."""

    received: float
    path: str
    body: dict
    text_times: list[float] = field(default_factory=list)
    done: float = 0.0


class FakeServer:
    """An OpenAI-compatible streaming server on 127.0.0.1; ``received`` logs a Stream per request."""

    def __init__(self) -> None:
        self.received: list[Stream] = []
        self.active = self.max_active = 0

    async def __aenter__(self) -> FakeServer:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.base_url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            _, path, _ = (await reader.readline()).decode().split(" ", 2)
            headers = {}
            while (line := await reader.readline()) != b"\r\n":
                name, _, value = line.decode().partition(":")
                headers[name.lower()] = value.strip()
            body = json.loads(await reader.readexactly(int(headers["content-length"])))
            stream = Stream(time.perf_counter(), path, body)
            self.received.append(stream)
            await self.respond(writer, stream)
        finally:
            self.active -= 1
            writer.close()

    async def respond(self, writer: asyncio.StreamWriter, stream: Stream) -> None:
        body = stream.body
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if prompt == "fail":
            error = json.dumps({"error": {"message": "overloaded", "code": 503}}).encode()
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n")
            writer.write(f"Content-Length: {len(error)}\r\n\r\n".encode() + error)
            return
        chunked = prompt != "close"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n" if chunked else b"Connection: close\r\n\r\n")

        async def send(event: dict | str, split: bool = False) -> None:
            data = f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
            # "split" cuts an event across two HTTP chunks: the client must reassemble SSE lines.
            for part in [data[:9], data[9:]] if split else [data]:
                writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n" if chunked else part)
                await writer.drain()

        if prompt == "error-event":
            await send({"error": {"message": "decode pool lost"}})
        else:
            ttft = 0.5 if prompt == "slow" else 10.0 if prompt == "hang" else TTFT
            await asyncio.sleep(ttft)
            for i in range(NUM_TOKENS):
                if i:
                    await asyncio.sleep(GAP)
                choice = {"index": 0, "delta": {"content": f"t{i}"}} if chat else {"index": 0, "text": f"t{i}"}
                await send({"choices": [choice]}, split=prompt == "split")
                stream.text_times.append(time.perf_counter())
            if prompt != "no-usage":
                usage = {"prompt_tokens": 7, "completion_tokens": NUM_TOKENS}
                if prompt in BREAKDOWNS:
                    usage["ttft_breakdown"] = BREAKDOWNS[prompt]
                await send({"choices": [], "usage": usage})
        await send("[DONE]")
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        stream.done = time.perf_counter()


def request(prompt: str = "hello", arrival_s: float = 0.0) -> WorkloadRequest:
    return WorkloadRequest(arrival_s=arrival_s, prompt=prompt, num_prompt_tokens=7, num_output_tokens=NUM_TOKENS)


def load(workload: list[WorkloadRequest], **kwargs) -> tuple[LoadResult, FakeServer]:
    async def main() -> tuple[LoadResult, FakeServer]:
        async with FakeServer() as server:
            result = await run_load(server.base_url, "fake-model", workload, progress=False, **kwargs)
            return result, server

    return asyncio.run(main())


def assert_timings(record, stream: Stream, ttft: float = TTFT) -> None:
    assert record.error is None
    assert record.num_output_tokens == NUM_TOKENS
    assert len(record.itl_s) == NUM_TOKENS - 1
    # What the server actually did.
    assert record.ttft_s == pytest.approx(stream.text_times[0] - stream.received, abs=TOLERANCE)
    assert list(record.itl_s) == pytest.approx(np.diff(stream.text_times), abs=TOLERANCE)
    assert record.e2e_s == pytest.approx(stream.done - stream.received, abs=TOLERANCE)
    assert record.tpot_s == pytest.approx((record.e2e_s - record.ttft_s) / (NUM_TOKENS - 1))
    # What the script asked for.
    assert record.ttft_s == pytest.approx(ttft, abs=SCRIPT_TOLERANCE)
    assert record.tpot_s == pytest.approx(GAP, abs=SCRIPT_TOLERANCE / 2)


@pytest.mark.parametrize("prompt", ["hello", "close", "split"])
def test_completions_timings_match_the_script(prompt):
    result, server = load([request(prompt)])
    (record,) = result.records
    (stream,) = server.received
    assert_timings(record, stream)
    assert record.usage_prompt_tokens == 7
    assert stream.path == "/v1/completions"
    assert stream.body == {
        "model": "fake-model",
        "prompt": prompt,
        "max_tokens": NUM_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def test_chat_endpoint():
    result, server = load([request()], endpoint="chat", ignore_eos=False)
    (stream,) = server.received
    assert_timings(result.records[0], stream)
    assert stream.path == "/v1/chat/completions"
    assert stream.body["messages"] == [{"role": "user", "content": "hello"}]
    assert stream.body["ignore_eos"] is False


def test_output_tokens_fall_back_to_text_chunks():
    result, _ = load([request("no-usage")])
    assert result.records[0].num_output_tokens == NUM_TOKENS
    assert result.records[0].usage_prompt_tokens is None


def test_open_loop_follows_the_arrival_schedule():
    arrivals = [0.0, 0.1, 0.2, 0.3]
    result, server = load([request("slow", a) for a in arrivals])
    # Each request goes out on time although every earlier one is still waiting for its first token.
    sends = [r.send_s for r in result.records]
    assert sends == pytest.approx(arrivals, abs=SCRIPT_TOLERANCE / 2)
    received = [s.received - server.received[0].received for s in server.received]
    assert received == pytest.approx([s - sends[0] for s in sends], abs=TOLERANCE)
    assert server.max_active == 4
    assert 0.3 + 0.5 + 4 * GAP <= result.duration_s < 2.0
    for record, stream in zip(result.records, server.received, strict=True):
        assert_timings(record, stream, ttft=0.5)


def test_max_in_flight_holds_requests_back():
    result, server = load([request("hello", 0.0) for _ in range(3)], max_in_flight=1)
    assert server.max_active == 1
    first, second, third = result.records
    assert second.send_s >= first.send_s + first.e2e_s  # each waited for the one before to finish
    assert third.send_s >= second.send_s + second.e2e_s
    assert result.summary()["max_send_lag_s"] == third.send_s


def test_failures_are_recorded():
    workload = [request("fail"), request("error-event"), request("hang"), request()]
    result, _ = load(workload, timeout_s=0.5)
    http, event, hang, ok = result.records
    assert http.error.startswith("HTTP 503") and "overloaded" in http.error
    assert "decode pool lost" in event.error
    assert "timed out" in hang.error
    assert ok.error is None
    assert all(r.e2e_s is None and not r.timing().succeeded for r in (http, event, hang))
    summary = result.summary(SLO(ttft_s=1.0, tpot_s=0.1))
    assert (summary["completed"], summary["failed"]) == (1, 3)
    assert summary["slo_attainment"] == pytest.approx(0.25)


def test_connection_refused_is_a_failure():
    async def main() -> LoadResult:
        async with FakeServer() as server:
            url = server.base_url
        return await run_load(url, "m", [request()], progress=False)  # the server is gone

    (record,) = asyncio.run(main()).records
    assert record.error is not None and "Connect" in record.error


def test_summary_and_json_roundtrip(capsys):
    result, _ = load([request("hello", 0.0), request("hello", 0.05)])
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    summary = result.summary(slo)
    assert summary["completed"] == 2 and summary["failed"] == 0
    assert summary["p50_ttft_s"] == pytest.approx(TTFT, abs=SCRIPT_TOLERANCE)
    assert summary["mean_itl_s"] == pytest.approx(GAP, abs=SCRIPT_TOLERANCE / 2)
    assert summary["slo_attainment"] == summary["ttft_attainment"] == summary["tpot_attainment"] == 1.0
    assert summary["output_throughput"] == pytest.approx(2 * NUM_TOKENS / result.duration_s)
    assert result.summary(SLO(ttft_s=0.1, tpot_s=0.1))["slo_attainment"] == 0.0

    data = json.loads(json.dumps(result.to_json(slo)))
    assert len(data["requests"]) == 2 and data["requests"][0]["tpot_s"] == pytest.approx(result.records[0].tpot_s)
    again = LoadResult.from_json(data)
    assert again == result
    print_summary(again, slo)
    out = capsys.readouterr().out
    assert "TTFT (ms)" in out
    assert "TTFT breakdown" not in out  # this server sends none
    assert summary["ttft_breakdown_requests"] == 0 and summary["mean_ttft_queue_s"] is None


def test_the_servers_ttft_breakdown_says_which_part_made_the_slo_misses(capsys):
    result, _ = load([request("fast", 0.0), request("slow", 0.0), request("slow", 0.05)])
    fast, slow, _ = result.records
    assert fast.ttft_parts() == {"queue": 0.01, "prefill": 0.15, "kv_transfer_exposed": None, "other": 0.03}
    assert slow.ttft_queue_s == 0.4 and slow.ttft_kv_transfer_exposed_s == 0.01
    slo = SLO(ttft_s=0.35, tpot_s=1.0)  # the two slow ones miss it
    summary = result.summary(slo)
    assert (summary["ttft_breakdown_over"], summary["ttft_breakdown_requests"]) == ("ttft_slo_misses", 2)
    assert summary["ttft_miss_by"] == {"queue": 2, "prefill": 0, "kv_transfer_exposed": 0, "other": 0}
    assert summary["mean_ttft_queue_s"] == pytest.approx(0.4)
    assert summary["mean_ttft_kv_transfer_exposed_s"] == pytest.approx(0.01)
    assert summary["ttft_attainment"] == pytest.approx(1 / 3)  # the old fields stay
    without_slo = result.summary()
    assert (without_slo["ttft_breakdown_over"], without_slo["ttft_breakdown_requests"]) == ("completed", 3)
    assert without_slo["ttft_miss_by"] == {"queue": 2, "prefill": 1, "kv_transfer_exposed": 0, "other": 0}
    again = LoadResult.from_json(json.loads(json.dumps(result.to_json(slo))))
    assert again == result and again.to_json(slo)["summary"]["ttft_miss_by"]["queue"] == 2
    print_summary(again, slo)
    out = capsys.readouterr().out
    assert "server TTFT breakdown, over 2 requests that missed the TTFT SLO" in out
    queue_row = next(line for line in out.splitlines() if line.startswith("queue "))
    assert queue_row.split() == ["queue", "400", "2"]  # mean (ms), largest in


def record(index: int, ttft_s: float | None, parts: tuple | None, error: str | None = None) -> RequestRecord:
    queue, prefill, exposed, other = parts or (None, None, None, None)
    return RequestRecord(
        index, 0.0, 0.0, 7, 5, ttft_s, (), None if error else 1.0, 5, 7, error,
        ttft_queue_s=queue, ttft_prefill_s=prefill, ttft_kv_transfer_exposed_s=exposed, ttft_other_s=other,
    )  # fmt: skip


def test_miss_attribution_counts_misses_with_a_breakdown_by_their_largest_part():
    records = [
        record(0, 0.9, (0.1, 0.6, None, 0.2)),  # prefill
        record(1, 0.9, (0.1, 0.2, 0.5, 0.1)),  # the exposed transfer
        record(2, 0.9, (None, None, None, 0.9)),  # only other known (a resumed stream)
        record(3, 0.9, (0.3, 0.3, None, 0.3)),  # a tie goes to the earliest part
        record(4, 0.1, (0.09, 0.005, None, 0.005)),  # met the SLO: not a miss
        record(5, 0.9, None),  # a miss the server did not break down
        record(6, None, None, error="HTTP 503"),  # failed: a miss without a TTFT
    ]
    summary = ttft_breakdown_summary(records, SLO(ttft_s=0.5, tpot_s=1.0))
    assert summary["ttft_breakdown_requests"] == 4
    assert summary["ttft_miss_by"] == {"queue": 1, "prefill": 1, "kv_transfer_exposed": 1, "other": 1}
    assert summary["mean_ttft_queue_s"] == pytest.approx((0.1 + 0.1 + 0.3) / 3)  # over those that have it
    assert summary["mean_ttft_kv_transfer_exposed_s"] == pytest.approx(0.5)
    assert summary["mean_ttft_other_s"] == pytest.approx((0.2 + 0.1 + 0.9 + 0.3) / 4)
    everything = ttft_breakdown_summary(records, None)
    assert everything["ttft_breakdown_requests"] == 5 and everything["ttft_miss_by"]["queue"] == 2
