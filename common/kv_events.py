"""Events a replica's block pool emits as its prefix cache changes.

A cache-aware router replays these per replica to know which prefixes each one holds
without asking. Hashes are the chained SHA-256 block hashes of ``common.block_hash``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counters since start; a report diffs two of them."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_queried_tokens: int
    num_hit_tokens: int

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
