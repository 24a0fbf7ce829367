"""Who may call the router: API keys, a tenant per key, and each tenant's limits.

Keys come from a YAML file (``api_keys_file``) and from the environment:

    tenants:                              PDSERVE_API_KEYS=key1,key2   (tenant "default", no limits)
      - name: acme                        PDSERVE_ADMIN_KEY=key        (the admin endpoints)
        keys: [sk-acme-1, sk-acme-2]
        requests_per_minute: 600          # each limit optional; absent: unlimited
        tokens_per_minute: 200000         # prompt + max_tokens, charged at admission, unused output refunded
        max_concurrent_requests: 16
    admin_keys: [sk-admin]

A client sends ``Authorization: Bearer <key>``. With no key configured nothing is asked, which
``ClusterConfig`` allows only on a loopback address. Keys are kept as SHA-256 digests only, so
neither a repr nor a log line can show one. A tenant's default prefix-cache salt is its name: its
prompts never share cached KV with another tenant's, whatever ``cache_salt`` a client sends
(``tenant_salt``).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import ConfigError

API_KEYS_ENV = "PDSERVE_API_KEYS"
ADMIN_KEY_ENV = "PDSERVE_ADMIN_KEY"
DEFAULT_TENANT = "default"
_LIMIT_KEYS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")


class Unauthorized(Exception):
    """No key, or a key nobody configured (401)."""


class RateLimited(Exception):
    """A tenant's limit is reached (429); ``retry_after_s`` is when it can take the request again."""

    def __init__(self, message: str, retry_after_s: float, limit: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.limit = limit  # requests | tokens | concurrency


@dataclass(frozen=True)
class TenantLimits:
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrent_requests: int | None = None


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits = field(default_factory=TenantLimits)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """Key digests → tenants, and the admin keys' digests. Empty: authentication is off."""

    def __init__(self, tenants: Mapping[bytes, Tenant] | None = None, admin: frozenset[bytes] = frozenset()) -> None:
        self._tenants = dict(tenants or {})
        self._admin = admin

    def __repr__(self) -> str:
        # The fingerprint (a hash of the digests) changes with any key, so a deployment whose keys
        # changed is a new version, and shows nothing of the keys.
        names = sorted({t.name for t in self._tenants.values()})
        return f"KeyRing(tenants={names}, admin_keys={len(self._admin)}, fingerprint={self.fingerprint})"

    @property
    def fingerprint(self) -> str:
        parts = sorted(d.hex() + repr(t) for d, t in self._tenants.items()) + sorted(d.hex() for d in self._admin)
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]

    @property
    def enabled(self) -> bool:
        return bool(self._tenants or self._admin)

    @classmethod
    def load(cls, path: str | None, environ: Mapping[str, str] | None = None, api_keys: Sequence[str] = ()) -> KeyRing:
        """From the file at ``path`` (None: none), the environment and ``api_keys`` (the cluster config's
        ``api_keys``, vLLM's --api-key: tenant "default", as the environment's); ConfigError names
        what is wrong."""
        environ = os.environ if environ is None else environ
        tenants: dict[bytes, Tenant] = {}
        admin: set[bytes] = set()
        if path is not None:
            spec = _read_yaml(path)
            for entry in spec.get("tenants") or []:
                tenant, keys = _tenant(entry, path)
                if any(t.name == tenant.name for t in tenants.values()):
                    raise ConfigError(f"{path}: tenant {tenant.name!r} is named twice (one name, one cache salt)")
                for key in keys:
                    _add(tenants, digest(key), tenant, path)
            admin |= {digest(k) for k in _keys(spec.get("admin_keys") or [], "admin_keys", path)}
        env_keys = _keys([k for k in environ.get(API_KEYS_ENV, "").split(",") if k.strip()], "keys", API_KEYS_ENV)
        env_keys += _keys(list(api_keys), "keys", "api_keys (--api-key)")
        if env_keys and any(t.name == DEFAULT_TENANT for t in tenants.values()):
            raise ConfigError(
                f"{path}: tenant {DEFAULT_TENANT!r} is {API_KEYS_ENV}'s; name the file's tenant otherwise"
            )
        for key in env_keys:
            _add(tenants, digest(key), Tenant(DEFAULT_TENANT), API_KEYS_ENV)
        if environ.get(ADMIN_KEY_ENV, "").strip():
            admin |= {digest(k) for k in _keys([environ[ADMIN_KEY_ENV]], "the key", ADMIN_KEY_ENV)}
        if admin & set(tenants):
            raise ConfigError("a key is both a tenant's and an admin key; give the admin its own")
        return cls(tenants, frozenset(admin))

    def tenant(self, authorization: str | None) -> Tenant | None:
        """The caller's tenant (None: authentication is off). Raises Unauthorized."""
        if not self.enabled:
            return None
        tenant = self._tenants.get(digest(_bearer(authorization)))
        if tenant is None:
            raise Unauthorized("incorrect API key provided")
        return tenant

    def check_any(self, authorization: str | None) -> None:
        """Raises Unauthorized unless the caller holds some key, a tenant's or an admin's."""
        if self.enabled:
            key_digest = digest(_bearer(authorization))
            if key_digest not in self._tenants and key_digest not in self._admin:
                raise Unauthorized("incorrect API key provided")

    def check_admin(self, authorization: str | None) -> None:
        """Raises Unauthorized unless the caller holds an admin key (or authentication is off)."""
        if self.enabled and digest(_bearer(authorization)) not in self._admin:
            raise Unauthorized("this endpoint needs an admin key")


def tenant_salt(tenant: Tenant | None, cache_salt: str | None) -> str | None:
    """The salt a request's KV blocks are hashed with: its tenant's name ahead of the client's own
    salt, so no salt a client can send reaches another tenant's cache."""
    if tenant is None:
        return cache_salt
    return f"{len(tenant.name)}:{tenant.name}:{cache_salt or ''}"


