"""One request's way through the pools, with retries and resumption.

Disaggregated::

    decode.generate(req) ──▶ TicketIssued ──▶ prefill.prefill(req + ticket)     (concurrently)
                         ──▶ StreamDelta, StreamDelta, … (finish_reason on the last)

Colocated: ``decode.generate(req)`` on the colocated pool yields the deltas directly.

Failures (each attempt is a fresh request id on the pools, ``<id>.<attempt>``):
- a prefill replica dies, its engine stops (a TP shard died), or the KV hand-off fails: nothing
  reached the client yet, so the attempt's decode reservation is cancelled (its blocks are freed)
  and the request starts over, its prompt computed on the decode replica (``prefill_here``); while
  the prefill pool has no working replica (all failed, or Serve is replacing them) new requests
  go there at once: losing the prefill pool's only replica fails no request that the decode
  replica has room for;
- a decode replica dies mid-stream: the request resumes elsewhere as prompt + tokens already sent,
  asking for the remaining ``max_tokens`` — greedy output continues token for token. Requests
  with stop strings cannot resume (text held back for stop matching died with the replica), nor
  seeded samples (the new generator would restart from the seed), so they end with an error
  event, as does any request past ``max_retries``;
- a decode replica whose engine stopped refuses before any work ("unavailable"): the call is made
  again half a second later, not counted as a retry, until Serve routes it elsewhere or replaces
  the replica (a resumed stream waits for that, within its deadline; a request with nothing sent
  yet gets a 503 while the pool is known to have no working replica, refused or being replaced).
The pools are reached only through their handles (Ray Serve DeploymentHandles in production).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context

from common.errors import InvalidRequestError, OverloadedError
from common.sampling_params import SamplingParams
from common.serving import KV_LOAD_FAILURE_POLICIES, ServeRequest, StreamDelta
from router.attempt import Attempt, AttemptObserver, NoObserver, PoolCalls
from router.attempt_errors import (
    UNAVAILABLE,
    AttemptFailed,
    KVLoadFailed,
    PrefillFailed,
    ReplicaLost,
    ReplicaUnavailable,
    is_backpressure,
    raise_for_pool_error,
)
from router.remote_prefill import RemotePrefillEstimator
from router.resumption import ResumedText, why_not_resumable
from router.ttft import ttft_breakdown, ttft_span_attributes

__all__ = ["AttemptObserver", "NoObserver", "Orchestrator", "is_backpressure"]

logger = logging.getLogger(__name__)
# Spans: the request (named by the caller, GenAI attributes, pdserve.ttft.* parts of its TTFT) ⊃
# pdserve.attempt (router.attempt) ⊃ the pools' spans. A no-op unless the process installs a
# TracerProvider.
_tracer = trace.get_tracer("pdserve.router")
# Replica reports reach the router every second (request_routing_stats_period_s): asking twice a
# second finds the pool's new state soon after, at the cost of a cheap refused call.
_UNAVAILABLE_PAUSE_S = 0.5


@dataclass(slots=True)
class _Progress:
    """What a request's attempts have done so far."""

    prefill_here: bool  # decode computes the prompt: the prefill pool is down, or it failed an attempt
    sent_ids: list[int] = field(default_factory=list)  # tokens the client has
    ttft_s: float | None = None
    attempt: int = 0  # attempts that failed count against max_retries; refused ones do not
    num_calls: int = 0  # every call on the pools, for a fresh pool request id each
    lost_on: list[str] = field(default_factory=list)  # decode replicas an attempt was lost on: not again
    served_by: list[str] = field(default_factory=list)  # the last attempt's decode replica


