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
import dataclasses
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from common.block_hash import SHORT_HASH_BYTES
from common.errors import ConfigError, InvalidRequestError, OverloadedError
from common.logs import setup_logging
from common.serving import StreamDelta
from common.tokenizer_files import generic_fast_tokenizer
from common.tracing import extract, setup_tracing
from router import protocol
from router.auth import (
    Admission,
    KeyRing,
    Tenant,
    TenantGate,
    Unauthorized,
    tenant_salt,
)
from router.edge_guard import EdgeGuard, EdgePolicy
from router.fair_queue import FairQueue
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
from router.loop_lag import LoopLagProbe
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.parse_process import ParseProcess
from router.planner import PlannerConfig
from router.planner_loop import PlannerLoop
from router.prompt_bounds import (
    PromptBounds,
    check_length,
    check_prompt_chars,
    check_token_ids,
)
from router.protocol import ParsedRequest, RequestKind
from router.remote_prefill import RemotePrefillEstimator
from router.responses import ResponseWriter

logger = logging.getLogger("pdserve.router")
_T = TypeVar("_T")
_POOL_CALL_TIMEOUT_S = 10.0
# A request body is read whole before parsing: this bounds what one client can make the router hold.
DEFAULT_MAX_BODY_BYTES = 32 * 2**20
# A body or a list of prompt token ids past these is parsed and checked on a thread of its own: a
# 30 MiB list of ids held every stream for seconds when it was checked on the event loop.
PARSE_ON_LOOP_MAX_BYTES = 256 * 2**10
# Past this, the body is parsed in the parse process: json.loads holds the GIL ~12 ms per MiB.
PARSE_IN_PROCESS_MIN_BYTES = 2 * 2**20
CHECK_IDS_ON_LOOP_MAX = 4096


