"""The pool of KV blocks: reference counts, an O(1) free list and the prefix cache.

A block is in exactly one of three states:

    in use      ref_cnt > 0, not in the free queue (hash set if it is a full, cached block)
    cached-free ref_cnt == 0, in the free queue, hash set: reusable by a prefix hit until evicted
    free        ref_cnt == 0, in the free queue, no hash

Allocation pops from the head of the free queue; freeing appends to the tail. So the free
queue is also the LRU order of cached-free blocks: the head is evicted first. Callers free a
request's blocks tail-first, so the end of a prompt is evicted before its shared beginning.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from common.block_hash import BlockHash
from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, PrefixCacheStats


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None


class FreeBlockQueue:
    """Intrusive doubly linked list over KVBlock: O(1) popleft, append and remove-from-middle."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        assert block is not None and block is not self._tail, "popleft on an empty free queue"
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} already queued"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self):  # head (evicted first) to tail
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0, "a block pool needs at least one block"
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVCacheEvent] = []
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: free ones plus evictable cached-free ones."""
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_prefix_caching else None

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_cached_blocks=len(self.cached),
            num_queried_tokens=self.num_queried_tokens,
            num_hit_tokens=self.num_hit_tokens,
        )

    def record_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_queried_tokens
        self.num_hit_tokens += num_hit_tokens

    # --- changes -------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        """Take ``num_blocks`` fresh blocks (ref_cnt 1), evicting cached-free ones LRU; None if short."""
        if num_blocks > self.num_free_blocks:
            return None
        taken, evicted = [], []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            removed = self._evict(block)
            if removed is not None:
                evicted.append(removed)
            block.ref_cnt = 1
            taken.append(block)
        if evicted:  # one event for the allocation: a busy cache evicts thousands of blocks a second
            self._events.append(BlockRemoved(tuple(evicted)))
        return taken

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Share blocks found by a prefix hit: pin cached-free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference to each block, in the given order (that order becomes the LRU order)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_prefix_caching:
                    block.block_hash = None
                self.free_queue.append(block)

    def cache_full_blocks(
        self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash], parent: BlockHash | None
    ) -> None:
        """Register full, computed blocks under their hashes so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        run: list[BlockHash] = []  # consecutive newly stored blocks: one event, whose parent precedes them
        run_parent = parent
        previous = parent
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            assert block.ref_cnt > 0, f"caching block {block.block_id} that nobody holds"
            stored_now = False
            if block.block_hash is not None:
                assert block.block_hash == block_hash, f"block {block.block_id} re-cached under a new hash"
            else:
                block.block_hash = block_hash
                # A duplicate (same content computed twice concurrently) stays private to its request;
                # the first block keeps the cache entry.
                if block_hash not in self.cached:
                    self.cached[block_hash] = block
                    stored_now = True
            if stored_now:
                if not run:
                    run_parent = previous
                run.append(block_hash)
            elif run:
                self._events.append(BlockStored(tuple(run), run_parent))
                run = []
            previous = block_hash
        if run:
            self._events.append(BlockStored(tuple(run), run_parent))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached-free block; refuses (False) while any block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def _evict(self, block: KVBlock) -> BlockHash | None:
        """Forget the block's content; returns the hash it leaves the prefix cache under, if any."""
        block_hash = block.block_hash
        if block_hash is None:
            return None
        block.block_hash = None
        if self.cached.get(block_hash) is block:
            del self.cached[block_hash]
            return block_hash
        return None

    # --- invariants ----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the pool is broken. Tests call this after every scenario."""
        queued = list(self.free_queue)
        assert len(queued) == self.free_queue.num_free_blocks, "free queue length disagrees with its counter"
        queued_ids = {block.block_id for block in queued}
        assert len(queued_ids) == len(queued), "a block appears twice in the free queue"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            in_queue = block.block_id in queued_ids
            assert in_queue == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_free_queue={in_queue}"
            )
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"cache entry for block {block.block_id} has a stale hash"
        if not self.enable_prefix_caching:
            assert not self.cached, "prefix caching is off but the cache holds blocks"
