"""A decode replica under conditional disaggregation, on a real engine (no Ray): it computes a
prompt itself when the router's estimate of the prefill pool says that is sooner, and gives
transformers' greedy tokens; otherwise it reserves blocks and issues a ticket as always."""

from __future__ import annotations

import asyncio

import pytest

from cluster.cluster_config import KV_CONNECTOR
from common.config import CacheConfig, EngineConfig, EngineRole, KVConnectorConfig, ModelConfig, SchedulerConfig
from common.sampling_params import SamplingParams
from common.serving import RemotePrefillEstimate, ServeRequest, StreamDelta, TicketIssued
from decode_pool.server import DecodeServer


@pytest.fixture(scope="module")
def server(tiny_dir):
    connector = KVConnectorConfig(KV_CONNECTOR, {"backend": "tcp", "receive": True})
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_dir)),
        cache=CacheConfig(kv_cache_memory=8 * 2**20),
        scheduler=SchedulerConfig(role=EngineRole.DECODE, max_decode_stall_s=0.1),
        kv_connector=connector,
    )
    replica = DecodeServer(config.to_dict())
    yield replica
    replica.engine.shutdown()


def request(request_id: str, prompt: list[int], remote: RemotePrefillEstimate | None) -> ServeRequest:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return ServeRequest(request_id, prompt, params.to_dict(), remote_prefill=remote)


async def collect(server: DecodeServer, req: ServeRequest, take: int | None = None) -> list:
    items = []
    async for item in server.generate(req):
        items.append(item)
        if take is not None and len(items) >= take:
            break  # the router went away
    return items


async def wait_idle(server: DecodeServer) -> int:
    for _ in range(300):
        if await server.engine.call(lambda e: e.num_blocks_held() == 0 and not e.has_unfinished_requests()):
            return 0
        await asyncio.sleep(0.01)
    return await server.engine.call(lambda e: e.num_blocks_held())


def slow_pool() -> RemotePrefillEstimate:
    return RemotePrefillEstimate("p0", num_queued_tokens=5000, num_cached_tokens=0, tokens_per_s=100.0, overhead_s=0.1)


def test_a_slow_prefill_pool_has_the_decode_replica_compute_the_prompt(server, hf_tiny, hf_reference):
    prompt = list(range(100, 160))
    items = asyncio.run(collect(server, request("local.0", prompt, slow_pool())))
    assert all(isinstance(i, StreamDelta) for i in items)  # no ticket: nothing to hand off
    assert [t for i in items for t in i.new_token_ids] == hf_reference(hf_tiny, prompt, 8)
    last = items[-1]
    assert last.finish_reason == "length" and last.queue_time_s is not None and last.prefill_time_s is not None
    assert asyncio.run(wait_idle(server)) == 0


def test_the_decode_replica_s_own_prefix_cache_counts_for_a_follow_up_turn(server):
    prompt = list(range(200, 264))  # 4 full blocks of 16
    asyncio.run(collect(server, request("turn.0", prompt, slow_pool())))
    follow_up = prompt + list(range(300, 320))
    items = asyncio.run(collect(server, request("turn.1", follow_up, slow_pool())))
    assert items[-1].num_cached_tokens >= 64
    assert asyncio.run(wait_idle(server)) == 0


def test_a_prefill_pool_holding_the_prompt_gets_it_and_a_ticket_is_issued(server):
    prompt = list(range(400, 464))
    warm_pool = RemotePrefillEstimate("p0", num_queued_tokens=0, num_cached_tokens=63, tokens_per_s=1e6, overhead_s=0.0)
    items = asyncio.run(collect(server, request("remote.0", prompt, warm_pool), take=1))
    assert isinstance(items[0], TicketIssued) and items[0].ticket["request_id"] == "remote.0"
    assert asyncio.run(wait_idle(server)) == 0  # the router left: the reservation is freed


def test_without_an_estimate_the_replica_always_reserves(server):
    items = asyncio.run(collect(server, request("plain.0", list(range(500, 540)), None), take=1))
    assert isinstance(items[0], TicketIssued)
    assert asyncio.run(wait_idle(server)) == 0


def test_a_router_that_leaves_a_locally_computed_request_frees_its_blocks(server):
    prompt = list(range(600, 700))
    items = asyncio.run(collect(server, request("gone.0", prompt, slow_pool()), take=1))
    assert isinstance(items[0], StreamDelta) and items[0].new_token_ids  # computed here, then abandoned
    assert asyncio.run(wait_idle(server)) == 0


def test_a_replica_that_would_not_chunk_prompts_always_reserves(tiny_dir):
    # Without max_decode_stall_s a prompt computed here would hold up the running batch for its
    # whole length, which the decision does not cost: such a replica never takes one.
    connector = KVConnectorConfig(KV_CONNECTOR, {"backend": "tcp", "receive": True})
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_dir)),
        cache=CacheConfig(kv_cache_memory=8 * 2**20),
        scheduler=SchedulerConfig(role=EngineRole.DECODE),
        kv_connector=connector,
    )
    replica = DecodeServer(config.to_dict())
    try:
        site = asyncio.run(
            replica.engine.call(lambda e: replica._weigh_prefill_site(e, request("x", [1, 2], slow_pool())))
        )
        assert not site.local and "no max_decode_stall_s" in site.reason
        items = asyncio.run(collect(replica, request("unchunked.0", list(range(100, 160)), slow_pool()), take=1))
        assert isinstance(items[0], TicketIssued)
        assert asyncio.run(wait_idle(replica)) == 0
    finally:
        replica.engine.shutdown()
