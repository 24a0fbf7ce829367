"""The prefill pool's replica (a Ray Serve deployment class; cluster.app applies the options).

A request's life on a prefill replica::

    WAITING ──▶ PREFILLING (chunked; each layer's KV pushed as computed) ──▶ SENDING ──▶ DONE
       │                                                         │ receiver gone, lease, checksum
       ▼ cancelled by the router                                 ▼
    ABORTED (nothing sent)                                    FAILED (source blocks released)

``prefill`` returns once the hand-off has ended, with the first sampled token (the decode replica
gets it inside the KV completion message too) or the reason it failed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from common import tracing
from common.config import EngineConfig
from common.errors import InvalidRequestError, OverloadedError
from common.logs import setup_logging
from common.outputs import RequestMetrics
from common.sampling_params import SamplingParams
from common.serving import PrefillResult, ServeRequest
from common.tracing import setup_tracing
from engine.executor import WorkerLauncher
from engine.handoff.watches import HandoffEnded
from engine.llm_engine import LLMEngine
from engine.replica import EngineReplica, serve_replica_id, start_replica_engine

logger = logging.getLogger(__name__)


class PrefillServer(EngineReplica):
    def __init__(
        self,
        engine_config: dict,
        launcher: WorkerLauncher | None = None,
        timeout_s: float = 600.0,
        cores: int | None = None,
        tracing: tuple[str, str | None] = ("none", None),
    ) -> None:
        setup_logging()
        setup_tracing(tracing[0], "pdserve-prefill", tracing[1])
        engine, claim = start_replica_engine(EngineConfig.from_dict(engine_config), launcher, cores)
        super().__init__(engine, serve_replica_id(), claim)
        self.timeout_s = timeout_s
        logger.info("prefill replica %s ready", self.replica_id)

    async def prefill(self, request: ServeRequest) -> PrefillResult:
        started = time.monotonic()
        result, ended = await self._prefill(request)
        if tracing.enabled():
            record_prefill_spans(request, result, ended, started, self.replica_id)
        return result

    async def _prefill(self, request: ServeRequest) -> tuple[PrefillResult, HandoffEnded | None]:
        request_id = request.request_id
        if request.kv_ticket is None:
            refusal = "invalid_request: a prefill needs a kv_ticket"
            return PrefillResult(request_id, None, 0, refusal, self.replica_id), None
        loop = asyncio.get_running_loop()

        def add(engine: LLMEngine) -> asyncio.Future:
            done = self.engine.watch_handoff(engine, request_id, loop)
            engine.add_request(
                request_id, request.prompt_token_ids, params, request.cache_salt, kv_ticket=request.kv_ticket
            )
            return done

        try:
            params = SamplingParams.from_dict(request.sampling)
            done = await self.engine.call(add)
            ended: HandoffEnded = await asyncio.wait_for(done, self.timeout_s)
        except (InvalidRequestError, OverloadedError) as exc:
            self.engine.abort_soon(request_id)
            kind = "overloaded" if isinstance(exc, OverloadedError) else "invalid_request"
            return PrefillResult(request_id, None, 0, f"{kind}: {exc}", self.replica_id), None
        except BaseException:  # cancelled by the router, timed out, engine gone: stop computing it
            self.engine.abort_soon(request_id)
            raise
        output = ended.output
        if output is None:
            return PrefillResult(request_id, None, 0, ended.failure or "prefill failed", self.replica_id), ended
        completion = output.outputs[0]
        result = PrefillResult(
            request_id,
            completion.token_ids[0] if completion.token_ids else None,
            output.num_cached_tokens,
            ended.failure,
            self.replica_id,
            first_logprob=completion.logprobs[0] if completion.logprobs else None,
            prompt_logprobs=output.prompt_logprobs,
            **_timings(output.metrics, ended),
        )
        return result, ended


def record_prefill_spans(
    request: ServeRequest, result: PrefillResult, ended: HandoffEnded | None, started: float, replica_id: str
) -> None:
    """The prefill's spans under the router's attempt span: its queue, each prompt chunk's step, and
    the KV hand-off (from the step of the first prompt chunk whose blocks it pushed, when the layers
    start leaving, to every receiver's acknowledgement)."""
    parent = tracing.extract(request.trace_context)
    output = ended.output if ended is not None else None
    attributes = {
        "pdserve.replica": replica_id,
        "pdserve.pool_request_id": request.request_id,
        "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
        "pdserve.cached_tokens": result.num_cached_tokens,
    }
    context = tracing.record_span("pdserve.prefill", started, time.monotonic(), parent, attributes, result.error)
    metrics = output.metrics if output is not None else None
    if metrics is None or metrics.first_scheduled_time is None:
        return
    tracing.record_span("pdserve.prefill.queue", metrics.arrival_time, metrics.first_scheduled_time, context)
    for start, end, num_tokens in metrics.prefill_chunks:
        tracing.record_span("pdserve.prefill.chunk", start, end, context, {"pdserve.num_tokens": num_tokens})
    if ended is not None and ended.sent is not None and ended.ended_at is not None and metrics.prefill_chunks:
        transfer = {
            "pdserve.kv_bytes": ended.sent.num_bytes,
            "pdserve.kv_exposed_s": result.kv_exposed_s or 0.0,
            "pdserve.kv_backend": str((request.kv_ticket or {}).get("backend", "")),
            "pdserve.kv_windows": ended.sent.num_windows,
        }
        # One window per chunk that completed blocks, the last chunk's always among them.
        chunks = metrics.prefill_chunks
        first_push = chunks[max(0, len(chunks) - ended.sent.num_windows)][0]
        tracing.record_span("pdserve.kv_transfer", first_push, ended.ended_at, context, transfer, ended.failure)


def _timings(metrics: RequestMetrics | None, ended: HandoffEnded) -> dict:
    """The request's phases on this replica, for the router's metrics (one clock: this process's)."""
    facts: dict = {}
    if ended.sent is not None:
        facts["kv_bytes"] = ended.sent.num_bytes
        facts["kv_transfer_s"] = ended.sent.seconds
    if metrics is None or metrics.first_scheduled_time is None:
        return facts
    facts["queue_time_s"] = metrics.first_scheduled_time - metrics.arrival_time
    if metrics.first_token_time is not None:
        facts["prefill_time_s"] = metrics.first_token_time - metrics.first_scheduled_time
        if ended.sent is not None and ended.ended_at is not None:
            facts["kv_exposed_s"] = max(0.0, ended.ended_at - metrics.first_token_time)
    return facts
