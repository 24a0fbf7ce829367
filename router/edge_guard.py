"""Who may reach the router from a browser: the Host and Origin checks, before any route runs.

A web page the operator opens can make their browser send requests to a router on loopback: a
cross-origin POST with a ``text/plain`` body needs no CORS preflight, and a DNS-rebinding page
reaches it under its own host name. Neither can read the answer (no CORS headers are sent), but
both could generate on the cluster's GPUs, or resize its pools, were they let through. So:

- ``Host`` must be one the router serves (by default, on loopback: localhost, 127.0.0.1, [::1],
  any port; beyond loopback any host, or ``router.allowed_hosts``);
- a request that carries ``Origin`` (browsers send it on every cross-origin POST) must come from
  an allowed origin (by default a loopback page: http(s)://localhost|127.0.0.1|[::1], any port;
  ``router.allowed_origins``, "*" for any);
- a POST body that names its type must name ``application/json`` (a form or ``text/plain`` body is
  what a page can send without a preflight; FastAPI, so vLLM, refuses them too).

A refusal is OpenAI's error format, 403 (415 for the content type), and names the setting.

CORS, as vLLM's ``--allowed-origins`` (FastAPI's CORSMiddleware: any method, any header, no
credentials): off by default, so no page elsewhere reads an answer. Once ``router.allowed_origins``
names origins, responses to their pages carry ``Access-Control-Allow-Origin`` and their preflight
``OPTIONS`` requests are answered; any other origin is still refused.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """``example.com:8000`` -> ``example.com``, ``[::1]:80`` -> ``::1`` (lower case)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


# What a preflight is told may follow (CORSMiddleware's allow_methods=["*"]) and for how long.
_CORS_METHODS = b"DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
_CORS_MAX_AGE_S = b"600"


@dataclass(frozen=True)
class EdgePolicy:
    allowed_hosts: frozenset[str] | None  # host names (no port); None: any
    allowed_origins: frozenset[str] | None  # scheme://host (no port); None: any
    cors: bool = False  # the allowed origins' pages may read answers (router.allowed_origins set)

    @classmethod
    def for_listener(
        cls, listen_host: str, allowed_hosts: Iterable[str] | None, allowed_origins: Iterable[str] | None
    ) -> EdgePolicy:
        loopback = is_loopback(listen_host)
        if allowed_hosts is not None:
            hosts = None if "*" in allowed_hosts else frozenset(host_name(h) for h in allowed_hosts)
        else:
            hosts = LOOPBACK_HOSTS if loopback else None
        if allowed_origins is not None:
            origins = None if "*" in allowed_origins else frozenset(_origin(o) for o in allowed_origins)
        else:
            origins = frozenset(f"{scheme}://{h}" for scheme in ("http", "https") for h in LOOPBACK_HOSTS)
        return cls(hosts, origins, cors=allowed_origins is not None)

    def cors_headers(self, headers: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
        """The CORS headers a response to this (not refused) request carries: none without CORS
        or without ``Origin``; ``*`` when any origin is allowed, else the page's own origin."""
        origin = headers.get(b"origin")
        if not self.cors or origin is None:
            return []
        if self.allowed_origins is None:
            return [(b"access-control-allow-origin", b"*")]
        return [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]

    def is_preflight(self, method: str, headers: dict[bytes, bytes]) -> bool:
        """A browser asking whether its page may send a request (CORS on: answered here)."""
        return (
            self.cors and method == "OPTIONS" and b"origin" in headers and b"access-control-request-method" in headers
        )

    def refusal(self, method: str, headers: dict[bytes, bytes]) -> tuple[int, str, str] | None:
        """(status, message, code) when the request may not go on; None when it may."""
        host = headers.get(b"host", b"").decode("latin-1")
        if self.allowed_hosts is not None and host_name(host) not in self.allowed_hosts:
            return 403, f"Host {host!r} is not served here (router.allowed_hosts)", "forbidden_host"
        origin = headers.get(b"origin")
        if origin is not None and self.allowed_origins is not None:
            text = origin.decode("latin-1")
            if _origin(text) not in self.allowed_origins:
                return (
                    403,
                    f"requests from the web origin {text!r} are refused (router.allowed_origins)",
                    "forbidden_origin",
                )
        if method == "POST" and b"content-type" in headers:
            content_type = headers[b"content-type"].decode("latin-1").split(";")[0].strip().lower()
            if content_type != "application/json":
                return 415, "send the body as JSON with 'Content-Type: application/json'", "unsupported_media_type"
        return None


def _origin(value: str) -> str:
    """``http://localhost:3000`` -> ``http://localhost``; anything unparsable stays as it is."""
    parts = urlsplit(value.strip().lower())
    if not parts.scheme or not parts.hostname:
        return value.strip().lower()
    return f"{parts.scheme}://{parts.hostname}"


class EdgeGuard:
    """ASGI middleware applying an ``EdgePolicy`` to every HTTP request."""

    def __init__(self, app: Any, policy: EdgePolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        refusal = self.policy.refusal(scope["method"], headers)
        cors = self.policy.cors_headers(headers) if refusal is None or refusal[2] != "forbidden_origin" else []
        if refusal is not None:
            status, message, code = refusal
            body = json.dumps(
                {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
            ).encode()
            await _answer(send, status, b"application/json", body, cors)
            return
        if self.policy.is_preflight(scope["method"], headers):
            await _answer(send, 200, b"text/plain; charset=utf-8", b"OK", cors + _preflight_headers(headers))
            return
        await self.app(scope, receive, _with_headers(send, cors) if cors else send)


def _preflight_headers(headers: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """Any method, and whichever headers the page asks to send (allow_headers=["*"])."""
    answer = [(b"access-control-allow-methods", _CORS_METHODS), (b"access-control-max-age", _CORS_MAX_AGE_S)]
    asked = headers.get(b"access-control-request-headers")
    return answer + ([(b"access-control-allow-headers", asked)] if asked else [])


async def _answer(send: Any, status: int, content_type: bytes, body: bytes, extra: list[tuple[bytes, bytes]]) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _with_headers(send: Any, extra: list[tuple[bytes, bytes]]) -> Any:
    """``send`` adding ``extra`` to the response's headers (the route's own Vary kept beside ours)."""

    async def sending(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return sending
