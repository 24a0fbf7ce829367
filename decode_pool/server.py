"""The decode pool's replica (a Ray Serve deployment class; cluster.app applies the options).

A request's life on a decode replica::

    WAITING_FOR_BLOCKS ──▶ RESERVED ── KV lands on every shard ──▶ RUNNING ──▶ FINISHED (stop | length)
       │ queue full,          │  lease expires, transfer fails,       │ client gone / engine failure
       ▼ deadline passed      ▼  client gone                          ▼
    OVERLOADED (503)        FAILED (blocks freed, error delta)      ABORTED | FAILED (blocks freed)

``generate`` first yields a ``TicketIssued`` (blocks reserved; the router hands the ticket to a
prefill replica), then one ``StreamDelta`` per engine step that produced tokens. In colocated
mode the same replica runs the prefill too: no ticket, the deltas start at once.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import AsyncIterator

from common.config import EngineConfig, EngineRole
from common.errors import InvalidRequestError, OverloadedError
from common.outputs import RequestOutput
from common.sampling_params import SamplingParams
from common.serving import ServeRequest, StreamDelta, TicketIssued
from decode_pool.stream_interval import every_n_tokens
from engine.executor import WorkerLauncher
from engine.llm_engine import LLMEngine
from engine.replica import EngineReplica, serve_replica_id, start_replica_engine
from kv_transfer import make_ticket

logger = logging.getLogger(__name__)


class DecodeState(str, enum.Enum):
    WAITING_FOR_BLOCKS = "waiting_for_blocks"
    RESERVED = "reserved"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


def to_delta(outputs: list[RequestOutput], replica_id: str, with_timings: bool = False) -> StreamDelta:
    """One delta for consecutive outputs of a request (the last one's state, every one's tokens).
    ``with_timings`` (colocated: this engine ran the prompt too): the finished delta carries the
    prompt's queue and prefill times."""
    last = outputs[-1]
    completion = last.outputs[0]
    new_ids = [t for o in outputs for t in o.outputs[0].new_token_ids]
    logprobs = [lp for o in outputs for lp in (o.outputs[0].new_logprobs or ())]
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
    ) -> None:
        config = EngineConfig.from_dict(engine_config)
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
        request_id = request.request_id
        try:
            params = SamplingParams.from_dict(request.sampling)
        except InvalidRequestError as exc:
            yield _error_delta(request_id, f"invalid_request: {exc}", self.replica_id)
            return
        outputs = self.engine.open_stream(request_id)
        try:
            if self.colocated:
                await self.engine.call(
                    lambda e: e.add_request(request_id, request.prompt_token_ids, params, request.cache_salt)
                )
            else:
                # A burst waits for blocks in the engine's bounded FIFO, woken as blocks free.
                reserve = lambda e: self._reserve(e, request, params)  # noqa: E731
                ticket = await self.engine.call_when_room(reserve, self.reserve_timeout_s)
                yield TicketIssued(request_id, ticket, self.replica_id)
        except (InvalidRequestError, OverloadedError) as exc:
            self.engine.close_stream(request_id)
            kind = "overloaded" if isinstance(exc, OverloadedError) else "invalid_request"
            yield _error_delta(request_id, f"{kind}: {exc}", self.replica_id)
            return
        except BaseException:
            self.engine.close_stream(request_id)
            self.engine.abort_soon(request_id)
            raise
        # aclosing: a caller gone while tokens are held back still aborts the request now.
        async with contextlib.aclosing(self.engine.stream(request_id, outputs, self.item_timeout_s)) as stream:
            batches = every_n_tokens(stream, self.stream_interval) if self.stream_interval > 1 else stream
            async for batch in batches:
                yield to_delta(batch, self.replica_id, self.colocated)

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


def _error_delta(request_id: str, error: str, replica_id: str) -> StreamDelta:
    return StreamDelta(request_id, [], "", finish_reason="error", error=error, replica_id=replica_id)
