"""The pools' context length, as the router learns it: asked of the pools once, then kept.

A burst reaching a fresh router waits for one answer, instead of putting one call per request in
the pools' bounded queues (which refuse the rest). A failed ask is asked again by the next
request. A prefill pool whose replicas are all failed or being replaced is not asked (the call
would wait for the new one), and an answer without it is used, not kept.
"""

import asyncio
from typing import Any

POOL_CALL_TIMEOUT_S = 10.0


async def _await(response: Any) -> Any:
    return await response


class ContextLength:
    def __init__(self, decode: Any, prefill: Any | None) -> None:
        self.decode = decode
        self.prefill = prefill
        self.value: int | None = None  # kept once every pool answered
        self._ask: asyncio.Future[tuple[int, bool]] | None = None

    async def get(self) -> int:
        """The smaller of the pools' context lengths."""
        if self.value is None:
            if self._ask is None or self._ask.done():
                self._ask = asyncio.ensure_future(self._ask_pools())
            # Shielded: a client that leaves does not cancel the ask the others wait for.
            max_model_len, every_pool = await asyncio.shield(self._ask)
            if not every_pool:
                return max_model_len  # the prefill pool was down: not kept, asked again later
            self.value = max_model_len
        return self.value

    async def _ask_pools(self) -> tuple[int, bool]:
        """(the smaller context length, whether every pool answered)."""
        from router.routing_state import takes_requests

        report = await asyncio.wait_for(_await(self.decode.report.remote()), POOL_CALL_TIMEOUT_S)
        if self.prefill is None:
            return report["max_model_len"], True
        if takes_requests("prefill") is False:
            return report["max_model_len"], False
        prefill = await asyncio.wait_for(_await(self.prefill.report.remote()), POOL_CALL_TIMEOUT_S)
        return min(report["max_model_len"], prefill["max_model_len"]), True
