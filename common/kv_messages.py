"""What the engine's driver and each shard's KV connector tell each other, typed on both sides.

    driver ── ConnectorStep ──▶ every shard's connector, before its forward pass
              (windows to push this step, tickets to expect, transfers to forget or cancel)
    driver ◀── ShardReport ─── every shard's connector, after it
              (each open transfer's state on that shard)

The engine builds and reads these without importing kv_transfer, which implements the connector.
Tickets ride inside as the plain dicts kv_transfer's ``KVTicket.to_dict`` makes: the engine only
passes them on (it reads ``request_id`` and ``lease_s``, a duration), and the connector checks them.
msgpack appears only where a message crosses a process (``to_wire``/``from_wire``); a wire
message is a shard's own driver's, never a network peer's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

Ticket = dict[str, Any]  # a KVTicket as a dict (kv_transfer.ticket)


class TransferState(enum.IntEnum):
    """A transfer's state on one shard. Ordered: a transfer only moves forward, and DONE/FAILED are terminal."""

    PENDING = 0
    TRANSFERRING = 1
    DONE = 2
    FAILED = 3

    @property
    def is_terminal(self) -> bool:
        return self >= TransferState.DONE


@dataclass(frozen=True, slots=True)
class PushWindow:
    """One window of a ticket's blocks that a prefill shard pushes, layer by layer, during this step.

    A transfer's first window names its ticket; each next one only the request. After the last
    window (``last``) the connector sends the "done" with the first token this step sampled."""

    request_id: str
    block_ids: list[int]
    ticket: Ticket | None = None
    last: bool = True

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"request_id": self.request_id, "block_ids": self.block_ids, "last": self.last}
        if self.ticket is not None:
            wire["ticket"] = self.ticket
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> PushWindow:
        return cls(wire["request_id"], wire["block_ids"], wire.get("ticket"), wire["last"])


@dataclass(frozen=True, slots=True)
class ConnectorStep:
    """The driver's orders to every shard's connector for one step (or a step without a forward pass)."""

    pushes: list[PushWindow] = field(default_factory=list)  # prefill: push these windows
    expects: list[Ticket] = field(default_factory=list)  # decode: accept chunks under these tickets
    forget: list[str] = field(default_factory=list)  # transfers ended on every shard: drop their bookkeeping
    cancel: list[str] = field(default_factory=list)  # prefill: end these pushes unfinished

    def to_wire(self) -> dict[str, Any]:
        return {
            "pushes": [w.to_wire() for w in self.pushes],
            "expects": self.expects,
            "forget": self.forget,
            "cancel": self.cancel,
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> ConnectorStep:
        return cls([PushWindow.from_wire(w) for w in wire["pushes"]], wire["expects"], wire["forget"], wire["cancel"])


@dataclass(frozen=True, slots=True)
class PushReport:
    """A prefill shard's push of one transfer; the figures once it is terminal."""

    state: TransferState
    reason: str | None = None
    seconds: float | None = None  # first chunk sent to last acknowledgement
    num_bytes: int = 0
    num_windows: int = 1


@dataclass(frozen=True, slots=True)
class ReceiveReport:
    """A decode shard's side of one transfer; the first token prefill sampled once it is DONE."""

    state: TransferState
    reason: str | None = None
    first_token_id: int | None = None


@dataclass(frozen=True, slots=True)
class ShardReport:
    """One shard's connector report for a step: every transfer it has open, by request id."""

    pushes: dict[str, PushReport] = field(default_factory=dict)
    receives: dict[str, ReceiveReport] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        # Rows, not maps: a report crosses the TP group every step with every open transfer in it.
        return {
            "pushes": {
                rid: [int(p.state), p.reason, p.seconds, p.num_bytes, p.num_windows] for rid, p in self.pushes.items()
            },
            "receives": {rid: [int(r.state), r.reason, r.first_token_id] for rid, r in self.receives.items()},
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> ShardReport:
        return cls(
            {
                rid: PushReport(TransferState(s), reason, sec, n, w)
                for rid, (s, reason, sec, n, w) in wire["pushes"].items()
            },
            {
                rid: ReceiveReport(TransferState(s), reason, first)
                for rid, (s, reason, first) in wire["receives"].items()
            },
        )
