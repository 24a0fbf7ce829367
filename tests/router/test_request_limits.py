"""Limits before work, through the router's real HTTP server (scripted pool handles, no Ray): a prompt
too long by its characters is refused before tokenizing, tokenizing runs off the event loop and
counts against admission, max_tokens is clipped to the context, and stop lists are bounded."""

from __future__ import annotations

import asyncio
import threading

import pytest

from common.serving import ServeRequest
from router import protocol
from router.server import RouterServer
from tests.router.test_auth import Pool, call
from tests.router.test_metrics import MODEL, scrape
from tests.router.test_orchestrator import FakeResponse

CONTEXT = 8  # the pool's max_model_len: prompts of 3 tokens leave room for 5


class SmallPool(Pool):
    def remote(self, request: ServeRequest | None = None):
        if request is None:  # report.remote()
            return FakeResponse({"max_model_len": CONTEXT})
        return super().remote(request)


@pytest.fixture
def serve(smol_dir):
    """Runs ``scenario(server, request)`` against a RouterServer on a free port; ``request(path,
    body)`` posts from a thread, so the server's loop stays free to answer."""

    def run(scenario, **kwargs) -> SmallPool:
        pool = SmallPool()

        async def main() -> None:
            server = RouterServer(pool, None, "smol", str(smol_dir), mode="colocated", port=0, **kwargs)

            async def request(path: str, body: dict | None = None):
                return await asyncio.to_thread(call, server.listener.port, path, None, body)

            try:
                await scenario(server, request)
            finally:
                await server.__del__()

        asyncio.run(main())
        return pool

    return run


def hold_tokenizer(server: RouterServer) -> tuple[threading.Event, threading.Event]:
    """The server's tokenizer, held inside its thread: ``entered`` is set once a job runs, and the
    job ends when ``release`` is set."""
    entered, release = threading.Event(), threading.Event()
    tokenize = server.intake.tokenize

    def held_tokenize(parsed):
        entered.set()
        assert release.wait(30)
        return tokenize(parsed)

    server.intake.tokenize = held_tokenize
    return entered, release