def _load_tokenizer(model_dir: str) -> Any:
    """The generic fast class where it loads the same tokenizer (common.tokenizer_files): ~1.8 s
    less at start than AutoTokenizer, which imports transformers' model configurations."""
    if generic_fast_tokenizer(model_dir):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _decode_and_parse(raw: bytes, kind: RequestKind, served_model: str) -> ParsedRequest:
    parse = protocol.parse_chat_request if kind == "chat" else protocol.parse_completion_request
    return parse(protocol.decode_body(raw), served_model)


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
        self.tokenizer = _load_tokenizer(model_dir)
        self.vocab_size = len(self.tokenizer)
        # No token is longer than this many characters (a vocabulary entry's raw form is at least as
        # long as the text it decodes to), so a prompt of more than max_model_len times it cannot fit.
        self.max_token_chars = max(len(token) for token in self.tokenizer.get_vocab())
        # One thread: tokenizing (long for a long prompt) stays off the event loop, and no two
        # encodes run at once in one fast tokenizer (each borrows its Rust state mutably). Tenants
        # take turns on it (router.fair_queue): one tenant's queue of long prompts holds no other.
        self._tokenizer = FairQueue("pdserve-tokenize")
        # Large bodies' JSON and long token-id lists: off the loop, and not queued behind prompts.
        self._parse_thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-parse")
        # Bodies past PARSE_IN_PROCESS_MIN_BYTES: their parse would hold the GIL, so the loop.
        self.parse_process = ParseProcess(timeout_s=body_timeout_s)
        self._parse_process_start = asyncio.get_running_loop().create_task(self.parse_process.start())
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
        self.max_tokens_limit = max_tokens_limit
        self.health_check = self._health_check()
        self.edge_policy = EdgePolicy.for_listener(host, allowed_hosts, allowed_origins)
        self.body_timeout_s = body_timeout_s
        self.num_in_flight = 0
        self.num_admitting = 0  # requests between the room check and their start (body, tokenizer)
        # internal id in flight -> (the client's request id, the decode replica streaming it). Keyed by
        # the router's own id: two requests sent with one X-Request-Id must not share an entry.
        self.serving_replica: dict[str, tuple[str, str]] = {}
        self.max_model_len: int | None = None
        self._max_model_len_ask: asyncio.Future[tuple[int, bool]] | None = None
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
        parse_process = getattr(self, "parse_process", None)
        if parse_process is not None:
            await parse_process.close()
        tokenizer = getattr(self, "_tokenizer", None)
        if tokenizer is not None:
            tokenizer.shutdown()
        parse_thread = getattr(self, "_parse_thread", None)
        if parse_thread is not None:
            parse_thread.shutdown(wait=False, cancel_futures=True)

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
            lambda handle: asyncio.wait_for(_await(handle.report.remote()), _POOL_CALL_TIMEOUT_S),
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
            if self.num_in_flight + self.num_admitting >= self.max_concurrent_requests:
                in_flight = self.num_in_flight + self.num_admitting
                raise OverloadedError(f"{in_flight} requests in flight (max_concurrent_requests); retry later")
            self.num_admitting += 1
            admitting = True
            admission = self.tenant_gate.admit(tenant) if tenant is not None else None
            raw = await read_body(request, self.max_body_bytes, self.body_timeout_s)
            if len(raw) > PARSE_IN_PROCESS_MIN_BYTES:
                # Parsing it here would hold the GIL, so the loop, for as long (router.parse_process).
                bounds = PromptBounds(await self._max_model_len(), self.max_token_chars, self.vocab_size)
                raw = await self.parse_process.reduce(raw, kind, self.served_model, bounds)
            parsed: ParsedRequest
            if len(raw) > PARSE_ON_LOOP_MAX_BYTES:
                work = functools.partial(_decode_and_parse, raw, kind, self.served_model)
                parsed = await asyncio.get_running_loop().run_in_executor(self._parse_thread, work)
            else:
                parsed = _decode_and_parse(raw, kind, self.served_model)
            parsed = self._within_max_tokens_limit(parsed)
            max_model_len = await self._max_model_len()
            check_prompt_chars(parsed, max_model_len, self.max_token_chars)
            prompt_ids, prompt_text = await self._tokenize_off_loop(parsed, tenant)
            check_length(prompt_ids, max_model_len)
            # As OpenAI does: no more tokens than the context has room for after the prompt.
            max_tokens = min(parsed.sampling.max_tokens, max_model_len - len(prompt_ids))
            parsed = dataclasses.replace(parsed, sampling=dataclasses.replace(parsed.sampling, max_tokens=max_tokens))
            if admission is not None:
                self.tenant_gate.charge_tokens(admission, len(prompt_ids) + max_tokens)
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

    def _within_max_tokens_limit(self, parsed: ParsedRequest) -> ParsedRequest:
        """router.max_tokens_limit: more asked is refused, naming the field; a default is cut to it."""
        limit = self.max_tokens_limit
        if limit is None or parsed.sampling.max_tokens <= limit:
            return parsed
        if parsed.max_tokens_field is not None:
            raise protocol.ApiError(
                400,
                f"{parsed.max_tokens_field}={parsed.sampling.max_tokens} is more than this server's limit of "
                f"{limit} tokens (router.max_tokens_limit)",
                param=parsed.max_tokens_field,
            )
        return dataclasses.replace(parsed, sampling=dataclasses.replace(parsed.sampling, max_tokens=limit))

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

    def _tokenize(self, parsed: ParsedRequest) -> tuple[list[int], str | None]:
        if parsed.kind == "chat":
            assert parsed.messages is not None
            ids = self.tokenizer.apply_chat_template(
                parsed.messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            return list(ids), None
        if isinstance(parsed.prompt, str):
            if not parsed.prompt:
                raise InvalidRequestError("the prompt is empty; give at least one token", param="prompt")
            return self.tokenizer.encode(parsed.prompt), parsed.prompt
        ids = list(parsed.prompt or [])
        check_token_ids(ids, self.vocab_size)
        return ids, None

    async def _tokenize_off_loop(self, parsed: ParsedRequest, tenant: Tenant | None) -> tuple[list[int], str | None]:
        if parsed.kind == "completion" and not isinstance(parsed.prompt, str):
            if len(parsed.prompt or []) <= CHECK_IDS_ON_LOOP_MAX:
                return self._tokenize(parsed)  # token ids: only their range is checked
            return await asyncio.get_running_loop().run_in_executor(self._parse_thread, self._tokenize, parsed)
        # No keys (tenant None): one queue for every client.
        job = self._tokenizer.submit(tenant.name if tenant is not None else "", self._tokenize, parsed)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if job.cancel():  # the client left while its job waited for the tokenizer: it never runs
                raise
            if not job.done():  # the client left mid-tokenizing: the work goes on, and keeps its place
                self.num_admitting += 1
                loop = asyncio.get_running_loop()
                job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._tokenized_for_nobody))
            raise

    def _tokenized_for_nobody(self) -> None:
        self.num_admitting -= 1

    async def _max_model_len(self) -> int:
        """The pools' context length (the smaller), asked once: a burst reaching a fresh router
        waits for one answer, instead of putting one call per request in the pools' bounded queues
        (which refuse the rest). A failed ask is asked again by the next request."""
        if self.max_model_len is None:
            if self._max_model_len_ask is None or self._max_model_len_ask.done():
                self._max_model_len_ask = asyncio.ensure_future(self._ask_max_model_len())
            # Shielded: a client that leaves does not cancel the ask the others wait for.
            max_model_len, every_pool = await asyncio.shield(self._max_model_len_ask)
            if not every_pool:
                return max_model_len  # the prefill pool was down: not kept, asked again later
            self.max_model_len = max_model_len
        return self.max_model_len

    async def _ask_max_model_len(self) -> tuple[int, bool]:
        """(the smaller context length, whether every pool answered): a prefill pool whose replicas
        are all failed or being replaced is not asked (the call would wait for the new one)."""
        from router.routing_state import takes_requests

        report = await asyncio.wait_for(_await(self.decode.report.remote()), _POOL_CALL_TIMEOUT_S)
        if self.prefill is None:
            return report["max_model_len"], True
        if takes_requests("prefill") is False:
            return report["max_model_len"], False
        prefill = await asyncio.wait_for(_await(self.prefill.report.remote()), _POOL_CALL_TIMEOUT_S)
        return min(report["max_model_len"], prefill["max_model_len"]), True

    def _detokenize(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
