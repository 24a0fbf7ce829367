"""Browsers and the router (router.edge_guard), through its real HTTP server with scripted pools: a
page on another origin, a DNS-rebinding host name and a ``text/plain`` POST reach no route, API
clients (no Origin, JSON bodies) and loopback pages are served; CORS for the origins
router.allowed_origins names; router.max_tokens_limit."""

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
    assert EdgePolicy.for_listener("127.0.0.1", ["*"], ["*"]) == EdgePolicy(None, None, cors=True)
    assert not local.cors  # no CORS unless router.allowed_origins names origins
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


def raw_exchange(port: int, method: str, path: str, headers: dict[str, str], body: bytes | None = None):
    """(status, lower-cased response headers, body bytes)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path, body, headers)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


def test_cors_is_off_by_default_loopback_pages_are_served_but_read_nothing(serve):  # noqa: F811
    async def scenario(server, request):
        port = server.listener.port
        page = {"Host": "127.0.0.1", "Origin": "http://localhost:5173"}
        status, headers, _ = await asyncio.to_thread(
            raw_exchange,
            port,
            "POST",
            "/v1/completions",
            {**page, "Content-Type": "application/json"},
            json.dumps(BODY).encode(),
        )
        assert status == 200 and "access-control-allow-origin" not in headers
        status, headers, _ = await asyncio.to_thread(
            raw_exchange, port, "OPTIONS", "/v1/completions", {**page, **PREFLIGHT}
        )
        assert status == 405 and "access-control-allow-origin" not in headers  # no preflight answered

    serve(scenario)


def test_allowed_origins_turn_cors_on_for_them_and_still_refuse_the_others(serve):  # noqa: F811
    async def scenario(server, request):
        port = server.listener.port
        app = {"Host": "127.0.0.1", "Origin": "https://app.example.com:8443"}
        status, headers, body = await asyncio.to_thread(
            raw_exchange, port, "OPTIONS", "/v1/chat/completions", {**app, **PREFLIGHT}
        )
        assert status == 200 and body == b"OK"
        assert headers["access-control-allow-origin"] == "https://app.example.com:8443"
        assert "POST" in headers["access-control-allow-methods"]
        assert headers["access-control-allow-headers"] == "authorization, content-type"
        assert headers["vary"] == "Origin" and int(headers["access-control-max-age"]) > 0
        status, headers, body = await asyncio.to_thread(
            raw_exchange,
            port,
            "POST",
            "/v1/completions",
            {**app, "Content-Type": "application/json"},
            json.dumps(BODY).encode(),
        )
        assert status == 200 and json.loads(body)["choices"]
        assert headers["access-control-allow-origin"] == "https://app.example.com:8443"
        status, headers, _ = await asyncio.to_thread(raw_exchange, port, "GET", "/v1/models", app)
        assert status == 200 and headers["access-control-allow-origin"] == "https://app.example.com:8443"
        # Another site: refused as before, preflight included, and nothing it could read.
        evil = {"Host": "127.0.0.1", "Origin": "https://evil.example"}
        for method, extra in (("OPTIONS", PREFLIGHT), ("POST", {"Content-Type": "application/json"})):
            status, headers, body = await asyncio.to_thread(
                raw_exchange, port, method, "/v1/completions", {**evil, **extra}, json.dumps(BODY).encode()
            )
            assert status == 403 and json.loads(body)["error"]["code"] == "forbidden_origin", method
            assert "access-control-allow-origin" not in headers
        # API clients send no Origin: no CORS headers, served as ever.
        status, headers, _ = await asyncio.to_thread(raw_exchange, port, "GET", "/v1/models", {"Host": "127.0.0.1"})
        assert status == 200 and "access-control-allow-origin" not in headers

    pool = serve(scenario, allowed_origins=["https://app.example.com"])
    assert len(pool.sent) == 1  # the allowed page's request only


def test_any_origin_with_cors_answers_a_star(serve):  # noqa: F811
    async def scenario(server, request):
        page = {"Host": "127.0.0.1", "Origin": "https://anywhere.example"}
        status, headers, _ = await asyncio.to_thread(raw_exchange, server.listener.port, "GET", "/v1/models", page)
        assert status == 200 and headers["access-control-allow-origin"] == "*" and "vary" not in headers

    serve(scenario, allowed_origins=["*"])


def test_a_chat_template_given_to_the_router_renders_its_chats(serve, smol_dir):  # noqa: F811
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"

    async def scenario(server, request):
        assert server.tokenizer.chat_template == template
        body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}
        status, _, answer = await request("/tokenize", body)
        assert status == 200, answer
        assert answer["tokens"] == server.tokenizer.encode("<user>hi", add_special_tokens=False)

    serve(scenario, chat_template=template)
