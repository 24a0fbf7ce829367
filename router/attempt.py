"""One attempt of a request on the pools: decode's stream, with prefill's reply raced against it.

    decode.generate(req) ──▶ TicketIssued ──▶ prefill.prefill(req + ticket)     (concurrently)
                         ──▶ StreamDelta, StreamDelta, … (finish_reason on the last)

Decode's deltas are passed on as they come: its first token is out the moment the KV lands, not
when prefill's reply reaches the router. Prefill's reply only matters before that (a failed
hand-off ends the attempt now, not when the lease runs out) and for its facts: the first token's
logprob and the prompt's (a request asking for either holds its first delta for them), the prompt's cache hits
(needed by the usage of the last delta).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry import trace

from common.serving import KV_LOAD_FAILED, PrefillResult, ServeRequest, StreamDelta, TicketIssued
from common.tracing import inject
from router.attempt_errors import (
    AttemptFailed,
    KVLoadFailed,
    PrefillFailed,
    ReplicaLost,
    is_backpressure,
    is_replica_loss,
    raise_for_pool_error,
)
from router.remote_prefill import RemotePrefillEstimator

logger = logging.getLogger(__name__)
# pdserve.attempt (events: kv_ticket, prefill_done, first_token) is a child of the request's span
# and the parent of the pools' spans.
_tracer = trace.get_tracer("pdserve.router")
# How long the last delta waits for a prefill reply still missing (its KV landed long before).
_PREFILL_FACTS_WAIT_S = 5.0


class AttemptObserver(Protocol):
    """What an attempt tells the router's metrics (router.metrics.RouterMetrics is one)."""

    def prefill_reply(self, result: PrefillResult) -> None: ...

    def retried(self) -> None: ...

    def migrated(self) -> None: ...

    def stalled(self) -> None: ...

    def prefill_site(self, local: bool) -> None: ...


class NoObserver:
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


@dataclass(frozen=True)
class PoolCalls:
    """What every attempt calls and tells: the pools' handles and the orchestrator's settings."""

    decode: Any
    prefill: Any | None  # None: colocated
    remote_prefill: RemotePrefillEstimator | None
    # Once a stream has sent a token, a longer silence means its decode replica hangs.
    inter_token_timeout_s: float | None
    observer: AttemptObserver


