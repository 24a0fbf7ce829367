"""Tokens per streamed chunk (vLLM's and SGLang's ``--stream-interval``).

Every chunk a client receives costs CPU all along its way: the decode replica's delta, the
router's orchestrator step and SSE event, an HTTP write, the client's parse. On a CPU host that
CPU is taken from the cores the engine needs. With an interval of N, a request's first token
still leaves at once (TTFT is unchanged) and its later tokens leave N at a time, the last chunk
with whatever is left; TPOT averaged over a request is unchanged, the gaps between chunks grow.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from common.outputs import RequestOutput


async def every_n_tokens(batches: AsyncIterator[list[RequestOutput]], n: int) -> AsyncIterator[list[RequestOutput]]:
    """The request's outputs regrouped: the first batch as it comes, then a batch once ``n`` new
    tokens are held or the request finished (errors and aborts finish it too). ``batches`` ends
    only after a finished output (AsyncEngine.stream), so nothing is left held at its end."""
    held: list[RequestOutput] = []
    num_held = 0
    first = True
    async for batch in batches:
        held.extend(batch)
        num_held += sum(len(output.outputs[0].new_token_ids) for output in batch)
        if first or num_held >= n or held[-1].finished:
            yield held
            held, num_held, first = [], 0, False
