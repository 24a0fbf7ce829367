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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from common.errors import OverloadedError
from common.generation_config import sampling_defaults
from common.logs import setup_logging
from common.serving import StreamDelta
from common.tracing import extract, setup_tracing
from router import protocol
from router.admin import AdminRoutes, Resizer
from router.auth import Admission, KeyRing, Tenant, TenantGate, tenant_salt
from router.choices import merged_choices
from router.context_length import POOL_CALL_TIMEOUT_S, ContextLength
from router.edge_guard import EdgeGuard, EdgePolicy
from router.genai_attributes import gen_ai_attributes
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
    unless_client_left,
)
from router.http_listener import HttpListener, TlsFiles
from router.intake import Intake, PromptIntake, load_tokenizer
from router.loop_lag import LoopLagProbe
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.planner_loop import PlannerLoop
from router.protocol import RequestKind
from router.remote_prefill import RemotePrefillEstimator
from router.responses import ResponseWriter
from router.structured_request import ConstraintLimits
from router.tokenizer_routes import TokenizerRoutes
from router.tool_calling import ToolCalling

logger = logging.getLogger("pdserve.router")
# A request body is read whole before parsing: this bounds what one client can make the router hold.
DEFAULT_MAX_BODY_BYTES = 32 * 2**20


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
        max_n: int = 16,
        priority_scheduling: bool = False,
        kv_load_failure_policy: str = "recompute",
        chat_template: str | None = None,
        constraint_limits: tuple[int, int] | None = None,
        tool_calling: tuple[str, bool] = ("auto", True),
        ssl_keyfile: str | None = None,
        ssl_certfile: str | None = None,
        access_log: bool = False,
    ) -> None:
        """``planner``: router.planner.PlannerConfig's fields (its SLO planner resizes the pools through
        ``scaler``; disaggregated mode); ``pool_shards``: each pool's shards per replica (its budget).
        ``chat_template``: the template's text, replacing the model's (vLLM's --chat-template)."""
        setup_logging()
        setup_tracing(tracing[0], "pdserve-router", tracing[1])

        decode, prefill = _over_grpc(decode), _over_grpc(prefill)
        self.decode = decode
        self.prefill = prefill
        self.mode = mode
        self.served_model = served_model
        self.tokenizer = load_tokenizer(model_dir)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        self.context_length = ContextLength(decode, prefill)
        self.intake = PromptIntake(
            self.tokenizer,
            served_model,
            self.context_length.get,
            max_tokens_limit,
            parse_timeout_s=body_timeout_s,
            max_choices=max_n,
            sampling_defaults=sampling_defaults(model_dir),
            priority_scheduling=priority_scheduling,
            tool_calling=ToolCalling.configure(
                *tool_calling, self.tokenizer.chat_template, frozenset(self.tokenizer.all_special_tokens)
            ),
            constraint_limits=ConstraintLimits(*constraint_limits) if constraint_limits else ConstraintLimits(),
        )
        self.intake.start()
        self.responses = ResponseWriter(served_model, self.tokenizer.decode, self.intake.tool_calling)
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
        self.health_check = HealthCheck.for_pools(decode, prefill, POOL_CALL_TIMEOUT_S)
        self.edge_policy = EdgePolicy.for_listener(host, allowed_hosts, allowed_origins)
        self.body_timeout_s = body_timeout_s
        self.num_in_flight = 0
        self.num_admitting = 0  # requests between the room check and their start (body, tokenizer)
        # internal id in flight -> (the client's request id, the decode replica streaming it). Keyed by
        # the router's own id: two requests sent with one X-Request-Id must not share an entry.
        self.serving_replica: dict[str, tuple[str, str]] = {}
        self.resizer = Resizer(scaler, self.keyring, model_dir)  # cluster.scaling.scale: POST /pdserve/scale
        both_pools = prefill is not None and scaler is not None
        self.planner = PlannerLoop.start(planner, both_pools, pool_shards or {}, self.resizer.resize, self.metrics)
        self.loop_lag = LoopLagProbe(self.metrics.loop_lag)
        admin_parts = (self.metrics, self.health_check, self.resizer, self._status, body_timeout_s)
        self.admin = AdminRoutes(self.keyring, served_model, mode, *admin_parts, self.context_length.get)
        limits = (max_body_bytes, body_timeout_s)
        self.tokenizer_routes = TokenizerRoutes(
            self.keyring, self.intake, served_model, self.context_length.get, *limits
        )
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
            tls=TlsFiles.of(ssl_keyfile, ssl_certfile),
            access_log=access_log,
        )
        self.listener.start()

    def _app(self) -> Any:
        api = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
        api.add_exception_handler(HTTPException, http_error)
        admin = self.admin
        api.add_api_route("/v1/models", admin.models, methods=["GET"])
        api.add_api_route("/v1/models/{model_id:path}", admin.model, methods=["GET"])
        api.add_api_route("/version", admin.version, methods=["GET"])
        api.add_api_route("/tokenize", self.tokenizer_routes.tokenize, methods=["POST"])
        api.add_api_route("/detokenize", self.tokenizer_routes.detokenize, methods=["POST"])
        api.add_api_route("/health", admin.health, methods=["GET"])
        api.add_api_route("/pdserve/status", admin.status, methods=["GET"])
        api.add_api_route("/pdserve/scale", admin.scale, methods=["POST"])
        api.add_api_route("/metrics", admin.prometheus_metrics, methods=["GET"])
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

    def _status(self) -> dict[str, Any]:
        """GET /pdserve/status's part from this router (router.admin adds the replicas' reports)."""
        return {
            "mode": self.mode,
            "model": self.served_model,
            "router_pid": os.getpid(),  # for operators, as each replica report's pid
            "in_flight": self.num_in_flight,
            "requests": [
                {"id": internal_id, "request_id": request_id, "decode_replica": replica}
                for internal_id, (request_id, replica) in self.serving_replica.items()
            ],
            "metrics": self.metrics.snapshot(),
            "retries": self.orchestrator.num_retries,
            "resumes": self.orchestrator.num_resumes,
            "planner": self.planner.status() if self.planner is not None else None,
            "event_loop_lag_max_s": self.loop_lag.worst_recent_s(),  # the last minute's worst
        }

    # --- generation ----------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    async def _handle(self, request: Request, kind: RequestKind) -> Response:
        internal_id, request_id = request_ids(request)
        started = time.monotonic()
        admitted = await self._admit(request, kind, request_id)
        if isinstance(admitted, Response):
            return admitted
        tenant, admission, intake = admitted
        parsed, prompt_ids = intake.parsed, intake.prompt_ids
        logger.info(
            "request %s (%s): %d prompt tokens, stream=%s", request_id, internal_id, len(prompt_ids), parsed.stream
        )
        self.num_in_flight += 1
        operation = "chat" if parsed.kind == "chat" else "text_completion"
        salt = tenant_salt(tenant, parsed.cache_salt)
        trace_context = extract(request.headers)  # a client's W3C traceparent: its span is the parent
        n = parsed.sampling.n
        attributes = gen_ai_attributes(operation, self.served_model, parsed, request_id)

        def run_choice(index: int) -> AsyncIterator[StreamDelta]:
            prompt = intake.prompt_of(index)
            return self.orchestrator.run(
                internal_id if intake.num_choices == 1 else f"{internal_id}-{index}",
                prompt.ids,
                # A prompt's first choice scores it (prompt_logprobs) for all of them.
                prompt.sampling.for_choice(index % n, score_prompt=index % n == 0),
                salt,
                trace_context=trace_context,
                span_name=f"{operation} {self.served_model}",
                attributes=attributes | ({"pdserve.choice.index": index} if intake.num_choices > 1 else {}),
                arrival_time=started,  # the breakdown of TTFT counts from where the metric's does
                # A prompt's later choices start once its KV sits in its first choice's decode
                # replica's prefix cache, where placement sends them: computed there, not moved again.
                prefill_here=index % n != 0,
            )

        run = merged_choices(run_choice, len(intake.prompts), n)
        deltas = self._tracked(
            run, started, internal_id, request_id, intake.num_prompt_tokens, admission, intake.num_choices
        )
        return await self._respond(request, intake, deltas, internal_id, request_id)

    async def _admit(
        self, request: Request, kind: RequestKind, request_id: str
    ) -> tuple[Tenant | None, Admission | None, Intake] | Response:
        """Who and how much before any work: the key, then room (those still being read and
        tokenized count: the body is held whole), then the tenant's concurrency and rate; then the
        body, read and taken in (router.intake). A refusal is the response to send."""
        admission = None
        admitting = False
        try:
            tenant = self.keyring.tenant(request.headers.get("authorization"))
            in_flight = self.num_in_flight + self.num_admitting + self.intake.num_orphaned
            if in_flight >= self.max_concurrent_requests:
                raise OverloadedError(f"{in_flight} requests in flight (max_concurrent_requests); retry later")
            self.num_admitting += 1
            admitting = True
            admission = self.tenant_gate.admit(tenant) if tenant is not None else None
            raw = await read_body(request, self.max_body_bytes, self.body_timeout_s)
            intake = await self.intake.take(raw, kind, tenant)
            if admission is not None:
                n = intake.parsed.sampling.n
                most = intake.num_prompt_tokens + n * sum(prompt.sampling.max_tokens for prompt in intake.prompts)
                self.tenant_gate.charge_tokens(admission, most)
            return tenant, admission, intake
        except BaseException as exc:
            if admission is not None:  # refused or cancelled before any pool work: nothing was used
                self.tenant_gate.release(admission, 0)
            if not isinstance(exc, Exception):
                raise
            error = refusal(exc)
            unsupported = error.param if error.code == "unsupported_parameter" else None
            self.metrics.request_failed(error.status, refused_field=unsupported)
            logger.info("request %s refused (%d): %s", request_id, error.status, error.message)
            return error_response(error)
        finally:
            if admitting:
                self.num_admitting -= 1

    async def _respond(
        self, request: Request, intake: Intake, deltas: AsyncIterator[StreamDelta], internal_id: str, request_id: str
    ) -> Response:
        """The answer once the pools have the request: a status while nothing is sent (a refusal or
        a failure before the first token), else the JSON body or the event stream."""
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
        parsed = intake.parsed
        response_id = ("chatcmpl-" if parsed.kind == "chat" else "cmpl-") + internal_id
        if parsed.stream:
            events = self.responses.sse(intake, response_id, first, deltas)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            collected = self.responses.collect(intake, response_id, first, deltas, {})
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
        num_choices: int = 1,
    ):
        """Counts the request in flight (and against its tenant's limits) until it ends, and records
        its latencies and outcome."""
        first_token_time = last_token_time = None
        num_tokens = 0
        outcome: str | None = "cancelled"
        finish_reason = None
        yielded = False
        metrics = self.metrics
        metrics.request_started(num_choices)
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
                    if delta.finish_reason is not None:  # of one choice: an error in any is the request's
                        outcome = "error" if delta.error or outcome == "error" else "ok"
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
