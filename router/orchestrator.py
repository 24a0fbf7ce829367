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
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.context import Context

from common.errors import InvalidRequestError, OverloadedError
from common.sampling_params import SamplingParams
from common.serving import (
    KV_LOAD_FAILED,
    KV_LOAD_FAILURE_POLICIES,
    PrefillResult,
    ServeRequest,
    StreamDelta,
    TicketIssued,
)
from common.tracing import inject
from router.remote_prefill import RemotePrefillEstimator
from router.ttft import ttft_breakdown, ttft_span_attributes

logger = logging.getLogger(__name__)
# Spans: the request (named by the caller, GenAI attributes, pdserve.ttft.* parts of its TTFT) ⊃
# pdserve.attempt (events: kv_ticket, prefill_done, first_token) ⊃ the pools' spans. A no-op unless
# the process installs a TracerProvider.
_tracer = trace.get_tracer("pdserve.router")
# How long the last delta waits for a prefill reply still missing (its KV landed long before).
_PREFILL_FACTS_WAIT_S = 5.0


class ReplicaLost(Exception):
    """A pool replica died or vanished during an attempt (retryable before any token was sent)."""


class AttemptFailed(Exception):
    """The attempt failed for a reason another replica may not have (e.g. the KV hand-off)."""


class ReplicaUnavailable(Exception):
    """The replica refused the attempt before any work: its engine stopped (another one can serve)."""


_UNAVAILABLE = "unavailable: "  # the kind a pool's error delta starts with (decode_pool.server)
# Replica reports reach the router every second (request_routing_stats_period_s): asking twice a
# second finds the pool's new state soon after, at the cost of a cheap refused call.
_UNAVAILABLE_PAUSE_S = 0.5


class PrefillFailed(AttemptFailed):
    """The prefill side failed the attempt (replica lost, engine stopped, hand-off failed): the
    next attempt computes the prompt on its decode replica."""


class KVLoadFailed(PrefillFailed):
    """The attempt's KV hand-off failed (a chunk refused, a lease run out, a transport error): the
    next attempt computes the prompt on decode, or none follows (kv_load_failure_policy "fail")."""


def _is_replica_loss(exc: BaseException) -> bool:
    try:
        from ray import exceptions as ray_exceptions
    except ImportError:  # pragma: no cover - Ray is always installed with the router
        return False
    lost = (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError, ray_exceptions.WorkerCrashedError)
    return isinstance(exc, lost) and not isinstance(exc, ray_exceptions.RayTaskError)


def raise_for_pool_error(error: str) -> None:
    """Pools report request-level refusals as 'kind: message' strings; turn them back into errors."""
    kind, _, message = error.partition(": ")
    if kind == "invalid_request":
        raise InvalidRequestError(message)
    if kind == "overloaded":
        raise OverloadedError(message)


class AttemptObserver(Protocol):
    """What the orchestrator tells the router's metrics (router.metrics.RouterMetrics is one)."""

    def prefill_reply(self, result: PrefillResult) -> None: ...

    def retried(self) -> None: ...

    def migrated(self) -> None: ...

    def stalled(self) -> None: ...

    def prefill_site(self, local: bool) -> None: ...


