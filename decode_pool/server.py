"""The decode pool's replica (a Ray Serve deployment class; cluster.app applies the options).

A request's life on a decode replica::

    WAITING_FOR_BLOCKS ──▶ RESERVED ── KV lands on every shard ──▶ RUNNING ──▶ FINISHED (stop | length)
       │ queue full,          │  lease expires, transfer fails,       │ client gone / engine failure
       ▼ deadline passed      ▼  client gone                          ▼
    OVERLOADED (503)        FAILED (blocks freed, error delta)      ABORTED | FAILED (blocks freed)

``generate`` first yields a ``TicketIssued`` (blocks reserved; the router hands the ticket to a
prefill replica), then one ``StreamDelta`` per engine step that produced tokens. In colocated
mode the same replica runs the prefill too: no ticket, the deltas start at once. With conditional
disaggregation (the request carries the router's ``remote_prefill`` estimate) a decode replica
may compute the prompt itself when that is cheaper (decode_pool.prefill_site): no ticket either.
A request marked ``prefill_here`` (the prefill pool failed it, or has no working replica) is computed here
whatever the estimate: the pools degrade to colocated serving until the prefill pool recovers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from common import tracing
from common.config import EngineConfig, EngineRole
from common.errors import EngineStopped, InvalidRequestError, OverloadedError
from common.logs import setup_logging
from common.outputs import RequestMetrics, RequestOutput
from common.sampling_params import SamplingParams
from common.serving import ServeRequest, StreamDelta, TicketIssued
from common.tracing import setup_tracing
from decode_pool.kv_address import resolve_node_address
from decode_pool.prefill_site import LocalState, PrefillSite, choose_prefill_site
from decode_pool.stream_interval import every_n_tokens
from engine.executor import WorkerLauncher
from engine.llm_engine import LLMEngine
from engine.replica import EngineReplica, serve_replica_id, start_replica_engine
from kv_transfer import make_ticket

logger = logging.getLogger(__name__)


def to_delta(outputs: list[RequestOutput], replica_id: str, with_timings: bool = False) -> StreamDelta:
    """One delta for consecutive outputs of a request (the last one's state, every one's tokens).
    ``with_timings`` (colocated: this engine ran the prompt too): the finished delta carries the
    prompt's queue and prefill times."""
    last = outputs[-1]
    completion = last.outputs[0]
    new_ids = [t for o in outputs for t in o.outputs[0].new_token_ids]
    logprobs = [lp for o in outputs for lp in (o.outputs[0].new_logprobs or ())]
    prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    queue_time_s = prefill_time_s = None
    metrics = last.metrics
    if with_timings and last.finished and metrics is not None and metrics.first_scheduled_time is not None:
        queue_time_s = metrics.first_scheduled_time - metrics.arrival_time
        if metrics.first_token_time is not None:
            prefill_time_s = metrics.first_token_time - metrics.first_scheduled_time
    return StreamDelta(
        request_id=last.request_id,
        new_token_ids=new_ids,
        new_text="".join(o.outputs[0].new_text for o in outputs),
        logprobs=logprobs or None,
        prompt_logprobs=prompt_logprobs,
        finish_reason=completion.finish_reason if last.finished else None,
        stop_reason=completion.stop_reason,
        error=last.error,
        num_prompt_tokens=len(last.prompt_token_ids),
        num_cached_tokens=last.num_cached_tokens,
        replica_id=replica_id,
        queue_time_s=queue_time_s,
        prefill_time_s=prefill_time_s,
    )


