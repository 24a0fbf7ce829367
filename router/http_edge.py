"""The router's HTTP edge: request ids, bounded body reads, clients that leave, and every refusal
in OpenAI's error format. Plain functions over Starlette's Request; nothing here knows the pools."""

import asyncio
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from common.errors import OverloadedError
from router import protocol
from router.auth import RateLimited, Unauthorized, retry_after_header
from router.orchestrator import is_backpressure
from router.protocol import ApiError

_T = TypeVar("_T")
REQUEST_ID_KEY = "pdserve.request_id"


class RequestIds:
    """ASGI middleware: the request's id (the client's X-Request-Id, else a fresh one) in the scope,
    and on every response, errors and 404s included."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        request_id = given.decode("latin-1")[:128] or uuid.uuid4().hex
        scope[REQUEST_ID_KEY] = request_id
        header = (b"x-request-id", request_id.encode("latin-1"))

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_ids(request: Request) -> tuple[str, str]:
    """(internal id, the request id of the X-Request-Id header); internal ids stay unique per pool."""
    return uuid.uuid4().hex, request.scope.get(REQUEST_ID_KEY, "")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, within ``limit`` bytes and ``timeout_s`` seconds: a client that sends its
    body slowly, or stops, must not hold an admission slot (408, and the connection closes)."""
    declared = request.headers.get("content-length", "")
    # Closing: the server would otherwise read (and drop) the rest of the body.
    closing = {"connection": "close"}
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over {limit} bytes", code="request_too_large", headers=closing)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        message = f"the request body was not whole within {timeout_s:g} s ({size} bytes came); send it faster"
        raise ApiError(408, message, code="request_timeout", headers=closing) from None
    return b"".join(chunks)


class ClientLeft(Exception):
    """The client closed its connection before its response started."""


async def _disconnected(request: Request) -> None:
    # Once the body is read, the next ASGI message is the client's disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_left(request: Request, work: Awaitable[_T]) -> _T:
    """``work``, cancelled (and waited for) if the client leaves first: a client gone before its
    answer must not hold a decode slot and its KV blocks until max_tokens. (A stream whose headers
    are out is Starlette's: it stops the stream when the client leaves.)"""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
        raise ClientLeft
    return task.result()


def failed() -> ApiError:
    # The cause (replica lost, KV hand-off failed, …) is in the server log; clients get no internals.
    return ApiError(500, "the request failed inside the cluster; retry it", type="server_error")


def unauthorized(exc: Exception) -> ApiError:
    return ApiError(401, str(exc), code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def rate_limited(exc: RateLimited) -> ApiError:
    # OpenAI's 429: the limit's kind as the type, code rate_limit_exceeded.
    headers = {"Retry-After": retry_after_header(exc.retry_after_s)}
    return ApiError(429, str(exc), type=exc.limit, code="rate_limit_exceeded", headers=headers)


def refusal(exc: Exception) -> ApiError:
    """A request refused before it reached a pool, as the client sees it."""
    if isinstance(exc, Unauthorized):
        return unauthorized(exc)
    if isinstance(exc, RateLimited):
        return rate_limited(exc)
    if is_backpressure(exc):  # a pool's bounded queue (Serve's) is full: retry later, as any overload
        return protocol.api_error_from_exception(OverloadedError("the pools' queues are full; retry later"))
    if isinstance(exc, TimeoutError):  # a pool did not answer the router's question in time
        return protocol.api_error_from_exception(OverloadedError("the pools did not answer in time; retry later"))
    return protocol.api_error_from_exception(exc)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """Unknown paths and wrong methods, in OpenAI's error format too."""
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    headers = dict(exc.headers) if exc.headers else None  # 405: Allow
    return error_response(ApiError(exc.status_code, message, type=kind, headers=headers))