def _bearer(authorization: str | None) -> str:
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("no API key: send 'Authorization: Bearer <key>'")
    return key.strip()


class _Bucket:
    """A token bucket: ``per_minute`` refills evenly over the minute, holding at most a minute's worth."""

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = per_minute
        self.rate = per_minute / 60.0
        self.level = per_minute
        self.updated = now

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` and return 0, or take nothing and return the seconds until it would fit."""
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now
        amount = min(amount, self.capacity)  # a request bigger than a minute's worth waits for a full bucket
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


@dataclass
class Admission:
    tenant: Tenant
    tokens_charged: int


class TenantGate:
    """Each tenant's request rate, tokens per minute and concurrent requests, checked at admission
    (on the router's event loop: no locks). Limits are per router replica."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}
        self.in_flight: dict[str, int] = {}

    def admit(self, tenant: Tenant) -> Admission:
        """Before the body is read: the tenant's concurrency and request rate. Raises RateLimited
        (nothing taken) or returns the admission, which ``release`` ends."""
        limits, now, name = tenant.limits, self._clock(), tenant.name
        if limits.max_concurrent_requests is not None and self.in_flight.get(name, 0) >= limits.max_concurrent_requests:
            raise RateLimited(
                f"tenant {name!r} has {limits.max_concurrent_requests} requests in flight (its limit)", 1.0, "requests"
            )
        requests = self._bucket(self._requests, name, limits.requests_per_minute, now)
        wait = requests.take(1, now) if requests is not None else 0.0
        if wait:
            raise RateLimited(
                f"tenant {name!r} reached {limits.requests_per_minute:g} requests per minute", wait, "requests"
            )
        self.in_flight[name] = self.in_flight.get(name, 0) + 1
        return Admission(tenant, 0)

    def charge_tokens(self, admission: Admission, num_tokens: int) -> None:
        """Once the prompt is tokenized: ``num_tokens`` (prompt + max_tokens) against the tenant's
        tokens per minute. Raises RateLimited (nothing charged; the caller still releases)."""
        tenant = admission.tenant
        tokens = self._bucket(self._tokens, tenant.name, tenant.limits.tokens_per_minute, self._clock())
        if tokens is None:
            return
        charge = min(num_tokens, int(tokens.capacity))  # what take() takes of a request over a minute's worth
        wait = tokens.take(charge, self._clock())
        if wait:
            raise RateLimited(
                f"tenant {tenant.name!r} reached {tenant.limits.tokens_per_minute:g} tokens per minute "
                f"(this request counts {num_tokens}: prompt + max_tokens)",
                wait,
                "tokens",
            )
        admission.tokens_charged = charge  # the refund at release is bounded by what was taken

    def release(self, admission: Admission, tokens_used: int) -> None:
        """The request ended having used ``tokens_used`` (prompt + output): the rest is refunded."""
        name = admission.tenant.name
        self.in_flight[name] = max(0, self.in_flight.get(name, 0) - 1)
        bucket = self._tokens.get(name)
        if bucket is not None and admission.tokens_charged > tokens_used:
            bucket.give_back(admission.tokens_charged - tokens_used)
        admission.tokens_charged = 0

    @staticmethod
    def _bucket(buckets: dict[str, _Bucket], name: str, per_minute: float | None, now: float) -> _Bucket | None:
        if per_minute is None:
            return None
        bucket = buckets.get(name)
        if bucket is None:
            bucket = buckets[name] = _Bucket(per_minute, now)
        return bucket


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


# --- the keys file -----------------------------------------------------------------------------
def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"api_keys_file {path!r} cannot be read: {exc.strerror or exc}") from None
    try:
        spec = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"api_keys_file {path!r} is not valid YAML: {exc}") from None
    if not isinstance(spec, dict) or set(spec) - {"tenants", "admin_keys"}:
        raise ConfigError(f"api_keys_file {path!r} must be a mapping with 'tenants' and/or 'admin_keys'")
    return spec


def _tenant(entry: object, source: str) -> tuple[Tenant, list[str]]:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
        raise ConfigError(f"{source}: each tenant needs a non-empty 'name'")
    name = entry["name"]
    unknown = set(entry) - {"name", "keys", *_LIMIT_KEYS}
    if unknown:
        raise ConfigError(
            f"{source}: tenant {name!r} has unknown keys {sorted(unknown)}; known: name, keys, {_LIMIT_KEYS}"
        )
    limits: dict[str, Any] = {}
    for key in _LIMIT_KEYS:
        value = entry.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ConfigError(f"{source}: tenant {name!r} {key}={value!r} must be a number > 0")
        if key == "max_concurrent_requests" and not isinstance(value, int):
            raise ConfigError(f"{source}: tenant {name!r} max_concurrent_requests={value!r} must be an integer")
        limits[key] = value
    keys = _keys(entry.get("keys") or [], f"tenant {name!r} keys", source)
    if not keys:
        raise ConfigError(f"{source}: tenant {name!r} has no keys")
    return Tenant(name, TenantLimits(**limits)), keys


def _keys(value: object, what: str, source: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(k, str) and len(k.strip()) >= 8 for k in value):
        raise ConfigError(f"{source}: {what} must be a list of strings of at least 8 characters")
    return [k.strip() for k in value]


def _add(tenants: dict[bytes, Tenant], key_digest: bytes, tenant: Tenant, source: str) -> None:
    if key_digest in tenants and tenants[key_digest] != tenant:
        raise ConfigError(f"{source}: a key is given to two tenants ({tenants[key_digest].name!r}, {tenant.name!r})")
    tenants[key_digest] = tenant
