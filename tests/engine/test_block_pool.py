"""Block pool and KV cache manager: ref counts, prefix hits, salts, LRU eviction, integrity."""

from __future__ import annotations

import pytest

from common.block_hash import hash_block, hash_full_blocks
from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from common.sampling_params import SamplingParams
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request

BS = 4


def make_request(request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=8), cache_salt=salt)


def admit(kv: KVCacheManager, request: Request) -> int:
    """What the scheduler does at admission: prefix lookup, allocate, mark computed and cache."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return num_hit


@pytest.fixture
def kv():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    yield manager
    manager.check_integrity()


def test_hashes_chain_and_salt():
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, BS)
    assert len(hashes) == 2  # the partial third block is not hashed
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    assert hash_full_blocks(tokens, BS, salt="a")[0] != hashes[0]
    # A salt only enters the first block, but the chain carries it to every later one.
    assert hash_full_blocks(tokens, BS, salt="a")[1] != hashes[1]
    assert hash_full_blocks(tokens, BS, known=hashes[:1]) == hashes


def test_allocate_free_refcounts():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert blocks is not None and [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.allocate(2) is None  # short: no partial allocation
    assert pool.num_free_blocks == 1
    pool.touch(blocks[:1])
    assert blocks[0].ref_cnt == 2
    pool.free(blocks)
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free(blocks[:1])
    assert pool.num_free_blocks == 4
    pool.check_integrity()
    with pytest.raises(AssertionError, match="double free"):
        pool.free(blocks[:1])


def test_prefix_hit_and_miss(kv):
    first = make_request("a", list(range(10)))
    assert admit(kv, first) == 0
    second = make_request("b", [*list(range(8)), 99, 98, 97])
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 8 and [b.block_id for b in hits] == kv.block_ids("a")[:2]
    kv.allocate_slots(second, second.num_tokens - num_hit, hits)
    assert [b.ref_cnt for b in hits] == [2, 2]
    miss = make_request("c", [5, *list(range(1, 10))])
    assert kv.get_computed_blocks(miss)[1] == 0
    # A lookup alone records nothing: the scheduler records a request's hits once it is admitted.
    assert kv.pool.stats().num_queried_tokens == 0
    kv.free(first)
    kv.free(second)


def test_full_prompt_hit_leaves_last_token_to_compute(kv):
    admit(kv, make_request("a", list(range(8))))
    again = make_request("b", list(range(8)))
    # Both blocks are cached, but the last token's logits are needed, so only one block is reused.
    assert kv.get_computed_blocks(again)[1] == 4
    kv.free(make_request("a", []))  # blocks are freed by request id


def test_salt_isolates_tenants(kv):
    admit(kv, make_request("a", list(range(9)), salt="tenant-1"))
    assert kv.get_computed_blocks(make_request("b", list(range(9)), salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(make_request("d", list(range(9)), salt="tenant-1"))[1] == 8
    kv.free(make_request("a", []))


def test_freed_cached_blocks_are_reusable_until_evicted_lru(kv):
    a = make_request("a", list(range(9)))  # blocks: 2 full + 1 partial
    admit(kv, a)
    a_blocks = kv.block_ids("a")
    kv.free(a)
    assert kv.pool.num_free_blocks == 10  # cached-free blocks count as free
    assert kv.get_computed_blocks(make_request("b", list(range(9))))[1] == 8
    # Freed tail-first: the request's last full block sits before its first in LRU order,
    # so allocation evicts the tail of the prompt before its shared beginning.
    order = [block.block_id for block in kv.pool.free_queue]
    assert order.index(a_blocks[1]) < order.index(a_blocks[0])
    kv.pool.take_events()
    filler = make_request("f", list(range(100, 100 + 4 * 9)))  # 9 of the 10 blocks: evicts LRU-first
    assert kv.allocate_slots(filler, filler.num_tokens) is not None
    events = kv.pool.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [a.block_hashes[1]]  # tail block evicted, first block survives
    assert kv.get_computed_blocks(make_request("c", list(range(9))))[1] == 4
    kv.free(filler)


def test_events_report_stores_and_clear(kv):
    a = make_request("a", list(range(8)))
    admit(kv, a)
    events = kv.pool.take_events()
    assert events == [BlockStored(tuple(a.block_hashes), None)]
    assert kv.pool.reset_prefix_cache() is False  # blocks in use
    kv.free(a)
    assert kv.pool.reset_prefix_cache() is True
    assert isinstance(kv.pool.take_events()[-1], AllBlocksCleared)
    assert kv.get_computed_blocks(make_request("b", list(range(9))))[1] == 0


def test_allocate_counts_evictable_hits(kv):
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", [*list(range(8)), 1])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # 10 free blocks, two of them are the hits themselves: 9 new ones plus the hits must fail.
    assert kv.allocate_slots(b, 4 * 9, hits) is None
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is not None
    kv.free(b)


def test_integrity_detects_corruption():
    pool = BlockPool(3)
    blocks = pool.allocate(1)
    blocks[0].ref_cnt = 0  # corrupt: zero refs but not in the free queue
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_stored_events_name_the_right_parent_around_duplicates(kv):
    # Two requests compute the same first block concurrently; the second's copy stays private.
    a = make_request("a", list(range(8)))
    b = make_request("b", [0, 1, 2, 3, 50, 51, 52, 53])
    for r in (a, b):
        assert kv.allocate_slots(r, r.num_tokens) is not None
        r.num_computed_tokens = r.num_tokens
    kv.cache_computed_blocks(a)
    kv.pool.take_events()
    kv.cache_computed_blocks(b)  # b's first block duplicates a's; its second block is new
    (event,) = kv.pool.take_events()
    assert event == BlockStored((b.block_hashes[1],), b.block_hashes[0])
    kv.free(a)
    kv.free(b)
