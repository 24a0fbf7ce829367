"""The hooks ``LLMEngine`` calls at fixed points of a step, what they return, and the null hand-off.

A hook decides; the engine acts. Each returns data (requests to end or abort, blocks to free,
first tokens landed, orders for the shards' connectors) and never calls back into the engine, so
a role's hand-off reads none of the engine's state and the engine holds no role branches.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from common.errors import InvalidRequestError
from common.kv_messages import ConnectorStep, ShardReport, Ticket
from engine.request import RequestStatus
from engine.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class SentKV:
    """A prefill request's hand-off, ended on every shard."""

    request_id: str
    failure: str | None
    seconds: float | None  # the slowest shard's first chunk to its last acknowledgement
    num_bytes: int  # every shard's bytes together
    num_windows: int = 1  # the block windows the push left in (one per prompt chunk that completed blocks)
    cancelled: bool = False  # cut off mid-prompt by its engine (aborted, preempted, lease over): not a failure


@dataclass(frozen=True, slots=True)
class Ending:
    """A request the hand-off ends now; its output goes out with the next step's."""

    request_id: str
    status: RequestStatus
    error: str | None
    # The shards may still read its blocks (a push cut off mid-prompt): held until its transfer is
    # reported ended, then released. False: freed now.
    hold_blocks: bool


@dataclass(slots=True)
class HandoffActions:
    """What a hook asks of the engine, carried out in the order of the fields."""

    end: list[Ending] = field(default_factory=list)
    release: list[str] = field(default_factory=list)  # prefill: every shard is done reading their blocks
    landed: list[tuple[str, int]] = field(default_factory=list)  # decode: (request id, prefill's first token)
    # Orders the shards take at once in a round of their own, their reports unread (open transfers
    # report again): one shard's receive failed, and the others must stop before its blocks go.
    forget_now: list[str] = field(default_factory=list)
    abort: list[tuple[str, str]] = field(default_factory=list)  # (request id, error): the engine's whole abort


class BlockFate(enum.Enum):
    """What becomes of an aborted request's blocks, by the state of its hand-off."""

    FREE = "free"  # no transfer reads them: freed with the request
    HOLD = "hold"  # a push was cut off mid-prompt: held until every shard reports it ended
    ON_THE_WIRE = "on_the_wire"  # its prompt is done and pushed: released when the transfer ends


@dataclass(frozen=True, slots=True)
class AbortPlan:
    blocks: BlockFate = BlockFate.FREE
    orders: ConnectorStep | None = None  # for the shards in a round of their own, before the request ends


@dataclass(slots=True)
class HandoffCounts:
    """A replica's hand-off counters (its load report's fields of the same names)."""

    num_kv_transfer_failures: int = 0
    num_kv_lease_expirations: int = 0  # counted where the lease is held (decode), so a pool sum counts each once
    num_prefills_expired: int = 0  # prefill: prompts dropped uncomputed, their lease run out
    num_kv_pushes_cancelled: int = 0  # prefill: pushes cut off mid-prompt (aborted, preempted, failed step)


class Handoff(Protocol):
    """One role's side of the KV hand-off, as the engine's step sees it."""

    # Prefill: hand-offs ended on every shard, until their caller takes them (others: always empty).
    ended: dict[str, SentKV]
    counts: HandoffCounts

    @property
    def busy(self) -> bool:
        """Transfers still open on the shards: the engine keeps stepping."""
        ...

    def holds_id(self, request_id: str) -> bool:
        """A push still ending keeps its request's id: the shards key it so."""
        ...

    def check_ticket(self, request_id: str, ticket: Ticket) -> None:
        """Before add_request queues a request with a ticket: InvalidRequestError unless this engine
        pushes KV and the ticket is the request's."""
        ...

    def accept_ticket(self, request_id: str, ticket: Ticket) -> None:
        """The request (its ticket checked) is queued: push its prompt's KV where the ticket says."""
        ...

    def expect(self, request_id: str, ticket: Ticket) -> ConnectorStep:
        """A reserved request's KV will arrive under this ticket: the orders registering it on every shard."""
        ...

    def before_schedule(self, now: float) -> HandoffActions:
        """Before a step is scheduled (``now``: time.monotonic())."""
        ...

    def after_schedule(self, scheduled: SchedulerOutput) -> tuple[HandoffActions, ConnectorStep | None]:
        """A step was scheduled: what ends because of it, and the shards' orders riding on it."""
        ...

    def after_step(self, reports: list[ShardReport]) -> HandoffActions:
        """Every shard's connector report, after a step or a round of orders."""
        ...

    def on_abort(self, request_id: str) -> AbortPlan:
        """A request is aborted: what becomes of its blocks, and what the shards must hear first."""
        ...

    def after_failed_step(self, request_ids: list[str], error: str) -> tuple[ConnectorStep | None, HandoffActions]:
        """A step failed (out of memory) and its requests end: the orders to send first (a round of
        their own), then the endings."""
        ...

    def poll(self) -> ConnectorStep | None:
        """Orders for a round without a forward pass, when one would tell of ended transfers (None: none would)."""
        ...


class NullHandoff:
    """A colocated engine, or one without a connector: nothing enters or leaves. A role's hand-off
    keeps these answers at the hooks it has no part in."""

    def __init__(self) -> None:
        self.ended: dict[str, SentKV] = {}
        self.counts = HandoffCounts()

    @property
    def busy(self) -> bool:
        return False

    def holds_id(self, request_id: str) -> bool:
        return False

    def check_ticket(self, request_id: str, ticket: Ticket) -> None:
        refuse_ticket()

    def accept_ticket(self, request_id: str, ticket: Ticket) -> None:
        refuse_ticket()

    def expect(self, request_id: str, ticket: Ticket) -> ConnectorStep:
        raise AssertionError("expect_kv needs a decode-role engine with a kv_connector")

    def before_schedule(self, now: float) -> HandoffActions:
        return HandoffActions()

    def after_schedule(self, scheduled: SchedulerOutput) -> tuple[HandoffActions, ConnectorStep | None]:
        return HandoffActions(), None

    def after_step(self, reports: list[ShardReport]) -> HandoffActions:
        return HandoffActions()

    def on_abort(self, request_id: str) -> AbortPlan:
        return AbortPlan()

    def after_failed_step(self, request_ids: list[str], error: str) -> tuple[ConnectorStep | None, HandoffActions]:
        return None, HandoffActions(abort=[(request_id, error) for request_id in request_ids])

    def poll(self) -> ConnectorStep | None:
        return None


def refuse_ticket() -> None:
    raise InvalidRequestError("kv_ticket needs a prefill-role engine with a kv_connector", param="kv_ticket")


def check_ticket_names(request_id: str, ticket: object) -> None:
    """A ticket from a caller names the request it is given with."""
    if not isinstance(ticket, dict) or ticket.get("request_id") != request_id:
        raise InvalidRequestError(f"kv_ticket is not a ticket for request {request_id!r}", param="kv_ticket")
