"""Per-request block tables on top of the block pool; the scheduler's only view of KV memory.

Allocation answers ``None`` when blocks do not fit; the scheduler then preempts. Block ``i``
of a request holds its tokens ``[i * block_size, (i + 1) * block_size)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.block_hash import hash_full_blocks
from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_blocks.get(request_id, ())]

    def num_held_blocks(self) -> int:
        """Blocks referenced by live requests (not counting cached-free ones)."""
        return self.pool.num_used_blocks

    def _update_hashes(self, request: Request) -> None:
        if self.pool.enable_prefix_caching:
            # A placeholder's value is unknown (async scheduling): a block hashed with it would
            # never be hit, nor would any block after it.
            assert not request.has_placeholder, f"{request.request_id}: hashed with a placeholder"
            request.block_hashes = hash_full_blocks(
                request.all_token_ids, self.block_size, request.cache_salt, request.block_hashes
            )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a new request, as blocks and token count.

        At least one token is always left to compute: the last position's logits are needed.
        """
        if not self.pool.enable_prefix_caching:
            return [], 0
        self._update_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        # Hit statistics are recorded by the caller once the request is admitted (a lookup may repeat).
        return hits, len(hits) * self.block_size

    def cached_prefix_tokens(self, token_ids: Sequence[int], cache_salt: str | None) -> int:
        """How many leading tokens of a prompt the prefix cache holds now: a lookup only (nothing is
        pinned, no statistics). As in get_computed_blocks, the last token never counts."""
        if not self.pool.enable_prefix_caching or len(token_ids) <= self.block_size:
            return 0
        max_hit_blocks = (len(token_ids) - 1) // self.block_size
        hashes = hash_full_blocks(token_ids[: max_hit_blocks * self.block_size], self.block_size, cache_salt)
        num_hits = 0
        for block_hash in hashes:
            if self.pool.get_cached_block(block_hash) is None:
                break
            num_hits += 1
        return num_hits * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones; None if they do not fit.

        ``new_computed_blocks`` (from get_computed_blocks, admission only) are shared, not copied.
        """
        held = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(held) - len(new_computed_blocks)
        # Cached-free hits sit in the free queue: pinning them takes them out of the allocatable count.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if max(num_needed, 0) + num_evictable_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0)) or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)
        if new_computed_blocks:
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        return new_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's full blocks whose KV is now computed to the prefix cache."""
        if not self.pool.enable_prefix_caching:
            return
        self._update_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        done = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        blocks = self.req_blocks[request.request_id]
        parent = request.block_hashes[done - 1] if done else None
        self.pool.cache_full_blocks(blocks[done:num_full], request.block_hashes[done:num_full], parent)
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Return a request's blocks; tail blocks go first so they are evicted before shared prefixes."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for block in blocks:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but {refs.get(block.block_id, 0)} holders"
            )