def test_a_prompt_too_long_by_its_characters_is_refused_without_tokenizing(serve):
    async def scenario(server, request):
        tokenized = []
        tokenize = server.intake.tokenize
        server.intake.tokenize = lambda parsed: tokenized.append(parsed) or tokenize(parsed)
        limit = CONTEXT * server.intake.max_token_chars
        status, _, error = await request("/v1/completions", {"model": "smol", "prompt": "a" * (limit + 1)})
        assert status == 400 and error["error"]["code"] == "context_length_exceeded"
        assert error["error"]["param"] == "prompt" and f"{limit + 1} characters" in error["error"]["message"]
        chat = {"model": "smol", "messages": [{"role": "user", "content": "b" * (limit // 2 + 1)}] * 2}
        status, _, error = await request("/v1/chat/completions", chat)
        assert status == 400 and error["error"]["param"] == "messages"
        assert tokenized == []
        # At the bound it is tokenized, and refused by its token count instead.
        status, _, error = await request("/v1/completions", {"model": "smol", "prompt": "a" * limit})
        assert status == 400 and "tokens" in error["error"]["message"] and len(tokenized) == 1

    pool = serve(scenario)
    assert pool.sent == []


def test_max_tokens_is_clipped_to_the_room_the_context_leaves(serve):
    async def scenario(server, request):
        body = {"model": "smol", "prompt": [1, 2, 3], "max_tokens": 10**6}
        status, _, answer = await request("/v1/completions", body)
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == CONTEXT - 3

    pool = serve(scenario)
    assert [r.sampling["max_tokens"] for r in pool.sent] == [CONTEXT - 3]


def test_tokenizing_runs_off_the_event_loop_and_counts_against_admission(serve):
    async def scenario(server, request):
        entered, release = threading.Event(), threading.Event()
        threads = []
        tokenize = server.intake.tokenize

        def held_tokenize(parsed):
            threads.append(threading.current_thread().name)
            entered.set()
            assert release.wait(30)
            return tokenize(parsed)

        server.intake.tokenize = held_tokenize
        body = {"model": "smol", "prompt": "one two three", "max_tokens": 2}  # 3 tokens, as the fake pool wants
        held = asyncio.ensure_future(request("/v1/completions", body))
        assert await asyncio.to_thread(entered.wait, 30)
        # The loop answers while the tokenizer is busy, and the request being tokenized holds the
        # only place (max_concurrent_requests=1): a second one is a 503 at once.
        assert (await request("/v1/models"))[0] == 200
        status, headers, error = await request("/v1/completions", {"model": "smol", "prompt": [1, 2, 3]})
        assert status == 503 and error["error"]["type"] == "service_unavailable" and "retry-after" in headers
        release.set()
        status, _, answer = await held
        assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
        assert threads == ["pdserve-tokenize"]
        assert server.num_admitting == 0 and server.num_in_flight == 0

    serve(scenario, max_concurrent_requests=1)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("stop", ["x"] * 17, "at most 16 stop strings"),
        ("stop", "y" * 257, "at most 256 characters"),
        ("stop_token_ids", list(range(300)), "at most 256 stop_token_ids"),
    ],
)
def test_stop_lists_and_stop_strings_are_bounded(serve, field, value, message):
    async def scenario(server, request):
        status, _, error = await request("/v1/completions", {"model": "smol", "prompt": [1, 2, 3], field: value})
        assert status == 400 and error["error"]["param"] == field and message in error["error"]["message"]

    assert serve(scenario).sent == []


def test_a_request_cancelled_mid_tokenizing_keeps_its_place_until_the_tokenizer_is_done(serve):
    async def scenario(server, request):
        entered, release = hold_tokenizer(server)
        parsed = protocol.parse_completion_request({"model": "smol", "prompt": "one two three"}, "smol")
        task = asyncio.ensure_future(server.intake.tokenize_off_loop(parsed, None))
        assert await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The tokenizer still works for it: it keeps a place in admission, no one else may start.
        assert server.intake.num_orphaned == 1
        status, _, _ = await request("/v1/completions", {"model": "smol", "prompt": [1, 2, 3], "max_tokens": 4})
        assert status == 503
        release.set()
        for _ in range(300):
            if server.intake.num_orphaned == 0:
                break
            await asyncio.sleep(0.01)
        assert server.intake.num_orphaned == 0 and server.num_admitting == 0

    serve(scenario, max_concurrent_requests=1)


def test_a_body_that_stops_coming_gets_408_and_gives_its_admission_slot_back(serve):
    """Admission holds one request; a client sends headers and half its body, then nothing. Within
    the body deadline it is answered 408 (OpenAI's format) and the next request is admitted."""

    async def scenario(server, request):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.listener.port)
        body = b'{"model": "smol", "prompt": "Hello", "max_tokens": 2}'
        head = (
            "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode() + body[:10])
        await writer.drain()
        await asyncio.sleep(0.2)
        assert server.num_admitting == 1
        status, _, answer = await request("/v1/completions", {"model": "smol", "prompt": [1, 2, 3], "max_tokens": 4})
        assert status == 503  # the stalled body holds the only slot meanwhile
        raw = await asyncio.wait_for(reader.read(), 10)
        assert raw.startswith(b"HTTP/1.1 408"), raw[:200]
        assert b'"code":"request_timeout"' in raw.replace(b" ", b"")
        assert server.num_admitting == 0
        status, _, answer = await request("/v1/completions", {"model": "smol", "prompt": [1, 2, 3], "max_tokens": 4})
        assert status == 200, answer
        writer.close()

    serve(scenario, max_concurrent_requests=1, body_timeout_s=1.0)


def test_a_chat_is_measured_by_every_string_and_message_it_carries_before_tokenizing(serve):
    """Many empty messages (each renders to a token at least) and text inside content parts both
    count; either refusal comes before the tokenizer is asked."""

    async def scenario(server, request):
        tokenized = []
        tokenize = server.intake.tokenize
        server.intake.tokenize = lambda parsed: tokenized.append(parsed) or tokenize(parsed)
        empty = [{"role": "user", "content": ""}] * (CONTEXT + 1)
        status, _, error = await request("/v1/chat/completions", {"model": "smol", "messages": empty})
        assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
        assert f"{CONTEXT + 1} messages" in error["error"]["message"]
        text = "x" * (CONTEXT * server.intake.max_token_chars + 1)
        parts = [{"role": "user", "content": [{"type": "text", "text": text}]}]
        status, _, error = await request("/v1/chat/completions", {"model": "smol", "messages": parts})
        assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
        assert "characters in its messages" in error["error"]["message"]
        assert tokenized == []

    serve(scenario)


def test_a_request_that_leaves_while_waiting_for_the_tokenizer_gives_its_place_back_at_once(serve):
    async def scenario(server, request):
        entered, release = hold_tokenizer(server)
        parsed = protocol.parse_completion_request({"model": "smol", "prompt": "one two three"}, "smol")
        busy = asyncio.ensure_future(server.intake.tokenize_off_loop(parsed, None))
        assert await asyncio.to_thread(entered.wait, 30)
        queued = asyncio.ensure_future(server.intake.tokenize_off_loop(parsed, None))
        await asyncio.sleep(0.05)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert server.intake.num_orphaned == 0  # its job never ran: nothing holds a place for it
        release.set()
        assert (await busy)[0]

    serve(scenario)


def test_a_large_body_and_a_long_list_of_token_ids_are_checked_off_the_event_loop(serve, monkeypatch):
    """A body past PARSE_ON_LOOP_MAX_BYTES is decoded and parsed on the parse thread, a list of ids
    past CHECK_IDS_ON_LOOP_MAX range-checked there (one of 30 MiB held every stream for seconds on
    the loop); small ones stay on the loop (no hop for them). Either way the answer is the same."""
    from router import intake as server_module

    threads: list[str] = []
    real = server_module.protocol.decode_body
    monkeypatch.setattr(
        server_module.protocol, "decode_body", lambda raw: threads.append(threading.current_thread().name) or real(raw)
    )

    checked: list[str] = []

    async def scenario(server, request):
        server.intake.max_token_chars = 10**6  # the long prompt below is refused by its length, after the checks
        tokenize = server.intake.tokenize
        server.intake.tokenize = lambda parsed: checked.append(threading.current_thread().name) or tokenize(parsed)
        ids = [5] * 120_000  # ~360 KiB of JSON
        status, _, error = await request("/v1/completions", {"model": "smol", "prompt": ids})
        assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
        bad = [5] * 5000 + [10**9]
        status, _, error = await request("/v1/completions", {"model": "smol", "prompt": bad})
        assert status == 400 and "prompt token ids must be" in error["error"]["message"], error
        status, _, _ = await request("/v1/completions", {"model": "smol", "prompt": [1, 2, 3], "max_tokens": 4})
        assert status == 200

    serve(scenario)
    assert threads[0].startswith("pdserve-parse") and all(t == "MainThread" for t in threads[1:]), threads
    assert [t.split("_")[0] for t in checked] == ["pdserve-parse", "pdserve-parse", "MainThread"], checked


def test_a_batch_clips_each_prompt_s_max_tokens_and_chat_s_default_is_the_context_s_rest(serve):
    async def scenario(server, request):
        batch = {"model": "smol", "prompt": [[1, 2, 3], [1, 2, 3, 4]], "max_tokens": 5, "n": 2}
        status, _, answer = await request("/v1/completions", batch)
        assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
        assert answer["usage"]["prompt_tokens"] == 7  # each prompt once, whatever n
        samples = scrape(server.metrics)
        assert samples[("pdserve:request_choices_count", MODEL)] == 1
        assert samples[("pdserve:request_choices_sum", MODEL)] == 4
        status, _, answer = await request("/v1/completions", {"model": "smol", "prompt": [1, 2, 3]})
        assert status == 200

    pool = serve(scenario)
    batch, plain = pool.sent[:4], pool.sent[4]
    assert sorted(r.sampling["max_tokens"] for r in batch) == [4, 4, 5, 5]  # prompt 2 leaves room for 4
    assert plain.sampling["max_tokens"] == 5  # OpenAI's completions default of 16, clipped to the room


def test_chat_s_default_max_tokens_is_the_context_s_rest(serve, monkeypatch):
    monkeypatch.setattr(SmallPool, "remote", _reporting(40))

    async def scenario(server, request):
        chat = {"model": "smol", "messages": [{"role": "user", "content": "hi"}]}
        status, _, _ = await request("/v1/chat/completions", chat)
        assert status == 200

    (sent,) = serve(scenario).sent
    assert sent.sampling["max_tokens"] == 40 - len(sent.prompt_token_ids)  # OpenAI's "until the context is full"


def _reporting(context: int):
    def remote(self, request: ServeRequest | None = None):
        if request is None:
            return FakeResponse({"max_model_len": context})
        return Pool.remote(self, request)

    return remote


def test_n_past_router_max_n_and_priority_without_the_priority_policy_are_refused_by_name(serve):
    async def scenario(server, request):
        status, _, error = await request("/v1/completions", {"model": "smol", "prompt": [1, 2, 3], "n": 3})
        assert (status, error["error"]["param"]) == (400, "n") and "router.max_n" in error["error"]["message"]
        status, _, error = await request("/v1/completions", {"model": "smol", "prompt": [1, 2, 3], "priority": 2})
        assert (status, error["error"]["param"], error["error"]["code"]) == (400, "priority", "unsupported_parameter")
        status, _, _ = await request("/v1/completions", {"model": "smol", "prompt": [1, 2, 3], "priority": 0})
        assert status == 200

    pool = serve(scenario, max_n=2)
    assert len(pool.sent) == 1


def test_with_the_priority_policy_a_request_s_priority_reaches_the_pool(serve):
    async def scenario(server, request):
        status, _, _ = await request("/v1/completions", {"model": "smol", "prompt": [1, 2, 3], "priority": -3})
        assert status == 200

    pool = serve(scenario, priority_scheduling=True)
    assert [r.sampling["priority"] for r in pool.sent] == [-3]