class _NoObserver:
    def prefill_reply(self, result: PrefillResult) -> None:
        pass

    def retried(self) -> None:
        pass

    def migrated(self) -> None:
        pass

    def stalled(self) -> None:
        pass

    def prefill_site(self, local: bool) -> None:
        pass


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
        self.observer: AttemptObserver = observer or _NoObserver()

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
    ) -> AsyncGenerator[StreamDelta, None]:
        """Yield the request's deltas; the last has ``finish_reason`` set. Refusals before the first
        delta raise (InvalidRequestError, OverloadedError) so the caller can answer with a status.
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
                self._run(request_id, prompt_token_ids, params, cache_salt, deadline, span, arrival)
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
        self, request_id, prompt_token_ids, params, cache_salt, deadline, span, arrival
    ) -> AsyncGenerator[StreamDelta, None]:
        sent_ids: list[int] = []
        ttft_s: float | None = None
        text = _ResumedText(self.detokenize, prompt_token_ids, params.skip_special_tokens)
        attempt = 0  # attempts that failed count against max_retries; refused ones do not
        num_calls = 0  # every call on the pools, for a fresh pool request id each
        # Decode computes the prompt: the prefill pool is down, or it failed an earlier attempt.
        prefill_here = self.prefill is not None and self.prefill_pool_down()
        lost_on: list[str] = []  # decode replicas an attempt was lost on (ReplicaLost): not again
        while True:
            if not sent_ids and self.decode_pool_down():  # Serve would hold the call until one is back
                raise OverloadedError("the decode pool has no working replica (being replaced); retry later")
            remaining = params.max_tokens - len(sent_ids)
            attempt_params = dataclasses.replace(params, max_tokens=remaining) if sent_ids else params
            request = ServeRequest(
                request_id=f"{request_id}.{num_calls}",
                prompt_token_ids=prompt_token_ids + sent_ids,
                sampling=attempt_params.to_dict(),
                cache_salt=cache_salt,
                prefill_here=prefill_here,
                avoid_replicas=tuple(lost_on),
            )  # its trace_context is the attempt's span, set in _attempt
            resumed = bool(sent_ids)
            num_calls += 1
            span.set_attribute("attempts", num_calls)
            served_by: list[str] = []
            try:
                async with contextlib.aclosing(self._attempt(request, deadline, span, served_by)) as attempt_deltas:
                    async for delta in attempt_deltas:
                        if delta.error is not None:
                            if delta.error.startswith(_UNAVAILABLE):
                                raise ReplicaUnavailable(delta.error)
                            if not sent_ids:
                                raise_for_pool_error(delta.error)  # refusals: the caller answers with a status
                            raise AttemptFailed(delta.error)
                        if not sent_ids and delta.new_token_ids:
                            ttft_s = time.monotonic() - arrival
                        sent_ids.extend(delta.new_token_ids)
                        new_text = text.after(sent_ids, delta) if resumed else text.sent(delta.new_text)
                        delta = dataclasses.replace(
                            delta, request_id=request_id, num_prompt_tokens=len(prompt_token_ids), new_text=new_text
                        )
                        if delta.finish_reason is not None and ttft_s is not None:
                            delta = _with_ttft_breakdown(delta, ttft_s, resumed, span)
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
                    if not sent_ids:
                        raise OverloadedError(f"no decode replica could take the request in time: {exc}") from exc
                    yield StreamDelta(
                        request_id, [], "", finish_reason="error", error=f"no decode replica came back: {exc}"
                    )
                    return
                await asyncio.sleep(_UNAVAILABLE_PAUSE_S)
            except Exception as exc:
                if not isinstance(exc, (ReplicaLost, AttemptFailed)):
                    if is_backpressure(exc) and not sent_ids:
                        raise OverloadedError("every replica's queue is full; retry later") from exc
                    logger.exception("request %s: attempt %d failed", request_id, attempt)
                why = _why_not_resumable(params) if sent_ids else None
                if why is None and isinstance(exc, KVLoadFailed) and self.kv_load_failure_policy == "fail":
                    why = "the KV hand-off failed (kv_load_failure_policy: fail)"
                if why is None and (attempt >= self.max_retries or time.monotonic() > deadline):
                    why = f"gave up after {attempt + 1} attempt(s)"
                if why is not None:
                    logger.warning("request %s failed (%s): %s", request_id, why, exc)
                    yield StreamDelta(request_id, [], "", finish_reason="error", error=f"{why}: {exc}")
                    return
                attempt += 1
                prefill_here = prefill_here or isinstance(exc, PrefillFailed)
                if isinstance(exc, ReplicaLost):
                    lost_on.extend(r for r in served_by if r not in lost_on)
                if sent_ids:
                    self.num_resumes += 1
                    self.observer.migrated()
                else:
                    self.num_retries += 1
                    self.observer.retried()
                logger.warning(
                    "request %s: %s; attempt %d %s", request_id, exc, attempt, "resumes" if sent_ids else "retries"
                )

    async def _attempt(
        self, request: ServeRequest, deadline: float, parent: Any, served_by: list[str] | None = None
    ) -> AsyncGenerator[StreamDelta, None]:
        """One attempt. Decode's deltas are passed on as they come: its first token is out the moment
        the KV lands, not when prefill's reply reaches the router. Prefill's reply only matters
        before that (a failed hand-off ends the attempt now, not when the lease runs out) and for
        its facts: the first token's logprob (a request asking for logprobs holds its first delta
        for it) and the prompt's cache hits (needed by the usage of the last delta)."""
        span = _tracer.start_span("pdserve.attempt", context=trace.set_span_in_context(parent))
        span.set_attribute("pdserve.pool_request_id", request.request_id)
        if request.prefill_here:
            span.set_attribute("pdserve.prefill_failover", True)
        carrier = inject(trace.set_span_in_context(span))  # the pools' spans are the attempt's children
        remote_prefill = None
        if self.remote_prefill is not None and not request.prefill_here:
            remote_prefill = self.remote_prefill.estimate(request)
        request = dataclasses.replace(request, trace_context=carrier or None, remote_prefill=remote_prefill)
        started = time.monotonic()
        stream = self.decode.options(stream=True).generate.remote(request)
        prefill_task: asyncio.Task | None = None
        prefilled: PrefillResult | None = None
        wants_logprobs = request.sampling.get("logprobs") is not None
        finished = False
        num_yielded = 0
        first_token_s: float | None = None  # disaggregated: attempt start to the first token's arrival
        measured = False  # the hand-off's overhead, for remote_prefill
        try:
            first = await self._next(stream, deadline)
            if served_by is not None and first.replica_id:
                served_by.append(first.replica_id)  # the decode replica Serve placed it on
            if isinstance(first, TicketIssued):
                span.add_event("kv_ticket", {"decode_replica": first.replica_id})
                assert self.prefill is not None, "a colocated pool issued a ticket"
                self.observer.prefill_site(local=False)
                prefill_request = dataclasses.replace(request, kv_ticket=first.ticket, remote_prefill=None)
                prefill_task = asyncio.ensure_future(self._prefill(prefill_request, deadline))
            else:
                if self.prefill is not None and first.error is None:  # the decode replica ran the prompt
                    span.add_event("prefill_local", {"decode_replica": first.replica_id})
                    self.observer.prefill_site(local=True)
                finished = first.finish_reason is not None
                num_yielded += 1
                yield first
            while not finished:
                if prefill_task is not None and num_yielded == 0:
                    next_item = asyncio.ensure_future(self._next(stream, deadline))
                    try:
                        # Before the first token, a failed prefill ends the attempt at once.
                        await asyncio.wait({next_item, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
                        if prefill_task.done():  # also when both are: nothing went out yet
                            task, prefill_task = prefill_task, None
                            span.add_event("prefill_done")
                            prefilled = _check_prefill(task, request.request_id)
                            self.observer.prefill_reply(prefilled)
                        delta = await next_item
                    except BaseException:
                        _discard(next_item)
                        raise
                else:  # the common case, once per token: nothing to race it against
                    stall = self.inter_token_timeout_s if num_yielded else None
                    delta = await self._next(stream, deadline, stall)
                assert isinstance(delta, StreamDelta), f"{request.request_id}: a second ticket in one stream"
                if prefill_task is not None and num_yielded == 0 and delta.error is not None:
                    # Decode failed before any token: prefill's verdict says why, if it has one
                    # (an overloaded prefill pool is a 503, not a failed hand-off). A hand-off
                    # that failed with decode is a KV load failure only if decode says so; else
                    # decode failed on its own (engine stopped): no failover to decode.
                    await asyncio.wait({prefill_task}, timeout=_facts_wait_s(deadline))
                    task, prefill_task = prefill_task, None
                    kv_failed = delta.error.startswith(f"{KV_LOAD_FAILED}: ")
                    if task.done():
                        _check_prefill(task, request.request_id, kv_to_blame=kv_failed)
                    else:
                        # No verdict: the prefill replica is silent past decode's wait for the KV
                        # (a hung replica). Unless decode refused the request, the retry computes
                        # the prompt on decode, never on that replica again.
                        _discard(task)
                        raise_for_pool_error(delta.error)
                        failure = KVLoadFailed if kv_failed else PrefillFailed
                        raise failure(f"the prefill replica did not answer once decode failed: {delta.error}")
                    if kv_failed:  # prefill reported its push done, yet decode could not load it
                        raise KVLoadFailed(delta.error)
                if num_yielded == 0:
                    span.add_event("first_token", {"decode_replica": delta.replica_id})
                    first_token_s = time.monotonic() - started
                wants_facts_now = num_yielded == 0 and wants_logprobs  # the first token's logprob
                if prefill_task is not None and (prefill_task.done() or wants_facts_now or delta.finish_reason):
                    # Decode sent a token, so the KV has landed: the reply brings facts, not a verdict.
                    prefilled = await _prefill_facts(prefill_task, request.request_id, deadline)
                    prefill_task = None
                    span.add_event("prefill_done")
                    if prefilled is not None:
                        self.observer.prefill_reply(prefilled)
                if prefilled is not None:
                    delta = _with_prefill_facts(delta, prefilled, num_yielded == 0, request)
                    if self.remote_prefill is not None and not measured and first_token_s is not None:
                        self.remote_prefill.observe(first_token_s, prefilled)
                        measured = True
                finished = delta.finish_reason is not None
                num_yielded += 1
                yield delta
        finally:
            if prefill_task is not None:
                _discard(prefill_task)
            if not finished:
                stream.cancel()  # the decode replica aborts the request and frees its blocks
            span.set_attribute("finished", finished)
            span.end()

    async def _prefill(self, request: ServeRequest, deadline: float) -> PrefillResult:
        assert self.prefill is not None
        response = self.prefill.prefill.remote(request)
        try:
            return await asyncio.wait_for(_await(response), max(deadline - time.monotonic(), 0.001))
        except asyncio.CancelledError:
            response.cancel()
            raise
        except asyncio.TimeoutError:
            response.cancel()
            raise AttemptFailed(f"prefill of {request.request_id} timed out") from None
        except Exception as exc:
            if _is_replica_loss(exc):
                raise PrefillFailed(f"prefill replica lost: {type(exc).__name__}") from exc
            if is_backpressure(exc):  # the pool is full, not failing: the caller answers 503
                raise
            # The replica raised (its engine stopped, or a bug): logged here, with its traceback.
            logger.warning("prefill of %s raised", request.request_id, exc_info=exc)
            raise PrefillFailed(f"prefill of {request.request_id} failed: {type(exc).__name__}") from exc

    async def _next(self, stream: Any, deadline: float, stall_s: float | None = None) -> TicketIssued | StreamDelta:
        """The stream's next item by the request's deadline, or within ``stall_s`` if that is sooner
        (a stalled replica: ReplicaLost, so the stream resumes on another)."""
        left = max(deadline - time.monotonic(), 0.001)
        stalled = stall_s is not None and stall_s < left
        try:
            return await asyncio.wait_for(stream.__anext__(), stall_s if stalled else left)
        except StopAsyncIteration:
            raise ReplicaLost("the decode stream ended without a final delta") from None
        except asyncio.TimeoutError:
            if stalled:
                self.observer.stalled()
                silence = f"no token from the decode replica for {stall_s:g} s (inter_token_timeout_s)"
                raise ReplicaLost(silence) from None
            raise AttemptFailed("the request timed out (request_timeout_s)") from None
        except Exception as exc:
            if _is_replica_loss(exc):
                raise ReplicaLost(f"decode replica lost: {type(exc).__name__}") from exc
            raise


def _discard(task: asyncio.Future) -> None:
    """Cancel a task nobody will await; whatever it ends with (Serve raises its own
    RequestCancelledError) is retrieved here, so asyncio does not log it as lost."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _check_prefill(task: asyncio.Task, request_id: str, kv_to_blame: bool = True) -> PrefillResult:
    """A finished prefill with an error ends the attempt now, not when the decode lease runs out:
    a failed hand-off is KVLoadFailed (kv_load_failure_policy). ``kv_to_blame`` False: decode
    failed on its own (its engine stopped), which explains the hand-off's end: a plain retry."""
    exc = task.exception()
    if exc is not None:
        raise exc
    result: PrefillResult = task.result()
    if result.error is not None:
        raise_for_pool_error(result.error)
        failure = KVLoadFailed if kv_to_blame else AttemptFailed
        raise failure(f"KV hand-off of {request_id} failed: {result.error}")
    return result


def _facts_wait_s(deadline: float) -> float:
    """How long to wait for prefill's reply once decode has answered: a moment, never past the request's deadline."""
    return max(0.0, min(_PREFILL_FACTS_WAIT_S, deadline - time.monotonic()))


async def _prefill_facts(task: asyncio.Task, request_id: str, deadline: float) -> PrefillResult | None:
    """Prefill's reply once decode already streams: at most a moment away (the replica answers when
    the hand-off it just finished is acknowledged). A failure or a late reply costs only its facts."""
    try:
        result: PrefillResult = await asyncio.wait_for(asyncio.shield(task), _facts_wait_s(deadline))
    except Exception as exc:  # incl. TimeoutError: the usage then reports no cache hits
        logger.warning("request %s: prefill's reply lost after its KV landed: %r", request_id, exc)
        _discard(task)
        return None
    return result


def _with_prefill_facts(delta: StreamDelta, prefilled: PrefillResult, is_first: bool, request: ServeRequest):
    """The decode replica knows neither the first token's logprob nor prefill's prefix-cache hits;
    the finished delta takes the whole reply along, for the TTFT breakdown (_with_ttft_breakdown)."""
    changes: dict[str, Any] = {"num_cached_tokens": prefilled.num_cached_tokens}
    wants_logprobs = request.sampling.get("logprobs") is not None
    if is_first and wants_logprobs and prefilled.first_logprob is not None:
        changes["logprobs"] = [prefilled.first_logprob, *(delta.logprobs or [])]
    if delta.finish_reason is not None:
        changes["prefill_reply"] = prefilled
    return dataclasses.replace(delta, **changes)


def _with_ttft_breakdown(delta: StreamDelta, ttft_s: float, resumed: bool, span: Any) -> StreamDelta:
    """The request's last delta, with the breakdown of its TTFT on it and on the request's span. The
    parts are the first-token attempt's: this one's, unless it resumed a stream another began."""
    breakdown = ttft_breakdown(ttft_s, None, None) if resumed else ttft_breakdown(ttft_s, delta.prefill_reply, delta)
    span.set_attributes(ttft_span_attributes(breakdown))
    return dataclasses.replace(delta, ttft_breakdown=breakdown)


def _why_not_resumable(params: SamplingParams) -> str | None:
    """Why continuing elsewhere from prompt + sent tokens would not give the same output, if it would not."""
    if params.stop:
        return "stop strings cannot be resumed (text held back for matching died with the replica)"
    if params.presence_penalty or params.frequency_penalty:
        return "presence/frequency penalties count output tokens only, which a resumed request would not"
    if params.seed is not None and params.temperature > 0:
        # The new replica's generator would start from the seed again and repeat the first draws:
        # a continuation, but not the one the seed promises.
        return "a seeded sample cannot be resumed exactly (the new replica's generator starts from the seed)"
    return None


def is_backpressure(exc: BaseException) -> bool:
    try:
        from ray.serve.exceptions import BackPressureError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, BackPressureError)


class _ResumedText:
    """Text of a resumed request, recomputed from all its output tokens.

    The dead replica may have held back text (an incomplete UTF-8 character spans tokens it sent);
    the new replica sees those tokens as prompt and would never emit it. So after a resume the
    router decodes the whole output (with the prompt's tail as context, like the engine) and sends
    what the client has not seen yet.
    """

    _CONTEXT = 5

    def __init__(self, detokenize: Callable[[list[int], bool], str] | None, prompt: list[int], skip: bool) -> None:
        self.detokenize = detokenize
        self.context = prompt[-self._CONTEXT :]
        self.skip = skip
        self.text = ""

    def sent(self, new_text: str) -> str:
        self.text += new_text
        return new_text

    def after(self, output_ids: list[int], delta: StreamDelta) -> str:
        if self.detokenize is None:
            return self.sent(delta.new_text)
        base = self.detokenize(self.context, self.skip)
        full = self.detokenize(self.context + output_ids, self.skip)[len(base) :]
        if delta.finish_reason is None and full.endswith("\ufffd"):
            return ""  # a character still incomplete: wait for its last byte
        return self.sent(full[len(self.text) :])


async def _await(response: Any) -> Any:
    return await response