class DecodeServer(EngineReplica):
    def __init__(
        self,
        engine_config: dict,
        launcher: WorkerLauncher | None = None,
        kv_lease: tuple[float, float] = (30.0, 0.0),
        item_timeout_s: float = 600.0,
        cores: int | None = None,
        stream_interval: int = 1,
        tracing: tuple[str, str | None] = ("none", None),
    ) -> None:
        setup_logging()
        config = EngineConfig.from_dict(resolve_node_address(engine_config))
        setup_tracing(tracing[0], f"pdserve-{config.scheduler.role.value}", tracing[1])
        limit = config.scheduler.max_num_waiting
        engine, claim = start_replica_engine(config, launcher, cores, max_waiting_for_room=limit)
        super().__init__(engine, serve_replica_id(), claim)
        self.colocated = config.scheduler.role is EngineRole.COLOCATED
        self.backend = config.kv_connector.options.get("backend", "shm")
        self.kv_lease_s, self.kv_lease_per_token_s = kv_lease  # base, and per prompt token
        self.item_timeout_s = item_timeout_s
        self.reserve_timeout_s = min(self.kv_lease_s, item_timeout_s)
        self.stream_interval = stream_interval  # tokens per delta after the first (decode_pool.stream_interval)
        logger.info("decode replica %s ready (%s)", self.replica_id, config.scheduler.role.value)

    async def generate(self, request: ServeRequest) -> AsyncIterator[TicketIssued | StreamDelta]:
        timeline = DecodeTimeline(time.monotonic()) if tracing.enabled() else None
        try:
            # aclosing: a caller gone mid-stream closes the request's stream now (it aborts the request).
            async with contextlib.aclosing(self._generate(request, timeline)) as items:
                async for item in items:
                    yield item
        finally:
            if timeline is not None:
                timeline.ended = time.monotonic()
                record_decode_spans(request, timeline, self.replica_id, self.colocated)

    async def _generate(
        self, request: ServeRequest, timeline: DecodeTimeline | None
    ) -> AsyncIterator[TicketIssued | StreamDelta]:
        request_id = request.request_id
        try:
            params = SamplingParams.from_dict(request.sampling)
        except InvalidRequestError as exc:
            yield _error_delta(request_id, f"invalid_request: {exc}", self.replica_id)
            return
        outputs = self.engine.open_stream(request_id)
        prefilled_here = self.colocated
        try:
            if self.colocated:
                await self.engine.call(
                    lambda e: e.add_request(request_id, request.prompt_token_ids, params, request.cache_salt)
                )
            else:
                # A burst waits for blocks in the engine's bounded FIFO, woken as blocks free.
                place = lambda e: self._place_prompt(e, request, params)  # noqa: E731
                ticket, site = await self.engine.call_when_room(place, self.reserve_timeout_s)
                if timeline is not None:
                    timeline.prefill_site = site
                prefilled_here = site is not None and site.local
                if ticket is not None:
                    if timeline is not None:
                        timeline.ticket_issued = time.monotonic()
                    yield TicketIssued(request_id, ticket, self.replica_id)
        except (InvalidRequestError, OverloadedError, EngineStopped) as exc:
            self.engine.close_stream(request_id)
            yield _error_delta(request_id, f"{_refusal_kind(exc)}: {exc}", self.replica_id)
            return
        except BaseException:
            self.engine.close_stream(request_id)
            self.engine.abort_soon(request_id)
            raise
        # aclosing: a caller gone while tokens are held back still aborts the request now.
        async with contextlib.aclosing(self.engine.stream(request_id, outputs, self.item_timeout_s)) as stream:
            batches = every_n_tokens(stream, self.stream_interval) if self.stream_interval > 1 else stream
            async for batch in batches:
                delta = to_delta(batch, self.replica_id, prefilled_here)
                if timeline is not None:
                    timeline.saw(delta, batch[-1])
                yield delta

    def _place_prompt(
        self, engine: LLMEngine, request: ServeRequest, params: SamplingParams
    ) -> tuple[dict | None, PrefillSite | None] | None:
        """On the engine thread: compute the prompt here (queued as a colocated request) or reserve
        blocks for the prefill pool's KV. (ticket or None, the decision if one was weighed); None:
        no room for the reservation yet (call_when_room tries again as blocks free)."""
        site = None
        if request.prefill_here:
            engine.add_request(request.request_id, request.prompt_token_ids, params, request.cache_salt)
            return None, _FAILED_OVER
        if request.remote_prefill is not None:
            site = self._weigh_prefill_site(engine, request)
            if site.local:
                engine.add_request(request.request_id, request.prompt_token_ids, params, request.cache_salt)
                return None, site
        ticket = self._reserve(engine, request, params)
        return None if ticket is None else (ticket, site)

    def _weigh_prefill_site(self, engine: LLMEngine, request: ServeRequest) -> PrefillSite:
        assert request.remote_prefill is not None
        prompt = request.prompt_token_ids
        stall_s = engine.config.scheduler.max_decode_stall_s
        why_not = None
        if stall_s is None:  # its prompts would hold up the running batch for their whole length
            why_not = "remote: this replica does not chunk prompts beside decodes (no max_decode_stall_s)"
        elif not engine.can_accept():
            why_not = "remote: this replica's waiting queue is full"
        if why_not is not None:
            return PrefillSite(False, why_not, math.inf, request.remote_prefill.seconds(len(prompt)))
        local = LocalState(
            num_cached_tokens=engine.cached_prefix_tokens(prompt, request.cache_salt),
            num_queued_tokens=engine.scheduler.num_prefill_tokens_queued(),
            tokens_per_s=engine.prefill_tokens_per_s,
            num_running=engine.scheduler.num_decoding(),
            decode_step_s=engine.decode_step_s,
            chunk_tokens=engine.prompt_token_cap() or 0,
        )
        return choose_prefill_site(len(prompt), request.remote_prefill, local, stall_s)

    def _reserve(self, engine: LLMEngine, request: ServeRequest, params: SamplingParams) -> dict | None:
        """On the engine thread: hold blocks, register the ticket on every shard, return it (None: no room)."""
        request_id = request.request_id
        block_ids = engine.reserve(request_id, request.prompt_token_ids, params, request.cache_salt)
        if block_ids is None:
            return None
        ticket = make_ticket(
            request_id,
            self.backend,
            engine.kv_endpoints,
            engine.layout,
            engine.model_id,
            block_ids,
            len(request.prompt_token_ids),
            self.kv_lease_s + self.kv_lease_per_token_s * len(request.prompt_token_ids),
        ).to_dict()
        engine.expect_kv(request_id, ticket)
        return ticket


