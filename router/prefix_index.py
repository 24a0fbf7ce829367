"""Which prompt prefixes each replica of a pool holds in its prefix cache, as the router knows it.

Two sources, merged at lookup:

    reported   every cached block's short hash (common.block_hash), from the replica's last
               report: exact as of that report, since the replica replays every KV event
               (stored, evicted, cleared) of its engine. Kept as a sorted array of 64-bit ints:
               taking in a report of 100,000 blocks is one sort, not 100,000 Python objects.
    routed     the blocks of prompts this router sent to the replica in the last few seconds:
               they will be cached there once computed, before any report says so (a burst of
               requests sharing a system prompt finds it where the first one went)

A lookup counts the prompt's leading blocks found on the replica: a prefix cache can only use a
run of blocks from the start. The prompt tokens routed since a replica's report are also summed,
for the prefill work the report does not show yet.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from common.block_hash import SHORT_HASH_BYTES

ROUTED_MEMORY_S = 10.0  # how long a routed prompt's blocks count as cached without a report
MAX_ROUTED = 4096  # routed prompts remembered per replica (bounded)
_EMPTY = np.zeros(0, dtype=np.uint64)


def as_sorted_ints(packed: bytes) -> np.ndarray:
    """Packed short hashes as a sorted array of 64-bit ints (a trailing partial hash is dropped)."""
    usable = len(packed) - len(packed) % SHORT_HASH_BYTES
    return np.sort(np.frombuffer(packed[:usable], dtype=np.uint64))


def hashes_as_ints(blocks: Sequence[bytes]) -> np.ndarray:
    """A prompt's short hashes as the 64-bit ints reports are kept as (one array per prompt)."""
    return np.frombuffer(b"".join(blocks), dtype=np.uint64)


def _holds(sorted_ints: np.ndarray, value: np.uint64) -> bool:
    at = int(sorted_ints.searchsorted(value))
    return at < len(sorted_ints) and sorted_ints[at] == value


class _RoutedLog:
    """One replica's routed prompts, oldest first, with a running sum of their new tokens, so that
    "tokens routed since t" is a binary search, not a walk over every prompt of the last seconds."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cumulative: list[int] = []  # new tokens of every entry up to and including this one
        self.blocks: list[frozenset[bytes]] = []
        self.start = 0  # entries before it have aged out
        self.dropped_total = 0  # ``cumulative`` of the last entry compacted away (0: none yet)
        self.counts: Counter[bytes] = Counter()  # the blocks of live entries, counted

    def __len__(self) -> int:
        return len(self.times) - self.start

    def append(self, at: float, blocks: frozenset[bytes], num_new_tokens: int) -> None:
        total = self.cumulative[-1] if self.cumulative else self.dropped_total
        self.times.append(at)
        self.cumulative.append(total + num_new_tokens)
        self.blocks.append(blocks)
        self.counts.update(blocks)

    def drop_oldest(self) -> None:
        counts = self.counts
        for block in self.blocks[self.start]:
            left = counts[block] - 1
            if left > 0:
                counts[block] = left
            else:
                del counts[block]
        self.blocks[self.start] = frozenset()
        self.start += 1
        if self.start > 1024 and self.start * 2 > len(self.times):  # compact now and then
            self.dropped_total = self.cumulative[self.start - 1]
            del self.times[: self.start], self.cumulative[: self.start], self.blocks[: self.start]
            self.start = 0

    def tokens_since(self, since: float) -> int:
        first = bisect.bisect_right(self.times, since, lo=self.start)
        if first >= len(self.times):
            return 0
        before = self.cumulative[first - 1] if first > 0 else self.dropped_total
        return self.cumulative[-1] - before


class PrefixIndex:
    def __init__(self) -> None:
        self._packed: dict[str, bytes] = {}  # replica id -> the report's packed short hashes
        self._reported: dict[str, np.ndarray] = {}  # the same, as sorted 64-bit ints
        self._routed: dict[str, _RoutedLog] = {}

    def update(self, replica_id: str, packed: bytes) -> None:
        """A report's cached blocks; converted only when they changed since the last report."""
        if self._packed.get(replica_id) != packed:
            self._packed[replica_id] = packed
            self._reported[replica_id] = as_sorted_ints(packed)

    def keep_only(self, replica_ids: Iterable[str]) -> None:
        """Forget replicas that are gone."""
        live = set(replica_ids)
        for table in (self._packed, self._reported, self._routed):
            for replica_id in [r for r in table if r not in live]:
                del table[replica_id]

    def routed(self, replica_id: str, blocks: Sequence[bytes], num_new_tokens: int, now: float | None = None) -> None:
        log = self._routed.setdefault(replica_id, _RoutedLog())
        if len(log) >= MAX_ROUTED:
            log.drop_oldest()
        log.append(time.time() if now is None else now, frozenset(blocks), num_new_tokens)

    def cached_prefix_blocks(
        self, replica_id: str, blocks: Sequence[bytes], now: float | None = None, as_ints: np.ndarray | None = None
    ) -> int:
        """How many of ``blocks`` (a prompt's short hashes, in order) lead the prompt on the replica.
        ``as_ints``: the same hashes as 64-bit ints (``hashes_as_ints``), when the caller has them."""
        if not blocks:
            return 0
        reported = self._reported.get(replica_id, _EMPTY)
        log = self._expired(replica_id, time.time() if now is None else now)
        routed = log.counts if log is not None else {}
        wanted = hashes_as_ints(blocks) if as_ints is None else as_ints
        if not _holds(reported, wanted[0]) and blocks[0] not in routed:
            return 0  # most replicas of a pool hold not even the first block: no array search
        found = None
        count = 0
        if len(reported):
            at = np.minimum(np.searchsorted(reported, wanted), len(reported) - 1)
            found = reported[at] == wanted
            count = len(blocks) if found.all() else int(found.argmin())  # the reported leading run
        # Where the reported run ends, prompts routed here since may carry it on (and past them,
        # reported blocks again): block by block, only over that tail.
        while count < len(blocks) and (blocks[count] in routed or (found is not None and found[count])):
            count += 1
        return count

    def tokens_routed_since(self, replica_id: str, since: float, now: float | None = None) -> int:
        """Prompt tokens sent to the replica after ``since`` (a report's time) that it had to compute."""
        log = self._expired(replica_id, time.time() if now is None else now)
        return log.tokens_since(since) if log is not None else 0

    def _expired(self, replica_id: str, now: float) -> _RoutedLog | None:
        """The replica's log, its entries older than ROUTED_MEMORY_S dropped."""
        log = self._routed.get(replica_id)
        if log is not None:
            while len(log) and log.times[log.start] < now - ROUTED_MEMORY_S:
                log.drop_oldest()
        return log