class Attempt:
    def __init__(self, pools: PoolCalls, request: ServeRequest, deadline: float, parent: Any, served_by: list[str]):
        """``served_by``: the decode replica Serve placed the attempt on is appended to it."""
        self.pools = pools
        self.request = request
        self.deadline = deadline
        self.parent = parent
        self.served_by = served_by
        # The first token's logprob and the prompt's come with prefill's reply: the first delta waits for it.
        self.wants_logprobs = (
            request.sampling.get("logprobs") is not None or request.sampling.get("prompt_logprobs") is not None
        )
        self.prefill_task: asyncio.Task | None = None
        self.prefilled: PrefillResult | None = None
        self.num_yielded = 0
        self.started = 0.0
        self.first_token_s: float | None = None  # disaggregated: attempt start to the first token's arrival
        self.measured = False  # the hand-off's overhead, for remote_prefill

    async def deltas(self) -> AsyncGenerator[StreamDelta, None]:
        self.span = span = _tracer.start_span("pdserve.attempt", context=trace.set_span_in_context(self.parent))
        span.set_attribute("pdserve.pool_request_id", self.request.request_id)
        if self.request.prefill_here:
            span.set_attribute("pdserve.prefill_failover", True)
        self.request = self._with_context(self.request)
        self.started = time.monotonic()
        self.stream = self.pools.decode.options(stream=True).generate.remote(self.request)
        finished = False
        try:
            first = await self._next()
            if first.replica_id:
                self.served_by.append(first.replica_id)
            if isinstance(first, TicketIssued):
                self._start_prefill(first)
            else:
                self._prompt_ran_on_decode(first)
                finished = first.finish_reason is not None
                self.num_yielded += 1
                yield first
            while not finished:
                delta = await self._with_prefill_reply(await self._next_delta())
                finished = delta.finish_reason is not None
                self.num_yielded += 1
                yield delta
        finally:
            if self.prefill_task is not None:
                _discard(self.prefill_task)
            if not finished:
                self.stream.cancel()  # the decode replica aborts the request and frees its blocks
            span.set_attribute("finished", finished)
            span.end()

    def _with_context(self, request: ServeRequest) -> ServeRequest:
        """The request as the pools get it: the attempt's span as their spans' parent, and what the
        prefill pool would cost (conditional disaggregation)."""
        carrier = inject(trace.set_span_in_context(self.span))
        remote_prefill = None
        if self.pools.remote_prefill is not None and not request.prefill_here:
            remote_prefill = self.pools.remote_prefill.estimate(request)
        return dataclasses.replace(request, trace_context=carrier or None, remote_prefill=remote_prefill)

    def _start_prefill(self, issued: TicketIssued) -> None:
        self.span.add_event("kv_ticket", {"decode_replica": issued.replica_id})
        assert self.pools.prefill is not None, "a colocated pool issued a ticket"
        self.pools.observer.prefill_site(local=False)
        prefill_request = dataclasses.replace(self.request, kv_ticket=issued.ticket, remote_prefill=None)
        self.prefill_task = asyncio.ensure_future(self._prefill(prefill_request))

    def _prompt_ran_on_decode(self, first: StreamDelta) -> None:
        if self.pools.prefill is not None and first.error is None:
            self.span.add_event("prefill_local", {"decode_replica": first.replica_id})
            self.pools.observer.prefill_site(local=True)

    async def _next_delta(self) -> StreamDelta:
        """Decode's next delta; before the first token, raced against prefill's verdict."""
        before_first = self.num_yielded == 0
        if self.prefill_task is not None and before_first:
            delta = await self._race_prefill()
        else:  # the common case, once per token: nothing to race it against
            delta = await self._next(self.pools.inter_token_timeout_s if self.num_yielded else None)
        assert isinstance(delta, StreamDelta), f"{self.request.request_id}: a second ticket in one stream"
        if self.prefill_task is not None and before_first and delta.error is not None:
            await self._blame(delta)
        if before_first:
            self.span.add_event("first_token", {"decode_replica": delta.replica_id})
            self.first_token_s = time.monotonic() - self.started
        return delta

    async def _race_prefill(self) -> TicketIssued | StreamDelta:
        """Before the first token, a failed prefill ends the attempt at once."""
        assert self.prefill_task is not None
        next_item = asyncio.ensure_future(self._next())
        try:
            await asyncio.wait({next_item, self.prefill_task}, return_when=asyncio.FIRST_COMPLETED)
            if self.prefill_task.done():  # also when both are: nothing went out yet
                task, self.prefill_task = self.prefill_task, None
                self.span.add_event("prefill_done")
                self.prefilled = _check_prefill(task, self.request.request_id)
                self.pools.observer.prefill_reply(self.prefilled)
            return await next_item
        except BaseException:
            _discard(next_item)
            raise

    async def _blame(self, delta: StreamDelta) -> None:
        """Decode failed before any token: prefill's verdict says why, if it has one (an overloaded
        prefill pool is a 503, not a failed hand-off). A hand-off that failed with decode is a KV
        load failure only if decode says so; else decode failed on its own (engine stopped): no
        failover to decode."""
        assert self.prefill_task is not None and delta.error is not None
        await asyncio.wait({self.prefill_task}, timeout=_facts_wait_s(self.deadline))
        task, self.prefill_task = self.prefill_task, None
        kv_failed = delta.error.startswith(f"{KV_LOAD_FAILED}: ")
        if task.done():
            _check_prefill(task, self.request.request_id, kv_to_blame=kv_failed)
        else:
            # No verdict: the prefill replica is silent past decode's wait for the KV (a hung
            # replica). Unless decode refused the request, the retry computes the prompt on
            # decode, never on that replica again.
            _discard(task)
            raise_for_pool_error(delta.error)
            failure = KVLoadFailed if kv_failed else PrefillFailed
            raise failure(f"the prefill replica did not answer once decode failed: {delta.error}")
        if kv_failed:  # prefill reported its push done, yet decode could not load it
            raise KVLoadFailed(delta.error)

    async def _with_prefill_reply(self, delta: StreamDelta) -> StreamDelta:
        """Decode sent a token, so the KV has landed: prefill's reply brings facts, not a verdict."""
        wants_facts_now = self.num_yielded == 0 and self.wants_logprobs  # the first token's logprob
        task = self.prefill_task
        if task is not None and (task.done() or wants_facts_now or delta.finish_reason):
            self.prefilled = await _prefill_facts(task, self.request.request_id, self.deadline)
            self.prefill_task = None
            self.span.add_event("prefill_done")
            if self.prefilled is not None:
                self.pools.observer.prefill_reply(self.prefilled)
        if self.prefilled is None:
            return delta
        delta = _with_prefill_facts(delta, self.prefilled, self.num_yielded == 0, self.wants_logprobs)
        estimator = self.pools.remote_prefill
        if estimator is not None and not self.measured and self.first_token_s is not None:
            estimator.observe(self.first_token_s, self.prefilled)
            self.measured = True
        return delta

    async def _prefill(self, request: ServeRequest) -> PrefillResult:
        assert self.pools.prefill is not None
        response = self.pools.prefill.prefill.remote(request)
        try:
            return await asyncio.wait_for(_await(response), max(self.deadline - time.monotonic(), 0.001))
        except asyncio.CancelledError:
            response.cancel()
            raise
        except asyncio.TimeoutError:
            response.cancel()
            raise AttemptFailed(f"prefill of {request.request_id} timed out") from None
        except Exception as exc:
            if is_replica_loss(exc):
                raise PrefillFailed(f"prefill replica lost: {type(exc).__name__}") from exc
            if is_backpressure(exc):  # the pool is full, not failing: the caller answers 503
                raise
            # The replica raised (its engine stopped, or a bug): logged here, with its traceback.
            logger.warning("prefill of %s raised", request.request_id, exc_info=exc)
            raise PrefillFailed(f"prefill of {request.request_id} failed: {type(exc).__name__}") from exc

    async def _next(self, stall_s: float | None = None) -> TicketIssued | StreamDelta:
        """The stream's next item by the request's deadline, or within ``stall_s`` if that is sooner
        (a stalled replica: ReplicaLost, so the stream resumes on another)."""
        left = max(self.deadline - time.monotonic(), 0.001)
        stalled = stall_s is not None and stall_s < left
        try:
            return await asyncio.wait_for(self.stream.__anext__(), stall_s if stalled else left)
        except StopAsyncIteration:
            raise ReplicaLost("the decode stream ended without a final delta") from None
        except asyncio.TimeoutError:
            if stalled:
                self.pools.observer.stalled()
                silence = f"no token from the decode replica for {stall_s:g} s (inter_token_timeout_s)"
                raise ReplicaLost(silence) from None
            raise AttemptFailed("the request timed out (request_timeout_s)") from None
        except Exception as exc:
            if is_replica_loss(exc):
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


def _with_prefill_facts(delta: StreamDelta, prefilled: PrefillResult, is_first: bool, wants_logprobs: bool):
    """The decode replica knows neither the first token's logprob nor prefill's prefix-cache hits;
    the finished delta takes the whole reply along, for the TTFT breakdown."""
    changes: dict[str, Any] = {"num_cached_tokens": prefilled.num_cached_tokens}
    if is_first and wants_logprobs and prefilled.first_logprob is not None:
        changes["logprobs"] = [prefilled.first_logprob, *(delta.logprobs or [])]
    if is_first and prefilled.prompt_logprobs is not None:
        changes["prompt_logprobs"] = prefilled.prompt_logprobs
    if delta.finish_reason is not None:
        changes["prefill_reply"] = prefilled
    return dataclasses.replace(delta, **changes)


async def _await(response: Any) -> Any:
    return await response
