"""The ingress deployment: OpenAI-compatible HTTP API (FastAPI, served by the replica itself).

    POST /v1/completions, /v1/chat/completions ─▶ key, tenant and room (401/429/503 before the
    body is read) ─▶ parse + validate (400/404/413 before any pool) ─▶ a prompt's characters against
    the context (400 before tokenizing) ─▶ tokenize (+ chat template) on the tokenizer's own
    thread, check the context length, clip max_tokens to it ─▶ Orchestrator.run (decode
    reservation, prefill with the ticket, token deltas) ─▶ JSON or SSE

The replica listens on host:port itself (router.http_listener), not behind Serve's HTTP proxy:
every streamed token would cross one more process. Every response carries ``X-Request-Id`` (the
client's, echoed, or a fresh one); every log line about a request names it. A client that
disconnects mid-stream cancels the request on both pools.
"""

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from common.block_hash import SHORT_HASH_BYTES
from common.errors import ConfigError, InvalidRequestError, OverloadedError
from common.logs import setup_logging
from common.serving import StreamDelta
from common.tracing import extract, setup_tracing
from router import protocol
from router.auth import (
    Admission,
    KeyRing,
    TenantGate,
    Unauthorized,
    tenant_salt,
)
from router.context_length import POOL_CALL_TIMEOUT_S, ContextLength
from router.edge_guard import EdgeGuard, EdgePolicy
from router.health import HealthCheck
from router.http_edge import (
    ClientLeft,
    RequestIds,
    error_response,
    failed,
    http_error,
    read_body,
    refusal,
    request_ids,
    unauthorized,
    unless_client_left,
)
from router.http_listener import HttpListener
from router.intake import PromptIntake, load_tokenizer
from router.loop_lag import LoopLagProbe
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.planner import PlannerConfig
from router.planner_loop import PlannerLoop
from router.protocol import ParsedRequest, RequestKind
from router.remote_prefill import RemotePrefillEstimator
from router.responses import ResponseWriter

logger = logging.getLogger("pdserve.router")
_T = TypeVar("_T")
# A request body is read whole before parsing: this bounds what one client can make the router hold.
DEFAULT_MAX_BODY_BYTES = 32 * 2**20


async def _await(response: Any) -> Any:
    return await response


def _gen_ai_attributes(operation: str, model: str, parsed: ParsedRequest, request_id: str) -> dict[str, Any]:
    """The request's span attributes after OpenTelemetry's GenAI conventions (never the prompt)."""
    sampling = parsed.sampling
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "pdserve",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": sampling.max_tokens,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
        "pdserve.request_id": request_id,
    }
    if sampling.seed is not None:
        attributes["gen_ai.request.seed"] = sampling.seed
    return attributes