class Orchestrator:
    def __init__(
        self,
        decode: Any,
        prefill: Any | None,
        request_timeout_s: float = 600.0,
        max_retries: int = 1,
        detokenize: Callable[[list[int], bool], str] | None = None,
        observer: AttemptObserver | None = None,
        remote_prefill: RemotePrefillEstimator | None = None,
        prefill_pool_down: Callable[[], bool] | None = None,
        decode_pool_down: Callable[[], bool] | None = None,
        inter_token_timeout_s: float | None = None,
        kv_load_failure_policy: str = "recompute",
    ) -> None:
        assert kv_load_failure_policy in KV_LOAD_FAILURE_POLICIES, kv_load_failure_policy
        self.decode = decode
        self.prefill = prefill  # None: colocated
        # Conditional disaggregation: each request tells its decode replica what the prefill pool
        # would cost, and the replica may compute the prompt itself. None: always the prefill pool.
        self.remote_prefill = remote_prefill if prefill is not None else None
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        # Once a stream has sent a token, a longer silence means its decode replica hangs (stopped,
        # not killed: Serve's health checks take ~100 s to see it): the stream resumes elsewhere.
        self.inter_token_timeout_s = inter_token_timeout_s
        self.kv_load_failure_policy = kv_load_failure_policy
        # True while the prefill pool has no replica that takes requests (all failed, or none left
        # while Serve replaces them): prompts then go straight to their decode replica.
        self.prefill_pool_down = prefill_pool_down or (lambda: False)
        self.decode_pool_down = decode_pool_down or (lambda: False)  # the same, of the pool that streams tokens
        self.detokenize = detokenize  # (ids, skip_special_tokens) -> text; for resumed streams
        self.num_retries = 0
        self.num_resumes = 0
        self.observer: AttemptObserver = observer or NoObserver()

    async def run(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        *,
        trace_context: Context | None = None,
        span_name: str = "pdserve.request",
        attributes: dict[str, Any] | None = None,
        arrival_time: float | None = None,
        prefill_here: bool = False,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Yield the request's deltas; the last has ``finish_reason`` set. ``prefill_here``: the decode
        replica computes the prompt (disaggregated; its prefix cache holds it, router.choices).
        Refusals before the first delta raise (InvalidRequestError, OverloadedError) so the caller
        can answer with a status.
        The request's span (``span_name``, ``attributes``) is a child of ``trace_context`` (a
        client's), and the parent of every pool's spans for it. The last delta of a request that
        produced a token carries its ``ttft_breakdown``, its TTFT counted from ``arrival_time``
        (``time.monotonic()`` when the router got the request; by default, now)."""
        deadline = time.monotonic() + self.request_timeout_s
        arrival = time.monotonic() if arrival_time is None else arrival_time
        span_attributes: dict[str, Any] = {
            "pdserve.pool_request_id": request_id,
            "gen_ai.usage.input_tokens": len(prompt_token_ids),
            **(attributes or {}),
        }
        span = _tracer.start_span(
            span_name, context=trace_context, kind=trace.SpanKind.SERVER, attributes=span_attributes
        )
        num_output, finish = 0, None
        try:
            # aclosing: a client gone mid-stream closes the pool calls now, not at garbage collection.
            async with contextlib.aclosing(
                self._run(request_id, prompt_token_ids, params, cache_salt, deadline, span, arrival, prefill_here)
            ) as deltas:
                async for delta in deltas:
                    num_output += len(delta.new_token_ids)
                    finish = delta.finish_reason or finish
                    if delta.error is not None:
                        span.set_status(trace.StatusCode.ERROR, "the request failed inside the cluster")
                    yield delta
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit | asyncio.CancelledError):
                span.set_status(trace.StatusCode.ERROR, type(exc).__name__)
            raise
        finally:
            span.set_attribute("gen_ai.usage.output_tokens", num_output)
            if finish is not None:
                span.set_attribute("gen_ai.response.finish_reasons", [finish])
            span.end()

    async def _run(
        self, request_id, prompt_token_ids, params, cache_salt, deadline, span, arrival, prefill_here=False
    ) -> AsyncGenerator[StreamDelta, None]:
        progress = _Progress(prefill_here=self.prefill is not None and (prefill_here or self.prefill_pool_down()))
        text = ResumedText(self.detokenize, prompt_token_ids, params.skip_special_tokens)
        while True:
            if not progress.sent_ids and self.decode_pool_down():  # Serve would hold the call until one is back
                raise OverloadedError("the decode pool has no working replica (being replaced); retry later")
            request = self._attempt_request(request_id, prompt_token_ids, params, cache_salt, progress)
            span.set_attribute("attempts", progress.num_calls)
            relay = self._relay(request_id, request, len(prompt_token_ids), deadline, span, arrival, progress, text)
            try:
                async with contextlib.aclosing(relay) as deltas:
                    async for delta in deltas:
                        yield delta
                return
            except (InvalidRequestError, OverloadedError):
                raise
            except ReplicaUnavailable as exc:
                # Its engine stopped and the router's view of the pool has not caught up yet (or it
                # is the pool's only replica): ask again a moment later, uncounted, as Serve routes
                # away from it or replaces it. A request with nothing sent yet gets its 503 (at the
                # loop's top) once the pool is known to have no working replica; a resumed stream
                # waits for one.
                if time.monotonic() + _UNAVAILABLE_PAUSE_S > deadline:
                    if not progress.sent_ids:
                        raise OverloadedError(f"no decode replica could take the request in time: {exc}") from exc
                    error = f"no decode replica came back: {exc}"
                    yield StreamDelta(request_id, [], "", finish_reason="error", error=error)
                    return
                await asyncio.sleep(_UNAVAILABLE_PAUSE_S)
            except Exception as exc:
                why = self._why_it_ends(exc, request_id, params, progress, deadline)
                if why is not None:
                    logger.warning("request %s failed (%s): %s", request_id, why, exc)
                    yield StreamDelta(request_id, [], "", finish_reason="error", error=f"{why}: {exc}")
                    return
                self._next_attempt(exc, request_id, progress)

    def _attempt_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt, progress: _Progress
    ) -> ServeRequest:
        """The next attempt's request on the pools: a resumed stream asks for prompt + the tokens
        already sent, and the remaining ``max_tokens`` and ``min_tokens``. Its trace_context is set by
        the attempt."""
        sent_ids = progress.sent_ids
        attempt_params = params
        if sent_ids:  # the rest of the request: what it may still generate, and must before EOS
            left, held = params.max_tokens - len(sent_ids), max(0, params.min_tokens - len(sent_ids))
            # The prompt's logprobs went out with the first token: the longer prompt is not scored.
            attempt_params = dataclasses.replace(params, max_tokens=left, min_tokens=held, prompt_logprobs=None)
        request = ServeRequest(
            request_id=f"{request_id}.{progress.num_calls}",
            prompt_token_ids=prompt_token_ids + sent_ids,
            sampling=attempt_params.to_dict(),
            cache_salt=cache_salt,
            prefill_here=progress.prefill_here,
            avoid_replicas=tuple(progress.lost_on),
        )
        progress.num_calls += 1
        return request

    async def _relay(
        self, request_id, request, num_prompt_tokens, deadline, span, arrival, progress: _Progress, text: ResumedText
    ) -> AsyncGenerator[StreamDelta, None]:
        """One attempt's deltas as the client gets them: a pool's error raised as the failure it
        is, the text of a resumed stream recomputed, the TTFT breakdown on the last delta."""
        resumed = bool(progress.sent_ids)
        sent_ids = progress.sent_ids
        progress.served_by = []
        attempt = Attempt(self._pools, request, deadline, span, progress.served_by)
        async with contextlib.aclosing(attempt.deltas()) as attempt_deltas:
            async for delta in attempt_deltas:
                if delta.error is not None:
                    if delta.error.startswith(UNAVAILABLE):
                        raise ReplicaUnavailable(delta.error)
                    if not sent_ids:
                        raise_for_pool_error(delta.error)  # refusals: the caller answers with a status
                    raise AttemptFailed(delta.error)
                if not sent_ids and delta.new_token_ids:
                    progress.ttft_s = time.monotonic() - arrival
                sent_ids.extend(delta.new_token_ids)
                new_text = text.after(sent_ids, delta) if resumed else text.sent(delta.new_text)
                delta = dataclasses.replace(
                    delta, request_id=request_id, num_prompt_tokens=num_prompt_tokens, new_text=new_text
                )
                if delta.finish_reason is not None and progress.ttft_s is not None:
                    delta = _with_ttft_breakdown(delta, progress.ttft_s, resumed, span)
                yield delta

    def _why_it_ends(
        self, exc: Exception, request_id: str, params: SamplingParams, progress: _Progress, deadline: float
    ) -> str | None:
        """Why a failed attempt is the request's last, if it is (else another follows)."""
        if not isinstance(exc, (ReplicaLost, AttemptFailed)):
            if is_backpressure(exc) and not progress.sent_ids:
                raise OverloadedError("every replica's queue is full; retry later") from exc
            logger.exception("request %s: attempt %d failed", request_id, progress.attempt)
        why = why_not_resumable(params) if progress.sent_ids else None
        if why is None and isinstance(exc, KVLoadFailed) and self.kv_load_failure_policy == "fail":
            why = "the KV hand-off failed (kv_load_failure_policy: fail)"
        if why is None and (progress.attempt >= self.max_retries or time.monotonic() > deadline):
            why = f"gave up after {progress.attempt + 1} attempt(s)"
        return why

    def _next_attempt(self, exc: Exception, request_id: str, progress: _Progress) -> None:
        """Another attempt follows a failed one: where its prompt runs, which replicas it avoids."""
        progress.attempt += 1
        progress.prefill_here = progress.prefill_here or isinstance(exc, PrefillFailed)
        if isinstance(exc, ReplicaLost):
            progress.lost_on.extend(r for r in progress.served_by if r not in progress.lost_on)
        if progress.sent_ids:
            self.num_resumes += 1
            self.observer.migrated()
        else:
            self.num_retries += 1
            self.observer.retried()
        verb = "resumes" if progress.sent_ids else "retries"
        logger.warning("request %s: %s; attempt %d %s", request_id, exc, progress.attempt, verb)

    @property
    def _pools(self) -> PoolCalls:
        return PoolCalls(self.decode, self.prefill, self.remote_prefill, self.inter_token_timeout_s, self.observer)


def _with_ttft_breakdown(delta: StreamDelta, ttft_s: float, resumed: bool, span: Any) -> StreamDelta:
    """The request's last delta, with the breakdown of its TTFT on it and on the request's span. The
    parts are the first-token attempt's: this one's, unless it resumed a stream another began."""
    breakdown = ttft_breakdown(ttft_s, None, None) if resumed else ttft_breakdown(ttft_s, delta.prefill_reply, delta)
    span.set_attributes(ttft_span_attributes(breakdown))
    return dataclasses.replace(delta, ttft_breakdown=breakdown)
