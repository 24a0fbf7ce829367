"""API keys, tenants and their limits (router.auth), alone and through the router's real HTTP server
(a RouterServer with scripted pool handles: no Ray; the pools are tested in tests/cluster)."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest

from common.errors import ConfigError
from common.serving import ServeRequest
from router.auth import (
    ADMIN_KEY_ENV,
    API_KEYS_ENV,
    KeyRing,
    RateLimited,
    Tenant,
    TenantGate,
    TenantLimits,
    Unauthorized,
    tenant_salt,
)
from tests.router.test_orchestrator import FakeDecode, FakeResponse

KEYS_FILE = """
tenants:
  - name: acme
    keys: [sk-acme-0001, sk-acme-0002]
    requests_per_minute: 2
    tokens_per_minute: 1000
    max_concurrent_requests: 1
  - name: globex
    keys: [sk-globex-001]
  - name: initech
    keys: [sk-initech-01]
    tokens_per_minute: 20
admin_keys: [sk-admin-0001]
"""


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS_FILE)
    return str(path)


def test_keys_from_the_file_and_the_environment_name_their_tenant(keys_file):
    ring = KeyRing.load(keys_file, {API_KEYS_ENV: "sk-env-00001, sk-env-00002", ADMIN_KEY_ENV: "sk-env-admin"})
    assert ring.tenant("Bearer sk-acme-0002").name == "acme"
    assert ring.tenant("bearer sk-globex-001").limits == TenantLimits()
    assert ring.tenant("Bearer sk-env-00002").name == "default"
    with pytest.raises(Unauthorized, match="incorrect API key"):
        ring.tenant("Bearer sk-acme-0003")
    with pytest.raises(Unauthorized, match="no API key"):
        ring.tenant(None)
    with pytest.raises(Unauthorized, match="no API key"):
        ring.tenant("Basic sk-acme-0001")
    ring.check_admin("Bearer sk-admin-0001")
    ring.check_admin("Bearer sk-env-admin")
    with pytest.raises(Unauthorized, match="admin key"):
        ring.check_admin("Bearer sk-acme-0001")  # a tenant's key is not an admin's
    # Only digests are kept: no repr shows a key, and any changed key changes the fingerprint.
    assert "sk-" not in repr(ring) and "acme" in repr(ring)
    assert KeyRing.load(keys_file).fingerprint != ring.fingerprint


def test_keys_from_the_environment_are_checked_as_the_file_s_are(keys_file):
    with pytest.raises(ConfigError, match="at least 8 characters"):
        KeyRing.load(None, {API_KEYS_ENV: "abc"})
    with pytest.raises(ConfigError, match="at least 8 characters"):
        KeyRing.load(None, {ADMIN_KEY_ENV: "abc"})


def test_no_key_configured_asks_for_none():
    ring = KeyRing.load(None, {})
    assert not ring.enabled and ring.tenant(None) is None
    ring.check_admin(None)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("tenants: [{name: a, keys: [short]}]", "at least 8 characters"),
        ("tenants: [{name: a, keys: [sk-00000001], tokens_per_minute: 0}]", "tokens_per_minute=0 must be a number > 0"),
        ("tenants: [{name: a, keys: [sk-00000001], rpm: 5}]", r"unknown keys \['rpm'\]"),
        ("tenants: [{keys: [sk-00000001]}]", "needs a non-empty 'name'"),
        ("tenants: [{name: a, keys: [sk-00000001]}, {name: b, keys: [sk-00000001]}]", "two tenants"),
        ("tenants: [{name: a, keys: [sk-00000001]}]\nadmin_keys: [sk-00000001]", "both a tenant's and an admin"),
        ("users: []", "must be a mapping with 'tenants'"),
        ("tenants: [{name: a, keys: [sk-00000001]}, {name: a, keys: [sk-00000002]}]", "named twice"),
    ],
)
def test_a_bad_keys_file_says_what_is_wrong(tmp_path, text, match):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        KeyRing.load(str(path), {})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_request_rate_refills_over_the_minute_and_says_when_to_retry():
    clock = Clock()
    gate, tenant = TenantGate(clock), Tenant("t", TenantLimits(requests_per_minute=2))
    gate.release(gate.admit(tenant), 0)
    gate.release(gate.admit(tenant), 0)
    with pytest.raises(RateLimited) as refused:
        gate.admit(tenant)
    assert refused.value.retry_after_s == pytest.approx(30.0) and refused.value.limit == "requests"
    clock.now += 30.0
    gate.admit(tenant)


def test_tokens_are_charged_at_admission_and_the_unused_output_refunded():
    clock = Clock()
    gate, tenant = TenantGate(clock), Tenant("t", TenantLimits(tokens_per_minute=1000))
    first = gate.admit(tenant)
    gate.charge_tokens(first, 800)  # prompt + max_tokens
    second = gate.admit(tenant)
    with pytest.raises(RateLimited) as refused:
        gate.charge_tokens(second, 300)
    assert refused.value.limit == "tokens" and refused.value.retry_after_s == pytest.approx(6.0)
    gate.release(second, 0)
    gate.release(first, 500)  # it used 500 of its 800: 300 come back
    third = gate.admit(tenant)
    gate.charge_tokens(third, 500)


def test_a_request_bigger_than_a_minute_s_tokens_cannot_refill_the_bucket_at_its_end():
    clock = Clock()
    gate, tenant = TenantGate(clock), Tenant("t", TenantLimits(tokens_per_minute=1000))
    huge = gate.admit(tenant)
    gate.charge_tokens(huge, 10**9)  # max_tokens has no bound of its own: it takes the whole minute
    gate.release(huge, 10)  # used 10: at most what was taken comes back, not 10**9 - 10
    small = gate.admit(tenant)
    with pytest.raises(RateLimited):
        gate.charge_tokens(small, 1000)
    gate.charge_tokens(small, 990)


def test_concurrent_requests_are_capped_per_tenant_and_freed_at_the_end():
    gate, tenant = TenantGate(Clock()), Tenant("t", TenantLimits(max_concurrent_requests=1))
    running = gate.admit(tenant)
    with pytest.raises(RateLimited, match="1 requests in flight"):
        gate.admit(tenant)
    gate.admit(Tenant("other"))  # another tenant is not held up
    gate.release(running, 0)
    gate.admit(tenant)


def test_a_tenant_s_salt_keeps_its_cache_apart_whatever_salt_a_client_sends():
    a, b = Tenant("a"), Tenant("b")
    assert tenant_salt(None, "x") == "x" and tenant_salt(None, None) is None
    salts = {tenant_salt(a, None), tenant_salt(a, "x"), tenant_salt(b, None), tenant_salt(b, "x")}
    assert len(salts) == 4
    # A client of tenant a cannot name a salt that lands in b's cache.
    assert tenant_salt(a, tenant_salt(b, None)) not in salts


# --- through the router's HTTP server ---------------------------------------------------------
class Pool(FakeDecode):
    """A colocated pool that records what it was sent and reports its context length."""

    def __init__(self) -> None:
        super().__init__([{}] * 100, colocated=True)
        self.report = self

    def options(self, stream: bool = False, **_):
        return self

    def remote(self, request: ServeRequest | None = None):
        if request is None:  # report.remote()
            return FakeResponse({"max_model_len": 2048})
        return super().remote(request)

    @property
    def sent(self) -> list[ServeRequest]:
        return [s.request for s in self.streams]


def call(port: int, path: str, key: str | None, body: dict | None = None) -> tuple[int, dict, dict]:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_the_router_asks_for_keys_limits_each_tenant_and_salts_its_prompts(keys_file, smol_dir):
    from router.server import RouterServer

    pool = Pool()
    body = {"model": "smol", "prompt": [1, 2, 3], "max_tokens": 4, "cache_salt": "mine"}  # FakeStream: 3 tokens
    resized: list[tuple[dict, str]] = []
    conflict_seen = threading.Event()

    def scaler(counts: dict, keyring: KeyRing, model_dir: str) -> dict:  # cluster.scaling.scale's contract
        if counts.get("colocated", 1) < 1:
            raise ConfigError("colocated=0: a pool's replicas must be an integer >= 1")
        assert conflict_seen.wait(30)  # Serve starting replicas, until the test saw the second call refused
        resized.append((counts, keyring.fingerprint))
        return {"colocated": counts["colocated"]}

    async def scenario() -> None:
        ring = KeyRing.load(keys_file, {})
        server = RouterServer(pool, None, "smol", str(smol_dir), mode="colocated", port=0, keyring=ring, scaler=scaler)
        port = server.listener.port
        try:

            async def request(path: str, key: str | None, payload: dict | None = None):
                return await asyncio.to_thread(call, port, path, key, payload)

            status, headers, error = await request("/v1/completions", None, body)
            assert status == 401 and error["error"]["code"] == "invalid_api_key"
            assert headers["www-authenticate"] == "Bearer"
            assert (await request("/v1/completions", "sk-wrong-0001", body))[0] == 401
            assert (await request("/v1/models", None))[0] == 401
            assert (await request("/v1/models", "sk-globex-001"))[0] == 200
            assert (await request("/v1/models", "sk-admin-0001"))[0] == 200
            assert (await request("/pdserve/status", "sk-acme-0001"))[0] == 401
            assert (await request("/pdserve/status", "sk-admin-0001"))[0] == 200
            assert (await request("/health", None))[0] != 401  # probes need no key
            assert (await request("/version", None))[0] == 200
            for path in ("/tokenize", "/detokenize", "/v1/models/smol"):  # any key the completions take
                payload = {"/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1]}}.get(path)
                assert (await request(path, None, payload))[0] == 401, path
                assert (await request(path, "sk-globex-001", payload))[0] == 200, path
            # Resizing is an admin's: a tenant's key is refused, bad bodies are 400s, one at a time.
            assert (await request("/pdserve/scale", "sk-acme-0001", {"colocated": 2}))[0] == 401
            assert (await request("/pdserve/scale", "sk-admin-0001", {"colocated": 0}))[0] == 400
            assert (await request("/pdserve/scale", "sk-admin-0001", {}))[0] == 400
            first = asyncio.ensure_future(request("/pdserve/scale", "sk-admin-0001", {"colocated": 2}))
            while server.resizer.running is None or server.resizer.running.done():  # until the first resize runs
                await asyncio.sleep(0.01)
            refused = await request("/pdserve/scale", "sk-admin-0001", {"colocated": 3})
            assert refused[0] == 409, refused
            conflict_seen.set()
            code, _, answer = await first
            assert (code, answer) == (200, {"replicas": {"colocated": 2}})
            assert resized == [({"colocated": 2}, ring.fingerprint)]  # with the running router's keys
            assert len(pool.sent) == 0  # nothing refused reached a pool

            status, _, answer = await request("/v1/completions", "sk-acme-0001", body)
            assert status == 200 and answer["usage"]["completion_tokens"] == 4
            assert (await request("/v1/completions", "sk-acme-0002", body))[0] == 200  # the same tenant
            status, headers, error = await request("/v1/completions", "sk-acme-0001", body)
            assert status == 429 and int(headers["retry-after"]) >= 1  # acme's 2 requests a minute
            assert error["error"]["code"] == "rate_limit_exceeded" and error["error"]["type"] == "requests"
            assert (await request("/v1/completions", "sk-globex-001", body))[0] == 200  # globex has no limit
            # Each tenant's prompts are hashed under its own salt, the client's own salt inside it.
            acme, _, globex = (r.cache_salt for r in pool.sent)
            assert acme == tenant_salt(Tenant("acme"), "mine") and globex == tenant_salt(Tenant("globex"), "mine")
            assert server.tenant_gate.in_flight == {"acme": 0, "globex": 0}
            # A refusal after admission (here the context length) gives the tenant's place back.
            too_long = {**body, "prompt": [1] * 5000}
            assert (await request("/v1/completions", "sk-globex-001", too_long))[0] == 400
            assert server.tenant_gate.in_flight == {"acme": 0, "globex": 0}
            # initech may spend 20 tokens a minute: prompt + max_tokens are charged at admission.
            assert (await request("/v1/completions", "sk-initech-01", body))[0] == 200  # 3 + 4
            status, headers, error = await request("/v1/completions", "sk-initech-01", {**body, "max_tokens": 30})
            assert status == 429 and int(headers["retry-after"]) >= 1, error
            assert error["error"]["code"] == "rate_limit_exceeded" and error["error"]["type"] == "tokens"
        finally:
            await server.listener.stop()

    asyncio.run(scenario())