def _without_hashes(report: dict) -> dict:
    packed = report.get("cached_blocks", b"")
    shown = {key: value for key, value in report.items() if key != "cached_blocks"}
    return {**shown, "num_cached_blocks": len(packed) // SHORT_HASH_BYTES}


def _over_grpc(handle: Any) -> Any:
    """The pool handle calling its replicas over Serve's gRPC transport (what Serve's throughput
    settings pick by default; this holds however the driver that bound the handles was set up):
    every streamed token is one item on this hop, and an item costs about half the CPU of the
    Ray actor-call path. Test doubles without ``options`` pass as they are."""
    if handle is None or not hasattr(handle, "options"):
        return handle
    return handle.options(_by_reference=False)


class RouterServer:
    """A Serve deployment (cluster.app applies the options) that serves HTTP on host:port itself,
    from its constructor on; its health check fails if that server stops."""

    def __init__(
        self,
        decode: Any,
        prefill: Any | None,
        served_model: str,
        model_dir: str,
        mode: str = "disagg",
        request_timeout_s: float = 600.0,
        max_retries: int = 1,
        max_concurrent_requests: int = 1024,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        tracing: tuple[str, str | None] = ("none", None),
        conditional_disaggregation: bool = False,
        keyring: KeyRing | None = None,
        scaler: Callable[[dict[str, int], KeyRing, str], dict[str, int]] | None = None,
        planner: dict | None = None,
        pool_shards: dict[str, int] | None = None,
        header_timeout_s: float = 10.0,
        body_timeout_s: float = 30.0,
        inter_token_timeout_s: float | None = 30.0,
        allowed_hosts: list[str] | None = None,
        allowed_origins: list[str] | None = None,
        max_tokens_limit: int | None = None,
        kv_load_failure_policy: str = "recompute",
    ) -> None:
        """``planner``: router.planner.PlannerConfig's fields (its SLO planner resizes the pools through
        ``scaler``; disaggregated mode); ``pool_shards``: each pool's shards per replica (its budget)."""
        setup_logging()
        setup_tracing(tracing[0], "pdserve-router", tracing[1])

        decode, prefill = _over_grpc(decode), _over_grpc(prefill)
        self.decode = decode
        self.prefill = prefill
        self.mode = mode
        self.served_model = served_model
        self.tokenizer = load_tokenizer(model_dir)
        self.context_length = ContextLength(decode, prefill)
        self.intake = PromptIntake(
            self.tokenizer, served_model, self.context_length.get, max_tokens_limit, parse_timeout_s=body_timeout_s
        )
        self.intake.start()
        self.responses = ResponseWriter(served_model, self.tokenizer.decode)
        from router.routing_state import latest_reports, placement, takes_requests

        self.metrics = RouterMetrics(mode, served_model, reports=latest_reports)
        remote_prefill = RemotePrefillEstimator(lambda: placement("prefill")) if conditional_disaggregation else None
        self.orchestrator = Orchestrator(
            decode,
            prefill,
            request_timeout_s,
            max_retries,
            self._detokenize,
            observer=self.metrics,
            remote_prefill=remote_prefill,
            prefill_pool_down=lambda: takes_requests("prefill") is False,
            decode_pool_down=lambda: takes_requests("colocated" if prefill is None else "decode") is False,
            inter_token_timeout_s=inter_token_timeout_s,
            kv_load_failure_policy=kv_load_failure_policy,
        )
        self.max_concurrent_requests = max_concurrent_requests
        self.keyring = keyring or KeyRing()  # empty: no key asked (ClusterConfig allows that on loopback only)
        self.tenant_gate = TenantGate()
        self.max_body_bytes = max_body_bytes
        self.health_check = self._health_check()
        self.edge_policy = EdgePolicy.for_listener(host, allowed_hosts, allowed_origins)
        self.body_timeout_s = body_timeout_s
        self.num_in_flight = 0
        self.num_admitting = 0  # requests between the room check and their start (body, tokenizer)
        # internal id in flight -> (the client's request id, the decode replica streaming it). Keyed by
        # the router's own id: two requests sent with one X-Request-Id must not share an entry.
        self.serving_replica: dict[str, tuple[str, str]] = {}
        self.scaler = scaler  # cluster.scaling.scale, for POST /pdserve/scale
        self.model_dir = model_dir
        self._resize: asyncio.Future | None = None  # the resize running in a thread, if any
        self.created = int(time.time())
        self.planner: PlannerLoop | None = None
        planner_config = PlannerConfig(**planner) if planner else None
        if planner_config is not None and planner_config.enabled:
            if prefill is None or scaler is None:
                logger.warning("the SLO planner sizes a prefill and a decode pool; this router has none: it is off")
            else:
                self.planner = PlannerLoop(
                    planner_config, pool_shards or {}, latest_reports, self._resize_pools, self.metrics.registry
                )
                self.metrics.slo_window = self.planner.window
                self._planner_task = asyncio.get_running_loop().create_task(self.planner.run())
                logger.info("SLO planner on: %s", planner_config)
        self.loop_lag = LoopLagProbe(self.metrics.loop_lag)
        self._loop_lag_task = asyncio.get_running_loop().create_task(self.loop_lag.run())
        # Serve runs the constructor on the replica's user-code loop: the server runs there too.
        self.listener = HttpListener(
            self._app(),
            host,
            port,
            # Beyond our own admission (503 in OpenAI's format), a backstop of uvicorn's.
            max_connections=2 * max_concurrent_requests + 64,
            drain_timeout_s=request_timeout_s,
            header_timeout_s=header_timeout_s,
        )
        self.listener.start()

    def _app(self) -> Any:
        api = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
        api.add_exception_handler(HTTPException, http_error)
        api.add_api_route("/v1/models", self.models, methods=["GET"])
        api.add_api_route("/health", self.health, methods=["GET"])
        api.add_api_route("/pdserve/status", self.status, methods=["GET"])
        api.add_api_route("/pdserve/scale", self.scale, methods=["POST"])
        api.add_api_route("/metrics", self.prometheus_metrics, methods=["GET"])
        api.add_api_route("/v1/completions", self.completions, methods=["POST"])
        api.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        return RequestIds(EdgeGuard(api, self.edge_policy))

    async def http_address(self) -> tuple[str, int]:
        """Where this replica serves HTTP (port 0 in the config: the port it got)."""
        return self.listener.host, self.listener.port

    def check_health(self) -> None:
        """Serve's health check: a replica whose HTTP server stopped is replaced."""
        failure = self.listener.failure()
        if failure is not None:
            raise RuntimeError(f"the router's HTTP server on port {self.listener.port} stopped: {failure!r}")

    async def __del__(self) -> None:
        """Serve's graceful shutdown: stop accepting, let streams in flight end."""
        listener = getattr(self, "listener", None)  # None: the constructor failed before it
        if listener is not None:
            await listener.stop()
        probe = getattr(self, "_loop_lag_task", None)
        if probe is not None:
            probe.cancel()
        intake = getattr(self, "intake", None)
        if intake is not None:
            await intake.close()

    # --- plain endpoints -------------------------------------------------------------------
    async def models(self, request: Request) -> Any:
        try:
            self.keyring.check_any(request.headers.get("authorization"))
        except Unauthorized as exc:
            return error_response(unauthorized(exc))
        card = {"id": self.served_model, "object": "model", "created": self.created, "owned_by": "pdserve"}
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        """From the replica reports the router has, a shared pool call only where they are missing
        or old (router.health): 200 ok or degraded (no working prefill replica: prompts go to
        decode), 503 when nothing can serve."""
        status, body = await self.health_check.verdict()
        if status == 200:
            body["mode"] = self.mode
        return JSONResponse(body, status_code=status)

    def _health_check(self) -> HealthCheck:
        from router.routing_state import takes_requests_within

        pools = {"colocated": self.decode} if self.prefill is None else {"prefill": self.prefill, "decode": self.decode}
        return HealthCheck(
            pools,
            takes_requests_within,
            lambda handle: asyncio.wait_for(_await(handle.report.remote()), POOL_CALL_TIMEOUT_S),
        )

    async def prometheus_metrics(self) -> Response:
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)

    async def status(self, request: Request) -> Any:
        from router.routing_state import latest_reports

        try:
            self.keyring.check_admin(request.headers.get("authorization"))
        except Unauthorized as exc:
            return error_response(unauthorized(exc))

        # Block hashes stay inside the router: they tell what other tenants' prompts begin with.
        pools = {pool: [_without_hashes(report) for report in reports] for pool, reports in latest_reports().items()}
        return {
            "mode": self.mode,
            "model": self.served_model,
            "router_pid": os.getpid(),  # for operators, as each replica report's pid
            "in_flight": self.num_in_flight,
            "requests": [
                {"id": internal_id, "request_id": request_id, "decode_replica": replica}
                for internal_id, (request_id, replica) in self.serving_replica.items()
            ],
            "pools": pools,
            "metrics": self.metrics.snapshot(),
            "retries": self.orchestrator.num_retries,
            "resumes": self.orchestrator.num_resumes,
            "planner": self.planner.status() if self.planner is not None else None,
            "event_loop_lag_max_s": self.loop_lag.worst_recent_s(),  # the last minute's worst
        }

    async def scale(self, request: Request) -> Any:
        """Admin: resize pools, ``{"decode": 2}``; answers once Serve runs the new counts (the
        scaler, cluster.scaling's: a local cluster's redeploys with only num_replicas changed and
        this router's own keyring and model directory; a declared app's sets the targets through
        Serve's external scaling API; either way the router and its streams stay). One resize
        at a time: 409 while one runs, even one whose caller left."""
        try:
            self.keyring.check_admin(request.headers.get("authorization"))
        except Unauthorized as exc:
            return error_response(unauthorized(exc))
        try:
            body = protocol.decode_body(await read_body(request, 4096, self.body_timeout_s))
            if not isinstance(body, dict) or not body or not all(isinstance(k, str) for k in body):
                raise InvalidRequestError('write the pools to resize as {"decode": 2, "prefill": 1}')
            replicas = await self._resize_pools(body)
        except ConfigError as exc:  # a pool the mode does not have, a count below 1, too few CPUs
            return error_response(protocol.api_error_from_exception(InvalidRequestError(str(exc))))
        except (protocol.ApiError, InvalidRequestError) as exc:
            return error_response(protocol.api_error_from_exception(exc))
        except Exception as exc:  # Serve refused the deploy: the admin sees why
            logger.exception("resize to %s failed", body)
            return error_response(protocol.ApiError(500, f"the resize failed: {exc}", type="server_error"))
        logger.info("pools resized: %s", replicas)
        return {"replicas": replicas}

    async def _resize_pools(self, counts: dict[str, int]) -> dict[str, int]:
        """Every pool's count once Serve runs ``counts`` (the admin's resize, or the planner's)."""
        if self.scaler is None:
            raise InvalidRequestError("this router was started without a scaler (not by cluster.app)")
        if self._resize is not None and not self._resize.done():
            raise protocol.ApiError(409, "another resize is running; retry when it is done", code="conflict")
        resize = asyncio.get_running_loop().run_in_executor(None, self.scaler, counts, self.keyring, self.model_dir)
        self._resize = resize
        return await asyncio.shield(resize)  # a thread cannot be cancelled: it runs to its end

    # --- generation ----------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    async def _handle(self, request: Request, kind: RequestKind) -> Response:
        internal_id, request_id = request_ids(request)
        started = time.monotonic()
        admission = None
        admitting = False
        try:
            # Who and how much before any work: the key, then room (those still being read and
            # tokenized count: the body is held whole), then the tenant's concurrency and rate.
            tenant = self.keyring.tenant(request.headers.get("authorization"))
            in_flight = self.num_in_flight + self.num_admitting + self.intake.num_orphaned
            if in_flight >= self.max_concurrent_requests:
                raise OverloadedError(f"{in_flight} requests in flight (max_concurrent_requests); retry later")
            self.num_admitting += 1
            admitting = True
            admission = self.tenant_gate.admit(tenant) if tenant is not None else None
            raw = await read_body(request, self.max_body_bytes, self.body_timeout_s)
            intake = await self.intake.take(raw, kind, tenant)
            parsed, prompt_ids, prompt_text = intake.parsed, intake.prompt_ids, intake.prompt_text
            if admission is not None:
                self.tenant_gate.charge_tokens(admission, len(prompt_ids) + parsed.sampling.max_tokens)
        except BaseException as exc:
            if admission is not None:  # refused or cancelled before any pool work: nothing was used
                self.tenant_gate.release(admission, 0)
            if not isinstance(exc, Exception):
                raise
            error = refusal(exc)
            self.metrics.request_failed(error.status)
            logger.info("request %s refused (%d): %s", request_id, error.status, error.message)
            return error_response(error)
        finally:
            if admitting:
                self.num_admitting -= 1
        logger.info(
            "request %s (%s): %d prompt tokens, stream=%s", request_id, internal_id, len(prompt_ids), parsed.stream
        )
        self.num_in_flight += 1
        operation = "chat" if parsed.kind == "chat" else "text_completion"
        run = self.orchestrator.run(
            internal_id,
            prompt_ids,
            parsed.sampling,
            tenant_salt(tenant, parsed.cache_salt),
            trace_context=extract(request.headers),  # a client's W3C traceparent: its span is the parent
            span_name=f"{operation} {self.served_model}",
            attributes=_gen_ai_attributes(operation, self.served_model, parsed, request_id),
            arrival_time=started,  # the breakdown of TTFT counts from where the metric's does
        )
        deltas = self._tracked(run, started, internal_id, request_id, len(prompt_ids), admission)
        try:
            first = await unless_client_left(request, deltas.__anext__())  # refusals surface here
        except ClientLeft:
            await deltas.aclose()
            logger.info("request %s: the client left before its first token", request_id)
            return Response(status_code=499)  # nobody reads it
        except Exception as exc:
            await deltas.aclose()
            error = protocol.api_error_from_exception(exc)
            self.metrics.request_failed(error.status)
            logger.warning("request %s failed before its first token (%d): %s", request_id, error.status, exc)
            return error_response(error)
        if first.error is not None:  # failed before any token: nothing is sent yet, so a status says it
            await deltas.aclose()
            logger.warning("request %s failed: %s", request_id, first.error)
            return error_response(failed())
        headers: dict[str, str] = {}
        response_id = ("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + internal_id
        if parsed.stream:
            events = self.responses.sse(parsed, response_id, prompt_ids, prompt_text, first, deltas)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            collected = self.responses.collect(parsed, response_id, prompt_ids, prompt_text, first, deltas, headers)
            return await unless_client_left(request, collected)
        except ClientLeft:
            logger.info("request %s: the client left before its answer", request_id)
            return Response(status_code=499)
        except Exception:
            logger.exception("request %s failed", request_id)
            return error_response(failed())
        finally:
            await deltas.aclose()

    async def _tracked(
        self,
        deltas: AsyncIterator[StreamDelta],
        started: float,
        internal_id: str,
        request_id: str,
        num_prompt: int,
        admission: Admission | None = None,
    ):
        """Counts the request in flight (and against its tenant's limits) until it ends, and records
        its latencies and outcome."""
        first_token_time = last_token_time = None
        num_tokens = 0
        outcome: str | None = "cancelled"
        finish_reason = None
        yielded = False
        metrics = self.metrics
        metrics.request_started()
        try:
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    self.serving_replica[internal_id] = (request_id, delta.replica_id)
                    if delta.new_token_ids:
                        now = time.monotonic()
                        if first_token_time is None:
                            first_token_time = now
                            metrics.first_token(now - started)
                            metrics.tokens_arrived(len(delta.new_token_ids) - 1, 0.0)
                        else:
                            metrics.tokens_arrived(len(delta.new_token_ids), now - last_token_time)
                        last_token_time = now
                    num_tokens += len(delta.new_token_ids)
                    if delta.finish_reason is not None:
                        outcome = "error" if delta.error else "ok"
                        finish_reason = delta.finish_reason
                        metrics.phases(delta.queue_time_s, delta.prefill_time_s)  # colocated: from the engine
                        if delta.ttft_breakdown is not None:
                            metrics.ttft_breakdown(delta.ttft_breakdown)
                    yielded = True
                    yield delta
        except (GeneratorExit, asyncio.CancelledError):
            raise  # the client left: "cancelled"
        except BaseException:
            # Before any delta: a refusal raised to _handle, which answers with its status and counts
            # it. After: the request failed in the cluster.
            outcome = "error" if yielded else None
            raise
        finally:
            self.num_in_flight -= 1
            if admission is not None:  # unused max_tokens come back; a refusal by a pool (outcome None) used none
                self.tenant_gate.release(admission, num_prompt + num_tokens if outcome is not None else 0)
            self.serving_replica.pop(internal_id, None)
            metrics.request_ended(outcome, started, first_token_time, num_tokens, num_prompt, finish_reason)
            logger.info("request %s ended: %s, %d tokens", request_id, outcome or "refused", num_tokens)

    def _detokenize(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
