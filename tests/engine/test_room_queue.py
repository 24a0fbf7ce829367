"""Decode reservations during a burst: a bounded FIFO woken when blocks free, with a deadline.

A real decode-role engine (tiny model) on its thread; ``fn`` is the engine's own ``reserve``, as
the decode replica calls it. Block counts are read from the engine, so the tests hold for any
KV budget.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from common.config import CacheConfig, EngineConfig, EngineRole, ModelConfig, SchedulerConfig
from common.errors import InvalidRequestError, OverloadedError
from common.sampling_params import SamplingParams
from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine

PARAMS = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture
def decode(tiny_dir):
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_dir)),
        cache=CacheConfig(kv_cache_memory=512 * 2**10, enable_prefix_caching=False),  # 64 blocks here
        scheduler=SchedulerConfig(role=EngineRole.DECODE),
    )
    engine = AsyncEngine(LLMEngine(config), max_waiting_for_room=2)
    yield engine
    engine.shutdown()


def reserve(request_id: str, num_tokens: int):
    prompt = [100 + i % 1000 for i in range(num_tokens)]
    return lambda e: e.reserve(request_id, prompt, PARAMS)


def tokens_for(engine: AsyncEngine, num_blocks: int) -> int:
    """A prompt length whose reservation (prompt + one token) takes exactly ``num_blocks`` blocks."""
    return num_blocks * engine.engine.layout.block_size - 1


def test_reservations_wait_in_order_and_are_served_when_blocks_free(decode):
    total = decode.engine.layout.num_blocks
    assert total >= 4, "the KV budget must hold a few blocks"

    async def run():
        holder = await decode.call_when_room(reserve("holder", tokens_for(decode, total - 1)), timeout_s=5)
        assert len(holder) == total - 1
        # The head needs 2 blocks (1 free): it waits, and the 1-block request behind it may not pass it.
        big = asyncio.ensure_future(decode.call_when_room(reserve("big", tokens_for(decode, 2)), timeout_s=30))
        small = asyncio.ensure_future(decode.call_when_room(reserve("small", tokens_for(decode, 1)), timeout_s=30))
        await asyncio.sleep(0.3)
        assert not big.done() and not small.done()
        assert decode.num_waiting_for_room == 2
        with pytest.raises(OverloadedError, match="already waiting"):  # the queue holds 2
            await decode.call_when_room(reserve("third", tokens_for(decode, 1)), timeout_s=30)
        await decode.call(lambda e: e.abort_request("holder"))  # blocks free: both are woken, in order
        got_big, got_small = await asyncio.wait_for(asyncio.gather(big, small), 10)
        assert len(got_big) == 2 and len(got_small) == 1
        assert decode.num_waiting_for_room == 0
        for request_id in ("big", "small"):
            await decode.call(lambda e, r=request_id: e.abort_request(r))
        return await decode.call(lambda e: e.num_blocks_held())

    assert asyncio.run(run()) == 0


def test_a_reservation_past_its_deadline_is_refused_and_frees_its_place(decode):
    total = decode.engine.layout.num_blocks

    async def run():
        await decode.call_when_room(reserve("holder", tokens_for(decode, total)), timeout_s=5)
        started = time.monotonic()
        with pytest.raises(OverloadedError, match="in time"):
            await decode.call_when_room(reserve("late", tokens_for(decode, 1)), timeout_s=0.3)
        waited = time.monotonic() - started
        assert decode.num_waiting_for_room == 0
        # Its place is free again: two more fit in the queue of two.
        waiters = [
            asyncio.ensure_future(decode.call_when_room(reserve(f"w{i}", tokens_for(decode, 1)), timeout_s=30))
            for i in range(2)
        ]
        await asyncio.sleep(0.2)
        await decode.call(lambda e: e.abort_request("holder"))
        await asyncio.wait_for(asyncio.gather(*waiters), 10)
        return waited

    assert asyncio.run(run()) >= 0.3


def test_a_caller_that_leaves_gives_up_its_place(decode):
    total = decode.engine.layout.num_blocks

    async def run():
        await decode.call_when_room(reserve("holder", tokens_for(decode, total)), timeout_s=5)
        gone = asyncio.ensure_future(decode.call_when_room(reserve("gone", tokens_for(decode, 1)), timeout_s=30))
        await asyncio.sleep(0.2)
        gone.cancel()
        for _ in range(100):  # the engine thread drops it within its idle wait (0.1 s)
            if decode.num_waiting_for_room == 0:
                break
            await asyncio.sleep(0.02)
        assert decode.num_waiting_for_room == 0
        await decode.call(lambda e: e.abort_request("holder"))
        # Nothing was reserved for the caller that left.
        return await decode.call(lambda e: (e.num_blocks_held(), "gone" in e.scheduler.requests))

    assert asyncio.run(run()) == (0, False)


def test_a_request_that_can_never_fit_is_refused_at_once_not_queued(decode):
    async def run():
        too_long = decode.engine.max_model_len + 10
        with pytest.raises(InvalidRequestError, match="shorten the prompt"):
            await decode.call_when_room(reserve("huge", too_long), timeout_s=30)
        return decode.num_waiting_for_room

    assert asyncio.run(run()) == 0


async def engine_thread_pass(engine) -> None:
    """Returns once the engine thread has made a whole pass of its loop (commands, then the waiters
    for room) after everything queued before: the second of two commands runs after the pass that
    followed the first."""
    for _ in range(2):
        await engine.call(lambda e: None)


def test_callers_cancelled_at_any_moment_leave_the_queue_consistent(decode):
    total = decode.engine.layout.num_blocks

    async def run():
        await decode.call_when_room(reserve("holder", tokens_for(decode, total)), timeout_s=5)
        for i in range(40):  # cancelled before, while and after the engine thread queues them
            task = asyncio.ensure_future(decode.call_when_room(reserve(f"c{i}", tokens_for(decode, 1)), timeout_s=30))
            for _ in range(i % 4):
                await asyncio.sleep(0.001 * (i % 3))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await engine_thread_pass(decode)  # the engine thread drops what was left
        assert decode.is_healthy and decode.num_waiting_for_room == 0
        # Every place came back: two fit, a third is refused.
        waiters = [
            asyncio.ensure_future(decode.call_when_room(reserve(f"w{i}", tokens_for(decode, 1)), timeout_s=30))
            for i in range(2)
        ]
        await engine_thread_pass(decode)  # both hold their places
        with pytest.raises(OverloadedError, match="already waiting"):
            await decode.call_when_room(reserve("third", tokens_for(decode, 1)), timeout_s=30)
        await decode.call(lambda e: e.abort_request("holder"))
        await asyncio.wait_for(asyncio.gather(*waiters), 10)
        return await decode.call(lambda e: sorted(e.scheduler.reserved))

    assert asyncio.run(run()) == ["w0", "w1"]  # none of the cancelled callers holds blocks
