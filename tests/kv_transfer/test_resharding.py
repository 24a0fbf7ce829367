from __future__ import annotations

import pytest

from kv_transfer.resharding import plan_transfer, senders_for, shard_heads


@pytest.mark.parametrize(
    ("sender_tp", "receiver_tp", "heads"),
    [(1, 1, 3), (3, 1, 3), (1, 3, 3), (2, 4, 2), (4, 2, 2), (3, 9, 3), (8, 2, 8), (2, 2, 8)],
)
def test_every_receiving_head_comes_from_exactly_one_holder(sender_tp, receiver_tp, heads):
    plan = plan_transfer(sender_tp, receiver_tp, heads)
    for r in range(receiver_tp):
        got = []
        for seg in (s for s in plan if s.receiver_rank == r):
            src = shard_heads(seg.sender_rank, sender_tp, heads)
            global_heads = [src.start + seg.src_head_offset + i for i in range(seg.num_heads)]
            assert global_heads == [
                shard_heads(r, receiver_tp, heads).start + seg.dst_head_offset + i for i in range(seg.num_heads)
            ]
            got.extend(global_heads)
        assert got == list(shard_heads(r, receiver_tp, heads))


def test_examples_from_the_diagram():
    assert [(s.sender_rank, s.receiver_rank, s.num_heads) for s in plan_transfer(3, 1, 3)] == [
        (0, 0, 1),
        (1, 0, 1),
        (2, 0, 1),
    ]
    assert [(s.sender_rank, s.receiver_rank) for s in plan_transfer(2, 4, 2)] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    # Replicated senders (TP 4 over 2 heads) do not both send: the lowest holder does.
    assert senders_for(0, 4, 1, 2) == {0, 2}
    assert plan_transfer(1, 1, 8)[0].num_heads == 8  # consecutive heads travel as one segment
