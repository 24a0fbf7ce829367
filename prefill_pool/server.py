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
import enum
import logging

from common.config import EngineConfig
from common.errors import InvalidRequestError, OverloadedError
from common.outputs import RequestMetrics
from common.sampling_params import SamplingParams
from common.serving import PrefillResult, ServeRequest
from engine.async_engine import HandoffEnded
from engine.executor import WorkerLauncher
from engine.llm_engine import LLMEngine
from engine.replica import EngineReplica, serve_replica_id, start_replica_engine

logger = logging.getLogger(__name__)


class PrefillState(str, enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    SENDING = "sending"
    DONE = "done"
    ABORTED = "aborted"
    FAILED = "failed"


class PrefillServer(EngineReplica):
    def __init__(
        self,
        engine_config: dict,
        launcher: WorkerLauncher | None = None,
        timeout_s: float = 600.0,
        cores: int | None = None,
    ) -> None:
        engine, claim = start_replica_engine(EngineConfig.from_dict(engine_config), launcher, cores)
        super().__init__(engine, serve_replica_id(), claim)
        self.timeout_s = timeout_s
        logger.info("prefill replica %s ready", self.replica_id)

    async def prefill(self, request: ServeRequest) -> PrefillResult:
        request_id = request.request_id
        if request.kv_ticket is None:
            return PrefillResult(request_id, None, 0, "invalid_request: a prefill needs a kv_ticket", self.replica_id)
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
            return PrefillResult(request_id, None, 0, f"{kind}: {exc}", self.replica_id)
        except BaseException:  # cancelled by the router, timed out, engine gone: stop computing it
            self.engine.abort_soon(request_id)
            raise
        output = ended.output
        if output is None:
            return PrefillResult(request_id, None, 0, ended.failure or "prefill failed", self.replica_id)
        completion = output.outputs[0]
        return PrefillResult(
            request_id,
            completion.token_ids[0] if completion.token_ids else None,
            output.num_cached_tokens,
            ended.failure,
            self.replica_id,
            first_logprob=completion.logprobs[0] if completion.logprobs else None,
            **_timings(output.metrics, ended),
        )


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
