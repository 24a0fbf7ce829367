"""The router's view of each replica's prefix cache: reported blocks, plus prompts it routed lately."""

from __future__ import annotations

from common.block_hash import hash_full_blocks, pack_short_hashes, short_hashes
from router import prefix_index
from router.prefix_index import ROUTED_MEMORY_S, PrefixIndex


def blocks(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return short_hashes(hash_full_blocks(tokens, 16, salt))


SYSTEM = list(range(1000, 1064))  # four blocks every conversation shares
PROMPT = SYSTEM + list(range(5000, 5032))  # two blocks of its own


def test_a_reported_prefix_counts_its_leading_blocks_only():
    index = PrefixIndex()
    index.update("a", pack_short_hashes(blocks(SYSTEM)))
    assert index.cached_prefix_blocks("a", blocks(PROMPT)) == 4
    assert index.cached_prefix_blocks("b", blocks(PROMPT)) == 0  # never reported
    # a later block cached without the earlier ones is of no use to a prefix cache
    index.update("a", pack_short_hashes(blocks(PROMPT)[1:]))
    assert index.cached_prefix_blocks("a", blocks(PROMPT)) == 0


def test_reported_and_routed_blocks_carry_one_leading_run_between_them():
    index = PrefixIndex()
    hashes = blocks(PROMPT)  # six blocks
    index.update("a", pack_short_hashes([hashes[0], hashes[1], hashes[3], hashes[5]]))
    index.routed("a", [hashes[2]], num_new_tokens=16, now=100.0)
    # 0, 1 reported, 2 routed, 3 reported again; 4 is nowhere, so 5 does not count
    assert index.cached_prefix_blocks("a", hashes, now=101.0) == 4
    assert index.cached_prefix_blocks("a", hashes, now=101.0, as_ints=prefix_index.hashes_as_ints(hashes)) == 4
    assert index.cached_prefix_blocks("a", hashes, now=100.0 + ROUTED_MEMORY_S + 1) == 2  # the routed one aged out


def test_a_salt_changes_every_block():
    index = PrefixIndex()
    index.update("a", pack_short_hashes(blocks(PROMPT, salt="tenant-a")))
    assert index.cached_prefix_blocks("a", blocks(PROMPT, salt="tenant-a")) == 6
    assert index.cached_prefix_blocks("a", blocks(PROMPT, salt="tenant-b")) == 0
    assert index.cached_prefix_blocks("a", blocks(PROMPT)) == 0


def test_routed_prompts_count_until_they_age_out_and_their_tokens_until_a_report_covers_them():
    index = PrefixIndex()
    index.routed("a", blocks(PROMPT), num_new_tokens=96, now=100.0)
    assert index.cached_prefix_blocks("a", blocks(SYSTEM + [1] * 16), now=101.0) == 4
    assert index.tokens_routed_since("a", since=99.0, now=101.0) == 96  # the last report predates it
    assert index.tokens_routed_since("a", since=100.5, now=101.0) == 0  # a report taken after it shows the work
    assert index.cached_prefix_blocks("a", blocks(PROMPT), now=100.0 + ROUTED_MEMORY_S + 1) == 0
    assert index.tokens_routed_since("a", since=0.0, now=100.0 + ROUTED_MEMORY_S + 1) == 0  # aged out


def test_overlapping_routed_prompts_age_out_one_by_one():
    index = PrefixIndex()
    index.routed("a", blocks(PROMPT), 96, now=100.0)
    index.routed("a", blocks(SYSTEM), 64, now=105.0)
    later = 100.0 + ROUTED_MEMORY_S + 1  # the first has aged out, the second not
    assert index.cached_prefix_blocks("a", blocks(PROMPT), now=later) == 4


def test_an_unchanged_report_is_not_unpacked_again_and_gone_replicas_are_forgotten(monkeypatch):
    unpacked: list[bytes] = []
    real = prefix_index.as_sorted_ints
    monkeypatch.setattr(prefix_index, "as_sorted_ints", lambda packed: unpacked.append(packed) or real(packed))
    index = PrefixIndex()
    packed = pack_short_hashes(blocks(PROMPT))
    index.update("a", packed)
    index.update("a", bytes(packed))  # equal bytes: not converted again
    assert unpacked == [packed] and index.cached_prefix_blocks("a", blocks(PROMPT)) == 6
    index.routed("b", blocks(SYSTEM), 64)
    index.keep_only(["b"])
    assert index.cached_prefix_blocks("a", blocks(PROMPT)) == 0
    assert index.cached_prefix_blocks("b", blocks(SYSTEM)) == 4


def test_tokens_routed_since_sums_the_entries_after_a_time_however_many_there_are():
    index = PrefixIndex()
    n = 2 * prefix_index.MAX_ROUTED + 904  # more than are kept (the oldest fall off), and compactions
    for i in range(n):
        index.routed("a", blocks([i] * 16), num_new_tokens=i, now=1000.0 + i * 0.001)
    now = 1000.0 + n * 0.001
    assert index.tokens_routed_since("a", since=1000.0 + (n - 500) * 0.001 - 0.0005, now=now) == sum(range(n - 500, n))
    assert index.tokens_routed_since("a", since=0.0, now=now) == sum(range(n - prefix_index.MAX_ROUTED, n))
    assert index.cached_prefix_blocks("a", blocks([n - 1] * 16), now=now) == 1
    assert index.cached_prefix_blocks("a", blocks([0] * 16), now=now) == 0  # fell off


def test_queued_tokens_stay_right_after_compaction_when_every_live_entry_is_newer_than_the_report():
    index = PrefixIndex()
    n = 3 * prefix_index.MAX_ROUTED  # compacted at least once
    for i in range(n):
        index.routed("a", [], num_new_tokens=1, now=1000.0 + i * 0.001)
    # A report older than every entry still alive: exactly the live entries count, not all ever routed.
    assert index.tokens_routed_since("a", since=0.0, now=1000.0 + n * 0.001) == prefix_index.MAX_ROUTED
