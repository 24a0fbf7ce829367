"""Large bodies parsed in the router's parse process (a real child process over pipes): the same
refusals and the same parse as the router's own, bounded results back, and a child that dies
replaced with only its body's request refused."""

from __future__ import annotations

import asyncio
import json
import os

import psutil
import pytest

from common.errors import InvalidRequestError, OverloadedError
from router import protocol
from router.intake import decode_and_parse
from router.parse_process import NICENESS, ParseProcess, verdict
from router.prompt_bounds import PromptBounds
from router.protocol import ApiError
from tests.router.test_request_limits import serve  # noqa: F401  (fixture)

BOUNDS = PromptBounds(max_model_len=64, max_token_chars=8, vocab_size=1000)

BODIES = [
    ("completion", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0.5, "junk": [0] * 1000}),
    ("completion", {"model": "m", "prompt": "hello there", "stop": ["x"], "seed": 7, "stream": True}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.9, "extra": {"a": 1}}),
    ("completion", {"model": "m", "prompt": [1] * 64}),  # the context, full: no room for a token
    ("completion", {"model": "m", "prompt": [5000]}),  # out of the vocabulary
    ("completion", {"model": "m", "prompt": "a" * 513}),  # more characters than 64 tokens of 8
    ("chat", {"model": "m", "messages": [{"role": "user", "content": ""}] * 64}),
    ("chat", {"model": "m", "messages": [{"role": "robot", "content": "x"}]}),
    ("completion", {"model": "m", "prompt": "hi", "guided_regex": "a+"}),  # refused by name
    ("completion", {"model": "m", "prompt": "hi", "logit_bias": {"1": 2, "7": -100.0}, "min_tokens": 1}),
    ("completion", {"model": "m", "prompt": "hi", "temperature": -1}),
]


def router_outcome(kind: str, raw: bytes):
    """What the router makes of a body itself: its parse, then the bounds that need no tokenizer."""
    from router.prompt_bounds import check_bounds

    try:
        parsed = decode_and_parse(raw, kind, "m")
        check_bounds(parsed, BOUNDS)
        return parsed
    except (ApiError, InvalidRequestError) as exc:
        return type(exc).__name__, str(exc), getattr(exc, "param", None), getattr(exc, "status", None)


@pytest.mark.parametrize("kind, body", BODIES)
def test_the_child_refuses_what_the_router_refuses_and_its_body_parses_as_the_original(kind, body):
    raw = json.dumps(body).encode()
    status, payload = verdict(raw, kind, "m", BOUNDS)
    want = router_outcome(kind, raw)
    if status == 0:
        assert len(payload) < len(raw) or "junk" not in body
        assert router_outcome(kind, payload) == want
        assert b"junk" not in payload and b"extra" not in payload
    else:
        from router.parse_process import refusal_from

        exc = refusal_from(payload)
        assert (type(exc).__name__, str(exc), exc.param, getattr(exc, "status", None)) == want


def test_bodies_not_json_or_not_unicode_are_refused_as_the_router_refuses_them():
    for raw in (b"{not json", b'{"model": "m", "prompt": "a \\ud800 b"}', b"[" * 50_000 + b"]" * 50_000):
        status, payload = verdict(raw, "completion", "m", BOUNDS)
        from router.parse_process import refusal_from

        assert status == 1
        assert str(refusal_from(payload)) == router_outcome("completion", raw)[1]


def test_a_real_child_answers_in_order_and_a_dead_one_is_replaced_for_the_next_body():
    async def main() -> None:
        process = ParseProcess(timeout_s=30)
        try:
            big = json.dumps({"model": "m", "prompt": [7] * 10, "junk": [0] * 500_000}).encode()
            reduced = await process.reduce(big, "completion", "m", BOUNDS)
            assert json.loads(reduced) == {"model": "m", "prompt": [7] * 10}
            # It yields the CPU: its niceness is the router's plus NICENESS.
            assert psutil.Process(process._child.pid).nice() == min(19, os.nice(0) + NICENESS)
            too_long = json.dumps({"model": "m", "prompt": [7] * 500_000}).encode()
            with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
                await process.reduce(too_long, "completion", "m", BOUNDS)
            first = process._child
            first.kill()
            await first.wait()
            # A child found dead before the body is written is started afresh; one that dies with the
            # body in it costs that body a 503.
            reduced = await process.reduce(big, "completion", "m", BOUNDS)
            assert process._child is not first and json.loads(reduced)["prompt"] == [7] * 10
            process._child.stdout.feed_eof()  # the answer will never come
            with pytest.raises(OverloadedError):
                await process.reduce(big, "completion", "m", BOUNDS)
            assert process.num_restarts == 1 and process._child is None
            assert json.loads(await process.reduce(big, "completion", "m", BOUNDS))["prompt"] == [7] * 10
        finally:
            await process.close()

    asyncio.run(main())


def test_the_router_never_parses_a_large_body_in_its_own_process(serve, monkeypatch):  # noqa: F811
    """A 26 MiB body of token ids held the loop 0.26 s per body when parsed on a thread of the
    router (the GIL). Here the router's process only ever parses the reduced body."""
    from router import intake as intake_module

    seen: list[int] = []
    real = protocol.decode_body
    monkeypatch.setattr(intake_module.protocol, "decode_body", lambda raw: seen.append(len(raw)) or real(raw))

    async def scenario(server, request):
        ids = [5] * 4_000_000  # ~12 MiB of JSON
        status, _, error = await request("/v1/completions", {"model": "smol", "prompt": ids})
        assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
        messages = [{"role": "user", "content": ""}] * 200_000
        status, _, error = await request("/v1/chat/completions", {"model": "smol", "messages": messages})
        assert status == 400 and error["error"]["param"] == "messages", error
        body = {"model": "smol", "prompt": [1, 2, 3], "max_tokens": 4, "padding": "x" * (3 * 2**20)}
        status, _, answer = await request("/v1/completions", body)
        assert status == 200, answer
        assert server.intake.parse_process.num_parsed == 3

    serve(scenario)
    assert seen and max(seen) < 1024, seen  # the router itself parsed only the reduced 200's body
