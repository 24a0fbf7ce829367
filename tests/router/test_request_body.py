"""router.server's request body reader: bounded whether or not the client declares a length."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from router.http_edge import read_body
from router.protocol import ApiError


def _request(chunks: list[bytes], headers: dict[str, str] | None = None) -> Request:
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw}, receive)


def test_a_chunked_body_is_read_whole_up_to_the_limit_and_refused_past_it():
    assert asyncio.run(read_body(_request([b"ab", b"cd"]), limit=4, timeout_s=30.0)) == b"abcd"
    with pytest.raises(ApiError) as refused:
        asyncio.run(read_body(_request([b"ab", b"cd", b"e"]), limit=4, timeout_s=30.0))
    assert refused.value.status == 413 and refused.value.code == "request_too_large"


def test_a_declared_length_past_the_limit_is_refused_before_reading_and_closes_the_connection():
    request = _request([b"never read"], {"content-length": "5"})
    with pytest.raises(ApiError) as refused:
        asyncio.run(read_body(request, limit=4, timeout_s=30.0))
    assert refused.value.status == 413 and refused.value.headers == {"connection": "close"}