def _refusal_kind(exc: Exception) -> str:
    """How a refusal before any work reads in its error delta (router.orchestrator parses it).
    "unavailable" is this replica's alone (its engine stopped): another replica can take the request."""
    if isinstance(exc, OverloadedError):
        return "overloaded"
    if isinstance(exc, EngineStopped):
        return "unavailable"
    return "invalid_request"


# Not weighed: no estimate of either side is made when the prefill pool has just failed the request.
_FAILED_OVER = PrefillSite(
    True, "local: the prefill pool failed this request or has no working replica", math.nan, math.nan
)


@dataclass(slots=True)
class DecodeTimeline:
    """A request's moments on this replica, kept only while tracing (time.monotonic())."""

    started: float
    ticket_issued: float | None = None
    first_token: float | None = None
    ended: float | None = None
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None  # the engine's, for a colocated request's queue and prefill
    prefill_site: PrefillSite | None = None  # conditional disaggregation's decision, when one was weighed

    def saw(self, delta: StreamDelta, last: RequestOutput) -> None:
        if delta.new_token_ids and self.first_token is None:
            self.first_token = time.monotonic()
        self.num_tokens += len(delta.new_token_ids)
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.error = delta.error or self.error
        self.metrics = last.metrics


def record_decode_spans(request: ServeRequest, timeline: DecodeTimeline, replica_id: str, colocated: bool) -> None:
    """The request's spans on this replica, under the router's attempt span. Disaggregated: the
    wait for KV blocks (reserve), the wait for prefill's KV (kv_wait, ticket to first token), then
    generation. Colocated, or a prompt computed here (conditional disaggregation, whose decision
    and reason are attributes of the replica's span): the prompt's queue and chunk steps (as a
    prefill replica's), then generation."""
    end = timeline.ended if timeline.ended is not None else time.monotonic()
    attributes = {
        "pdserve.replica": replica_id,
        "pdserve.pool_request_id": request.request_id,
        "gen_ai.usage.output_tokens": timeline.num_tokens,
    }
    if timeline.finish_reason is not None:
        attributes["gen_ai.response.finish_reasons"] = [timeline.finish_reason]
    site = timeline.prefill_site
    if site is not None:
        attributes["pdserve.prefill_site"] = site.name
        attributes["pdserve.prefill_site.reason"] = site.reason
    name = "pdserve.colocated" if colocated else "pdserve.decode"
    parent = tracing.extract(request.trace_context)
    context = tracing.record_span(name, timeline.started, end, parent, attributes, timeline.error)
    metrics = timeline.metrics
    prefilled_here = colocated or (site is not None and site.local)
    if prefilled_here and metrics is not None and metrics.first_scheduled_time is not None:
        tracing.record_span("pdserve.prefill.queue", metrics.arrival_time, metrics.first_scheduled_time, context)
        for start, stop, num_tokens in metrics.prefill_chunks:
            tracing.record_span("pdserve.prefill.chunk", start, stop, context, {"pdserve.num_tokens": num_tokens})
    if timeline.ticket_issued is not None:
        tracing.record_span("pdserve.decode.reserve", timeline.started, timeline.ticket_issued, context)
        tracing.record_span("pdserve.decode.kv_wait", timeline.ticket_issued, timeline.first_token or end, context)
    if timeline.first_token is not None:
        tracing.record_span(
            "pdserve.decode.generate", timeline.first_token, end, context, {"pdserve.num_tokens": timeline.num_tokens}
        )


def _error_delta(request_id: str, error: str, replica_id: str) -> StreamDelta:
    return StreamDelta(request_id, [], "", finish_reason="error", error=error, replica_id=replica_id)
