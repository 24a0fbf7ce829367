"""Errors that cross package boundaries.

Request-level failures carry an OpenAI-style ``type``/``param``/``code`` so the router can
turn them into an error response without guessing; they never crash an engine loop.
"""

from __future__ import annotations


class PdserveError(Exception):
    """Base class for every error pdserve raises on purpose."""


class InvalidRequestError(PdserveError, ValueError):
    """A request that must be refused before it touches the KV cache.

    ``param`` names the offending field (OpenAI's ``error.param``); ``code`` is a short
    machine-readable reason. The HTTP layer maps this to 400 (or 413 for ``context_length_exceeded``).
    """

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ConfigError(PdserveError, ValueError):
    """A configuration value that cannot work; the message names the key and the fix."""


class UnsupportedModelError(ConfigError):
    """The model's architecture or shape cannot run with the requested settings."""


class OverloadedError(PdserveError):
    """The engine's bounded queues are full: retry later (HTTP 503 with Retry-After)."""


class EngineStopped(PdserveError, RuntimeError):
    """The replica's engine stopped (a step failed: a shard died, a kernel raised); it takes no more
    work and Serve's health check replaces the replica. Another replica can serve the request."""
