"""Which sending shard gives which KV heads to which receiving shard, for any pair of TP degrees.

Shard r of a TP-t group holds global KV heads ``[r*H//t, r*H//t + max(1, H//t))`` (``H`` = the
model's KV heads; when t > H a head is replicated on t/H shards). Example, H = 3:

    prefill TP=3  s0:[h0] s1:[h1] s2:[h2]          prefill TP=1  s0:[h0 h1 h2]
                     │       │       │                              │   │   │
    decode  TP=1  r0:[h0     h1      h2]           decode  TP=3  r0:[h0] r1:[h1] r2:[h2]

    H = 2, prefill TP=2 → decode TP=4 (replication): s0:[h0] → r0:[h0], r1:[h0];  s1:[h1] → r2:[h1], r3:[h1]

Every receiving head comes from exactly one sender (the lowest rank holding it), so replicated
senders do not send twice. The plan is computed once per (sender TP, receiver TP, H).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True, slots=True)
class HeadSegment:
    sender_rank: int
    receiver_rank: int
    src_head_offset: int  # index into the sender shard's local heads
    dst_head_offset: int  # index into the receiver shard's local heads
    num_heads: int


def shard_heads(rank: int, tp_size: int, total_heads: int) -> range:
    start = rank * total_heads // tp_size
    return range(start, start + max(1, total_heads // tp_size))


@lru_cache(maxsize=64)
def plan_transfer(sender_tp: int, receiver_tp: int, total_heads: int) -> tuple[HeadSegment, ...]:
    """All head segments, grouped into maximal runs of consecutive heads from one sender to one receiver."""
    segments: list[HeadSegment] = []
    for receiver in range(receiver_tp):
        for dst_offset, head in enumerate(shard_heads(receiver, receiver_tp, total_heads)):
            sender = next(s for s in range(sender_tp) if head in shard_heads(s, sender_tp, total_heads))
            src_offset = head - shard_heads(sender, sender_tp, total_heads).start
            last = segments[-1] if segments else None
            if (
                last is not None
                and (last.sender_rank, last.receiver_rank) == (sender, receiver)
                and last.src_head_offset + last.num_heads == src_offset
                and last.dst_head_offset + last.num_heads == dst_offset
            ):
                segments[-1] = HeadSegment(
                    sender, receiver, last.src_head_offset, last.dst_head_offset, last.num_heads + 1
                )
            else:
                segments.append(HeadSegment(sender, receiver, src_offset, dst_offset, 1))
    return tuple(segments)


def segments_from(sender_rank: int, sender_tp: int, receiver_tp: int, total_heads: int) -> list[HeadSegment]:
    return [s for s in plan_transfer(sender_tp, receiver_tp, total_heads) if s.sender_rank == sender_rank]


def senders_for(receiver_rank: int, sender_tp: int, receiver_tp: int, total_heads: int) -> set[int]:
    return {
        s.sender_rank for s in plan_transfer(sender_tp, receiver_tp, total_heads) if s.receiver_rank == receiver_rank
    }
