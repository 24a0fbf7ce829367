"""The router's plain routes: the model list and card, the version, health, the metrics scrape, and
the admin's status and resize. Status and resize need an admin key; health, the version and metrics
(counts only) need none, for probes and scrapers; the model list and card need any key."""

import asyncio
import importlib.metadata
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from common.block_hash import SHORT_HASH_BYTES
from common.errors import ConfigError, InvalidRequestError
from router import protocol
from router.auth import KeyRing, Unauthorized
from router.health import HealthCheck
from router.http_edge import error_response, read_body, unauthorized
from router.metrics import RouterMetrics

logger = logging.getLogger("pdserve.router")


_CARD_CONTEXT_WAIT_S = 5.0  # a model card waits this long for the pools' context length at most


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _without_hashes(report: dict) -> dict:
    packed = report.get("cached_blocks", b"")
    shown = {key: value for key, value in report.items() if key != "cached_blocks"}
    return {**shown, "num_cached_blocks": len(packed) // SHORT_HASH_BYTES}


class Resizer:
    """Resizes pools through ``scaler`` (cluster.scaling's: a local cluster's redeploys with only
    num_replicas changed and this router's own keyring and model directory; a declared app's sets
    the targets through Serve's external scaling API; either way the router and its streams stay).
    One resize at a time: 409 while one runs, even one whose caller left."""

    def __init__(
        self, scaler: Callable[[dict[str, int], KeyRing, str], dict[str, int]] | None, keyring: KeyRing, model_dir: str
    ) -> None:
        self.scaler = scaler
        self.keyring = keyring
        self.model_dir = model_dir
        self.running: asyncio.Future | None = None  # the resize running in a thread, if any

    async def resize(self, counts: dict[str, int]) -> dict[str, int]:
        """Every pool's count once Serve runs ``counts`` (the admin's resize, or the planner's)."""
        if self.scaler is None:
            raise InvalidRequestError("this router was started without a scaler (not by cluster.app)")
        if self.running is not None and not self.running.done():
            raise protocol.ApiError(409, "another resize is running; retry when it is done", code="conflict")
        resize = asyncio.get_running_loop().run_in_executor(None, self.scaler, counts, self.keyring, self.model_dir)
        self.running = resize
        return await asyncio.shield(resize)  # a thread cannot be cancelled: it runs to its end


class AdminRoutes:
    def __init__(
        self,
        keyring: KeyRing,
        served_model: str,
        mode: str,
        metrics: RouterMetrics,
        health_check: HealthCheck,
        resizer: Resizer,
        status: Callable[[], dict[str, Any]],
        body_timeout_s: float,
        context_length: Callable[[], Awaitable[int]] | None = None,
    ) -> None:
        self.keyring = keyring
        self.served_model = served_model
        self.mode = mode
        self.metrics = metrics
        self.health_check = health_check
        self.resizer = resizer
        self.status_of = status
        self.body_timeout_s = body_timeout_s
        self.context_length = context_length
        self.created = int(time.time())

    async def models(self, request: Request) -> Any:
        try:
            self.keyring.check_any(request.headers.get("authorization"))
        except Unauthorized as exc:
            return error_response(unauthorized(exc))
        return {"object": "list", "data": [await self._card()]}

    async def model(self, request: Request, model_id: str) -> Any:
        """GET /v1/models/{model_id}: the served model's card, or OpenAI's 404."""
        try:
            self.keyring.check_any(request.headers.get("authorization"))
        except Unauthorized as exc:
            return error_response(unauthorized(exc))
        if model_id != self.served_model:
            return error_response(protocol.model_not_found(model_id, self.served_model))
        return await self._card()

    async def version(self) -> dict[str, str]:
        return {"version": _version()}

    async def _card(self) -> dict[str, Any]:
        """As vLLM's: ``max_model_len`` is the pools' context length (null while no pool answers)."""
        max_model_len = None
        if self.context_length is not None:
            try:
                max_model_len = await asyncio.wait_for(self.context_length(), _CARD_CONTEXT_WAIT_S)
            except Exception as exc:  # the pools are down or slow: the card says nothing of it
                logger.info("the model card goes without max_model_len: %r", exc)
        return {
            "id": self.served_model,
            "object": "model",
            "created": self.created,
            "owned_by": "pdserve",
            "root": self.served_model,
            "parent": None,
            "max_model_len": max_model_len,
        }

    async def health(self) -> Response:
        """From the replica reports the router has, a shared pool call only where they are missing
        or old (router.health): 200 ok or degraded (no working prefill replica: prompts go to
        decode), 503 when nothing can serve."""
        status, body = await self.health_check.verdict()
        if status == 200:
            body["mode"] = self.mode
        return JSONResponse(body, status_code=status)

    async def prometheus_metrics(self) -> Response:
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)

    async def status(self, request: Request) -> Any:
        """The router's own state (``status``) and every replica's last report."""
        from router.routing_state import latest_reports

        try:
            self.keyring.check_admin(request.headers.get("authorization"))
        except Unauthorized as exc:
            return error_response(unauthorized(exc))
        # Block hashes stay inside the router: they tell what other tenants' prompts begin with.
        pools = {pool: [_without_hashes(report) for report in reports] for pool, reports in latest_reports().items()}
        return {**self.status_of(), "pools": pools}

    async def scale(self, request: Request) -> Any:
        """Resize pools, ``{"decode": 2}``; answers once Serve runs the new counts."""
        try:
            self.keyring.check_admin(request.headers.get("authorization"))
        except Unauthorized as exc:
            return error_response(unauthorized(exc))
        body: object = None
        try:
            body = protocol.decode_body(await read_body(request, 4096, self.body_timeout_s))
            if not isinstance(body, dict) or not body or not all(isinstance(k, str) for k in body):
                raise InvalidRequestError('write the pools to resize as {"decode": 2, "prefill": 1}')
            replicas = await self.resizer.resize(body)
        except ConfigError as exc:  # a pool the mode does not have, a count below 1, too few CPUs
            return error_response(protocol.api_error_from_exception(InvalidRequestError(str(exc))))
        except (protocol.ApiError, InvalidRequestError) as exc:
            return error_response(protocol.api_error_from_exception(exc))
        except Exception as exc:  # Serve refused the deploy: the admin sees why
            logger.exception("resize to %s failed", body)
            return error_response(protocol.ApiError(500, f"the resize failed: {exc}", type="server_error"))
        logger.info("pools resized: %s", replicas)
        return {"replicas": replicas}
