"""The decode side's reservation, handed to prefill: where to send, into which blocks, for how long.

The lease travels as a duration, never as a time of day: two hosts' wall clocks need not agree (a
sender whose clock ran ahead would take every lease as expired, one behind would push into blocks
freed long ago). Each process keeps the ticket's deadline on its own monotonic clock, from when it
received the ticket; the ticket written out again carries what is left of it. Transit between two
processes is not subtracted: the sender's deadline can trail the receiver's by that much, and the
receiver, which holds the blocks, refuses whatever comes after its own.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from common.errors import PdserveError
from common.kv_layout import KVCacheLayout


class TicketError(PdserveError):
    """A ticket cannot be honoured: layouts disagree, the lease expired, or it is malformed."""


@dataclass(frozen=True)
class KVTicket:
    request_id: str
    backend: str
    receiver_endpoints: tuple[str, ...]  # one per receiver shard, rank order
    layout: KVCacheLayout  # the receiver's (tp_rank 0's; every shard differs only in tp_rank)
    model_id: str
    block_ids: tuple[int, ...]  # the same ids on every receiver shard
    num_tokens: int  # prompt tokens whose KV is sent
    lease_deadline: float  # time.monotonic() of this process after which the lease is over
    secret: bytes = field(repr=False)  # authenticates every chunk (HMAC); never logged

    def __post_init__(self) -> None:
        needed = -(-self.num_tokens // self.layout.block_size)
        if len(self.block_ids) < needed:
            raise TicketError(f"ticket {self.request_id}: {len(self.block_ids)} blocks for {self.num_tokens} tokens")
        if len(self.receiver_endpoints) != self.layout.tp_size:
            raise TicketError(
                f"ticket {self.request_id}: {len(self.receiver_endpoints)} endpoints for TP {self.layout.tp_size}"
            )

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.layout.block_size)

    def is_expired(self, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) >= self.lease_deadline

    def lease_left_s(self) -> float:
        return max(0.0, self.lease_deadline - time.monotonic())

    def check_sender(self, layout: KVCacheLayout, model_id: str) -> None:
        """Refuse, before any byte moves, a sender whose cache cannot be copied into this ticket's."""
        mine = self.layout
        if model_id != self.model_id:
            raise TicketError(f"model mismatch: sender runs {model_id!r}, receiver {self.model_id!r}")
        for name in ("num_layers", "total_kv_heads", "head_dim", "dtype"):
            if getattr(layout, name) != getattr(mine, name):
                raise TicketError(
                    f"layout mismatch on {name}: sender {getattr(layout, name)}, receiver {getattr(mine, name)}"
                )
        if layout.block_size != mine.block_size:
            raise TicketError(
                f"block size mismatch: sender {layout.block_size}, receiver {mine.block_size}; "
                "configure both pools with the same block_size"
            )

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "backend": self.backend,
            "receiver_endpoints": list(self.receiver_endpoints),
            "layout": self.layout.to_dict(),
            "model_id": self.model_id,
            "block_ids": list(self.block_ids),
            "num_tokens": self.num_tokens,
            "lease_s": self.lease_left_s(),  # a duration: the reader's clock starts it again
            "secret": self.secret,
        }

    @classmethod
    def from_dict(cls, data: dict) -> KVTicket:
        return cls(
            request_id=data["request_id"],
            backend=data["backend"],
            receiver_endpoints=tuple(data["receiver_endpoints"]),
            layout=KVCacheLayout.from_dict(data["layout"]),
            model_id=data["model_id"],
            block_ids=tuple(data["block_ids"]),
            num_tokens=data["num_tokens"],
            lease_deadline=time.monotonic() + float(data["lease_s"]),
            secret=bytes(data["secret"]),
        )


def make_ticket(
    request_id: str,
    backend: str,
    receiver_endpoints: list[str],
    layout: KVCacheLayout,
    model_id: str,
    block_ids: list[int],
    num_tokens: int,
    lease_s: float,
) -> KVTicket:
    return KVTicket(
        request_id=request_id,
        backend=backend,
        receiver_endpoints=tuple(receiver_endpoints),
        layout=layout,
        model_id=model_id,
        block_ids=tuple(block_ids),
        num_tokens=num_tokens,
        lease_deadline=time.monotonic() + lease_s,
        secret=secrets.token_bytes(32),
    )
