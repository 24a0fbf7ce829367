"""decode_pool.stream_interval: how a request's outputs are regrouped into streamed chunks."""

from __future__ import annotations

import asyncio

import pytest

from common.outputs import CompletionOutput, RequestOutput
from decode_pool.server import to_delta
from decode_pool.stream_interval import every_n_tokens


def _output(tokens: list[int], finished: bool = False, error: str | None = None) -> RequestOutput:
    completion = CompletionOutput(
        index=0, text="", token_ids=[], new_token_ids=tokens, new_text="".join(f"<{t}>" for t in tokens)
    )
    if finished:
        completion.finish_reason = "error" if error else "length"
    return RequestOutput("r", None, [1, 2, 3], [completion], finished=finished, error=error)


async def _batches(items):
    for batch in items:
        yield batch
        await asyncio.sleep(0)


def _regroup(items, n):
    async def collect():
        return [
            [t for o in batch for t in o.outputs[0].new_token_ids] async for batch in every_n_tokens(_batches(items), n)
        ]

    return asyncio.run(collect())


def test_the_first_token_leaves_alone_then_n_at_a_time_and_the_rest_with_the_last():
    steps = [[_output([t])] for t in range(1, 10)] + [[_output([10], finished=True)]]
    assert _regroup(steps, 4) == [[1], [2, 3, 4, 5], [6, 7, 8, 9], [10]]
    assert _regroup(steps, 3) == [[1], [2, 3, 4], [5, 6, 7], [8, 9, 10]]
    assert _regroup(steps, 1) == [[t] for t in range(1, 11)]


def test_a_slow_reader_catching_up_counts_every_token_it_gets():
    steps = [[_output([1])], [_output([2]), _output([3]), _output([4])], [_output([5], finished=True)]]
    assert _regroup(steps, 2) == [[1], [2, 3, 4], [5]]


@pytest.mark.parametrize("error", [None, "engine failed"])
def test_a_request_that_ends_early_sends_what_it_held_at_once(error):
    steps = [[_output([1])], [_output([2])], [_output([], finished=True, error=error)]]
    batches = []

    async def collect():
        async for batch in every_n_tokens(_batches(steps), 8):
            batches.append(batch)

    asyncio.run(collect())
    last = to_delta(batches[-1], "d0")
    assert last.new_token_ids == [2] and last.finish_reason == ("error" if error else "length")
    assert last.error == error
