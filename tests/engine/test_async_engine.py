"""The engine on its own thread, driven from asyncio: streams, aborts, reports (what the pools build on)."""

from __future__ import annotations

import asyncio
import collections
import threading

import pytest

from common.block_hash import hash_block, hash_full_blocks, unpack_short_hashes
from common.config import CacheConfig, EngineConfig, ModelConfig
from common.sampling_params import SamplingParams
from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.replica import EngineReplica


@pytest.fixture
def replica(tiny_dir):
    config = EngineConfig(model=ModelConfig(model=str(tiny_dir)), cache=CacheConfig(kv_cache_memory=8 * 2**20))
    host = EngineReplica(AsyncEngine(LLMEngine(config)), "r0")
    yield host
    host.engine.shutdown()


async def _generate(host: EngineReplica, request_id: str, prompt: list[int], params: SamplingParams, take=None):
    outputs = host.engine.open_stream(request_id)
    await host.engine.call(lambda e: e.add_request(request_id, prompt, params))
    got = []
    async for batch in host.engine.stream(request_id, outputs, item_timeout_s=60):
        got.extend(batch)
        if take is not None and len(got) >= take:
            break  # the consumer goes away: the request must be aborted
    return got


def test_a_stream_yields_every_token_once_then_finishes(replica):
    prompt = list(range(10, 45))
    outputs = asyncio.run(_generate(replica, "a", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    assert outputs[-1].finished and [o.finished for o in outputs[:-1]] == [False] * (len(outputs) - 1)
    streamed = [t for o in outputs for t in o.outputs[0].new_token_ids]
    assert streamed == outputs[-1].outputs[0].token_ids and len(streamed) == 5


def test_a_consumer_that_leaves_aborts_the_request_and_frees_its_blocks(replica):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    asyncio.run(_generate(replica, "gone", list(range(10, 30)), params, take=2))

    async def held() -> int:
        for _ in range(200):
            if await replica.num_blocks_held() == 0 and not await replica.engine.call(
                lambda e: e.has_unfinished_requests()
            ):
                return 0
            await asyncio.sleep(0.01)
        return await replica.num_blocks_held()

    assert asyncio.run(held()) == 0


def test_the_report_names_the_prefix_blocks_it_cached(replica):
    prompt = list(range(100, 140))  # two full 16-token blocks, then a partial one
    asyncio.run(_generate(replica, "c", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
    report = asyncio.run(replica.report(include_cache=True))
    first = hash_block(None, prompt[:16])
    second = hash_block(first, prompt[16:32])
    assert {first[:8], second[:8]} <= unpack_short_hashes(report["cached_blocks"])
    assert report["replica_id"] == "r0" and report["num_blocks_held"] == 0 and report["role"] == "colocated"
    assert asyncio.run(replica.report())["cached_blocks"] == b""  # only routing stats carry them


def cached_now(host: EngineReplica) -> set[bytes]:
    """What the engine's prefix cache holds, read on its thread: the truth a report must match."""
    hashes = asyncio.run(host.engine.call(lambda e: list(e.kv.pool.cached)))
    return {h[:8] for h in hashes}


def test_the_reported_cache_stays_exact_through_evictions_and_lost_events(replica):
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    num_blocks = asyncio.run(replica.engine.call(lambda e: e.kv.pool.num_blocks))
    # More distinct prompts than the cache holds: the oldest blocks are evicted as new ones come.
    prompts = [[1000 + 97 * i + t for t in range(64)] for i in range(num_blocks // 3)]
    for i, prompt in enumerate(prompts):
        asyncio.run(_generate(replica, f"p{i}", prompt, params))
        if i % 7 == 0:
            reported = unpack_short_hashes(asyncio.run(replica.report(include_cache=True))["cached_blocks"])
            assert reported == cached_now(replica)
    reported = unpack_short_hashes(asyncio.run(replica.report(include_cache=True))["cached_blocks"])
    assert reported == cached_now(replica)
    assert not {h[:8] for h in hash_full_blocks(prompts[0], 16)} & reported  # evicted long ago
    # Events that fall off the engine's bounded queue unread: the next report takes the cache anew.
    replica.engine.kv_events = collections.deque(maxlen=1)  # the engine is idle: safe to swap
    asyncio.run(_generate(replica, "late-a", list(range(5000, 5064)), params))
    asyncio.run(_generate(replica, "late-b", list(range(6000, 6064)), params))
    assert replica.engine.kv_events_lost > 0
    reported = unpack_short_hashes(asyncio.run(replica.report(include_cache=True))["cached_blocks"])
    assert reported == cached_now(replica)
    assert {h[:8] for h in hash_full_blocks(list(range(5000, 5064)), 16)} <= reported


def test_a_failed_step_ends_every_open_stream_with_the_error(replica):
    def boom(*args, **kwargs):
        raise RuntimeError("injected step failure")

    async def run():
        outputs = replica.engine.open_stream("x")
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

        def add(engine):
            engine.step = boom  # the next step fails
            engine.add_request("x", list(range(10, 20)), params)

        await replica.engine.call(add)
        return [o async for batch in replica.engine.stream("x", outputs, item_timeout_s=30) for o in batch]

    outputs = asyncio.run(run())
    assert outputs[-1].finished and "injected step failure" in outputs[-1].error
    with pytest.raises(RuntimeError, match="engine failed"):
        replica.check_health()


def test_a_slow_consumer_gets_the_outputs_queued_meanwhile_in_one_item(replica):
    from decode_pool.server import to_delta

    async def run():
        outputs = replica.engine.open_stream("slow")
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        await replica.engine.call(lambda e: e.add_request("slow", list(range(10, 30)), params))
        batches = []
        async for batch in replica.engine.stream("slow", outputs, item_timeout_s=60):
            batches.append(batch)
            await asyncio.sleep(0.2)  # far slower than the tiny model's steps
        return batches

    batches = asyncio.run(run())
    assert len(batches) < 12 and any(len(batch) > 1 for batch in batches)
    assert [o.finished for batch in batches for o in batch] == [False] * (sum(map(len, batches)) - 1) + [True]
    deltas = [to_delta(batch, "r0") for batch in batches]
    final = batches[-1][-1].outputs[0]
    assert [t for d in deltas for t in d.new_token_ids] == final.token_ids and len(final.token_ids) == 12
    assert "".join(d.new_text for d in deltas) == final.text
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])


def test_an_engine_built_by_a_factory_is_built_and_stepped_on_the_engine_thread(tiny_dir):
    """The model load's parallel work and the steps share one thread, so the process has one
    OpenMP team (common.openmp)."""
    config = EngineConfig(model=ModelConfig(model=str(tiny_dir)), cache=CacheConfig(kv_cache_memory=8 * 2**20))
    built_on = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread())
        return LLMEngine(config)

    host = EngineReplica(AsyncEngine(build), "r0")
    try:
        assert built_on == [host.engine._thread] and host.engine._thread is not threading.current_thread()
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        outputs = asyncio.run(_generate(host, "f", list(range(10, 30)), params))
        assert sum(len(o.outputs[0].new_token_ids) for o in outputs) == 3
    finally:
        host.engine.shutdown()


def test_a_factory_that_fails_fails_the_constructor_and_leaves_no_engine_thread():
    def build() -> LLMEngine:
        raise ValueError("no such model")

    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(build)
    assert set(threading.enumerate()) <= before  # its engine thread is gone, joined


def test_a_step_hands_every_stream_its_output_in_one_wake_up_of_the_loop(replica):
    """Eight requests decoding together: each step's outputs reach the event loop in one
    call_soon_threadsafe, not eight (each one writes to the loop's wake-up pipe)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def run() -> tuple[int, int, list[list]]:
        loop = asyncio.get_running_loop()
        wake_ups = 0
        original = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            nonlocal wake_ups
            # Outputs only (a finished call() resolves its future through this too).
            if getattr(callback, "__name__", "") in ("_put_each", "put_nowait"):
                wake_ups += 1
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        steps_before = replica.engine.num_steps
        results = await asyncio.gather(
            *(_generate(replica, f"s{i}", list(range(20 + i, 40 + i)), params) for i in range(8))
        )
        return wake_ups, replica.engine.num_steps - steps_before, results

    wake_ups, steps, results = asyncio.run(run())
    for outputs in results:
        assert [t for o in outputs for t in o.outputs[0].new_token_ids] == outputs[-1].outputs[0].token_ids
        assert len(outputs[-1].outputs[0].token_ids) == 6
    assert steps >= 6 and wake_ups <= steps  # one hand-over per step at most (8 streams each)


def test_the_prefix_lookup_counts_what_admission_would_hit_and_holds_nothing(tiny_dir):
    engine = LLMEngine(
        EngineConfig(model=ModelConfig(model=str(tiny_dir)), cache=CacheConfig(kv_cache_memory=8 * 2**20))
    )
    try:
        prompt = list(range(10, 60))  # 3 full blocks of 16 and 2 tokens
        assert engine.cached_prefix_tokens(prompt) == 0
        engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=1), cache_salt="t")
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.cached_prefix_tokens(prompt, "t") == 48
        assert engine.cached_prefix_tokens(prompt) == 0  # another tenant's salt
        assert engine.cached_prefix_tokens(prompt[:48], "t") == 32  # the last token is always computed
        assert engine.cached_prefix_tokens(prompt[:20] + [7] * 30, "t") == 16  # leading blocks only
        assert engine.num_blocks_held() == 0
        # What admission finds is what the lookup said.
        engine.add_request("b", [*prompt, 1, 2], SamplingParams(temperature=0, max_tokens=1), cache_salt="t")
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert [o.num_cached_tokens for o in outputs if o.finished] == [48]
    finally:
        engine.shutdown()
