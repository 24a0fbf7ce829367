"""The engine on its own thread, driven from asyncio: streams, aborts, reports (what the pools build on)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from common.config import CacheConfig, EngineConfig, ModelConfig
from common.sampling_params import SamplingParams
from engine.async_engine import AsyncEngine
from engine.kv_cache.block_hash import hash_block
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
    report = asyncio.run(replica.report())
    first = hash_block(None, prompt[:16])
    second = hash_block(first, prompt[16:32])
    assert {first.hex(), second.hex()} <= set(report["recent_block_hashes"])
    assert report["replica_id"] == "r0" and report["num_blocks_held"] == 0 and report["role"] == "colocated"


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
