"""Browsers and the router (router.edge_guard), through its real HTTP server with scripted pools: a
page on another origin, a DNS-rebinding host name and a ``text/plain`` POST reach no route, API
clients (no Origin, JSON bodies) and loopback pages are served; router.max_tokens_limit."""

from __future__ import annotations

import asyncio
import http.client
import json

from router.edge_guard import EdgePolicy, host_name
from tests.router.test_request_limits import CONTEXT, serve  # noqa: F401  (the fixture)

BODY = {"model": "smol", "prompt": [1, 2, 3], "max_tokens": 2}


def raw_call(port: int, method: str, path: str, headers: dict[str, str], body: bytes | None = None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        if body is not None:
            connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        connection.close()


def test_the_policy_by_listener():
    local = EdgePolicy.for_listener("127.0.0.1", None, None)
    assert local.allowed_hosts == {"localhost", "127.0.0.1", "::1"}
    assert EdgePolicy.for_listener("0.0.0.0", None, None).allowed_hosts is None
    assert EdgePolicy.for_listener("0.0.0.0", ["api.example.com:443"], None).allowed_hosts == {"api.example.com"}
    assert EdgePolicy.for_listener("127.0.0.1", ["*"], ["*"]) == EdgePolicy(None, None)
    assert [host_name(h) for h in ("[::1]:8000", "LocalHost:1", "::1", "a.b")] == ["::1", "localhost", "::1", "a.b"]
    ok = {b"host": b"localhost:8000"}
    assert local.refusal("GET", ok) is None
    assert local.refusal("GET", {**ok, b"origin": b"http://127.0.0.1:3000"}) is None
    assert local.refusal("GET", {b"host": b"rebound.example:8000"})[2] == "forbidden_host"
    assert local.refusal("GET", {b"host": b""})[2] == "forbidden_host"
    assert local.refusal("POST", {**ok, b"origin": b"https://evil.example"})[2] == "forbidden_origin"
    assert local.refusal("POST", {**ok, b"origin": b"null"})[2] == "forbidden_origin"  # sandboxed frames
    assert local.refusal("POST", {**ok, b"content-type": b"text/plain"})[:2][0] == 415
    assert local.refusal("POST", {**ok, b"content-type": b"application/json; charset=utf-8"}) is None


def test_pages_elsewhere_and_rebound_hosts_reach_no_route_and_api_clients_are_served(serve):  # noqa: F811
    async def scenario(server, request):
        port = server.listener.port
        body = json.dumps(BODY).encode()

        def call(headers, method="POST", path="/v1/completions", payload=body):
            return asyncio.to_thread(raw_call, port, method, path, headers, payload if method == "POST" else None)

        json_type = {"Content-Type": "application/json"}
        status, answer = await call({"Host": f"127.0.0.1:{port}", **json_type})
        assert status == 200 and answer["choices"][0]["text"] is not None
        status, _ = await call({"Host": f"localhost:{port}", "Origin": "http://localhost:5173", **json_type})
        assert status == 200  # a loopback page (a local chat UI)
        # A page on another site posting text/plain (no preflight), and the same with JSON.
        status, error = await call({"Host": f"127.0.0.1:{port}", "Origin": "https://evil.example", **json_type})
        assert status == 403 and error["error"]["code"] == "forbidden_origin"
        assert "router.allowed_origins" in error["error"]["message"]
        status, error = await call({"Host": f"127.0.0.1:{port}", "Content-Type": "text/plain"})
        assert status == 415 and error["error"]["code"] == "unsupported_media_type"
        # DNS rebinding: the page's own name, resolved to 127.0.0.1.
        for path, method in (("/v1/completions", "POST"), ("/pdserve/status", "GET"), ("/health", "GET")):
            status, error = await call({"Host": f"rebound.example:{port}", **json_type}, method, path)
            assert status == 403 and error["error"]["code"] == "forbidden_host", path
        status, _ = await call({"Host": f"127.0.0.1:{port}"}, "POST", "/pdserve/scale", b'{"colocated": 2}')
        assert status != 403  # no page in the way: the route itself answers (no scaler here)

    pool = serve(scenario)
    assert len(pool.sent) == 2  # the two served requests, nothing from the refused ones


def test_allowed_hosts_and_origins_open_what_the_operator_names(serve):  # noqa: F811
    async def scenario(server, request):
        port = server.listener.port
        body = json.dumps(BODY).encode()
        headers = {"Host": "api.example.com", "Origin": "https://app.example.com", "Content-Type": "application/json"}
        status, _ = await asyncio.to_thread(raw_call, port, "POST", "/v1/completions", headers, body)
        assert status == 200
        headers["Host"] = "localhost"  # no longer named
        status, error = await asyncio.to_thread(raw_call, port, "POST", "/v1/completions", headers, body)
        assert status == 403 and error["error"]["code"] == "forbidden_host"

    serve(scenario, allowed_hosts=["api.example.com"], allowed_origins=["https://app.example.com"])


def test_max_tokens_beyond_the_limit_is_refused_by_name_and_the_default_cut_to_it(serve):  # noqa: F811
    async def scenario(server, request):
        chat = {"model": "smol", "messages": [{"role": "user", "content": "hi"}]}
        for field in ("max_tokens", "max_completion_tokens"):
            status, _, error = await request("/v1/chat/completions", {**chat, field: 4})
            assert status == 400 and error["error"]["param"] == field
            assert "router.max_tokens_limit" in error["error"]["message"]
        completion = {"model": "smol", "prompt": [1, 2, 3]}
        status, _, answer = await request("/v1/completions", {**completion, "max_tokens": 3})
        assert status == 200
        server.intake.max_tokens_limit = 2  # below /v1/completions' default of 16
        status, _, answer = await request("/v1/completions", completion)
        assert status == 200 and answer["usage"]["completion_tokens"] == 2

    pool = serve(scenario, max_tokens_limit=3)
    assert [r.sampling["max_tokens"] for r in pool.sent] == [3, 2]
