"""The decode pool's replica (a Ray Serve deployment class; cluster.app applies the options).

A request's life on a decode replica::

    RESERVED ── KV lands on every shard ──▶ RUNNING ──▶ FINISHED (stop | length)
       │  lease expires, transfer fails, client gone      │ client gone / engine failure
       ▼                                                  ▼
    FAILED (blocks freed, error delta)                  ABORTED | FAILED (blocks freed)

``generate`` first yields a ``TicketIssued`` (blocks reserved; the router hands the ticket to a
prefill replica), then one ``StreamDelta`` per engine step that produced tokens. In colocated
mode the same replica runs the prefill too: no ticket, the deltas start at once.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator

from common.config import EngineConfig, EngineRole
from common.errors import InvalidRequestError, OverloadedError
from common.outputs import RequestOutput
from common.sampling_params import SamplingParams
from common.serving import ServeRequest, StreamDelta, TicketIssued
from engine.async_engine import AsyncEngine
from engine.executor import WorkerLauncher
from engine.llm_engine import LLMEngine
from engine.replica import EngineReplica, serve_replica_id
from kv_transfer import make_ticket

logger = logging.getLogger(__name__)
_RESERVE_POLL_S = 0.05


class DecodeState(str, enum.Enum):
    RESERVED = "reserved"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


def to_delta(output: RequestOutput, replica_id: str) -> StreamDelta:
    completion = output.outputs[0]
    new_ids = list(completion.new_token_ids)
    logprobs = completion.new_logprobs or None
    return StreamDelta(
        request_id=output.request_id,
        new_token_ids=new_ids,
        new_text=completion.new_text,
        logprobs=logprobs,
        finish_reason=completion.finish_reason if output.finished else None,
        stop_reason=completion.stop_reason,
        error=output.error,
        num_prompt_tokens=len(output.prompt_token_ids),
        num_cached_tokens=output.num_cached_tokens,
        replica_id=replica_id,
    )


class DecodeServer(EngineReplica):
    def __init__(
        self,
        engine_config: dict,
        launcher: WorkerLauncher | None = None,
        kv_lease: tuple[float, float] = (30.0, 0.0),
        item_timeout_s: float = 600.0,
    ) -> None:
        config = EngineConfig.from_dict(engine_config)
        super().__init__(AsyncEngine(LLMEngine(config, launcher)), serve_replica_id())
        self.colocated = config.scheduler.role is EngineRole.COLOCATED
        self.backend = config.kv_connector.options.get("backend", "shm")
        self.kv_lease_s, self.kv_lease_per_token_s = kv_lease  # base, and per prompt token
        self.item_timeout_s = item_timeout_s
        self.reserve_timeout_s = min(self.kv_lease_s, item_timeout_s)
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
                ticket = await self._reserve_when_blocks_free(request, params)
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
        async for output in self.engine.stream(request_id, outputs, self.item_timeout_s):
            yield to_delta(output, self.replica_id)

    async def _reserve_when_blocks_free(self, request: ServeRequest, params: SamplingParams) -> dict:
        """Running requests free blocks as they finish: wait for room (bounded) rather than refuse at once."""
        deadline = time.monotonic() + self.reserve_timeout_s
        while True:
            ticket = await self.engine.call(lambda e: self._reserve(e, request, params))
            if ticket is not None:
                return ticket
            if time.monotonic() > deadline:
                raise OverloadedError("no decode replica has free KV blocks for this prompt now; retry later")
            await asyncio.sleep(_RESERVE_POLL_S)

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
