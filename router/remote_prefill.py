"""The router's half of conditional disaggregation: what a prompt would cost on the prefill pool.

Per request, the prefill pool's placement (router.pool_placement, as its request router last
saw the pool) names the replica it would pick and that replica's queue, prefix-cache hit and
measured rate. Added to that is the hand-off's overhead, measured here over disaggregated
requests: the attempt's time to first token less the prefill replica's own queue and compute
(the decode reservation, the calls, the KV transfer left exposed, the first token's way back).
The decode replica weighs the result against computing the prompt itself (decode_pool.prefill_site).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from common.serving import PrefillResult, RemotePrefillEstimate, ServeRequest

if TYPE_CHECKING:
    from router.pool_placement import PoolPlacement

logger = logging.getLogger(__name__)
# Weight of the newest measurement in the overhead's moving average.
_OVERHEAD_WEIGHT = 0.2


class RemotePrefillEstimator:
    def __init__(self, prefill_placement: Callable[[], PoolPlacement | None]) -> None:
        self._prefill_placement = prefill_placement  # None until the prefill handle has routed a call
        self.overhead_s = 0.0  # 0 until measured: the remote path is not penalized on a guess
        self.num_measured = 0

    def estimate(self, request: ServeRequest) -> RemotePrefillEstimate | None:
        """None (the decode replica then reserves for the prefill pool, as without conditional
        disaggregation) until the prefill pool has reported a measured prefill rate."""
        placement = self._prefill_placement()
        try:
            estimate = placement.estimate(request) if placement is not None else None
        except Exception:  # an estimate is advice: without it the prefill pool computes the prompt
            logger.exception("no prefill estimate for %s", request.request_id)
            return None
        return None if estimate is None else dataclasses.replace(estimate, overhead_s=self.overhead_s)

    def observe(self, time_to_first_token_s: float, prefilled: PrefillResult) -> None:
        """A disaggregated attempt's first token came ``time_to_first_token_s`` after it started."""
        if prefilled.queue_time_s is None or prefilled.prefill_time_s is None:
            return
        overhead = max(0.0, time_to_first_token_s - prefilled.queue_time_s - prefilled.prefill_time_s)
        weight = 1.0 if not self.num_measured else _OVERHEAD_WEIGHT
        self.overhead_s += weight * (overhead - self.overhead_s)
        self.num_measured += 1
