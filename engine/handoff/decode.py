"""The decode role's side of the KV hand-off: expected tickets, KV landed, failed receives.

The decode replica reserves blocks for a prompt (``LLMEngine.reserve``), then registers the
ticket on every shard (``expect``) before the router hands it to prefill. When every shard
reports the transfer DONE, the request joins the decode batch with the first token prefill
sampled, and that token goes out at once: the client's time to first token ends when the KV lands.
When any shard reports it FAILED (a chunk refused, the lease run out, no first token), the request
ends ``kv_load_failed: …`` and its blocks are freed, once every shard has stopped accepting its
chunks; the router retries it with the prompt computed on decode, or fails it.
"""

from __future__ import annotations

from common.kv_messages import ConnectorStep, ShardReport, Ticket, TransferState
from common.serving import KV_LOAD_FAILED
from engine.handoff.hooks import AbortPlan, HandoffActions, NullHandoff, check_ticket_names
from engine.scheduler import SchedulerOutput

NO_FIRST_TOKEN = "KV transfer failed: the prefill side sent no first token"


class DecodeHandoff(NullHandoff):
    """Refuses tickets to push, holds no ids, drops nothing before a step and aborts a failed
    step's requests as the null hand-off does (it has no part in those)."""

    def __init__(self, num_shards: int) -> None:
        super().__init__()
        self.num_shards = num_shards
        self.receiving: set[str] = set()
        self._forget: list[str] = []

    @property
    def busy(self) -> bool:
        return bool(self.receiving or self._forget)

    def expect(self, request_id: str, ticket: Ticket) -> ConnectorStep:
        """Registered on every shard at once, before the caller hands the ticket to prefill."""
        check_ticket_names(request_id, ticket)
        self.receiving.add(request_id)
        return ConnectorStep(expects=[ticket])

    def after_schedule(self, scheduled: SchedulerOutput) -> tuple[HandoffActions, ConnectorStep | None]:
        return HandoffActions(), self._orders()

    def after_step(self, reports: list[ShardReport]) -> HandoffActions:
        """Fold every shard's report; a receive ends when all shards report it, and fails when any failed."""
        actions = HandoffActions()
        for request_id in list(self.receiving):
            receives = [r.receives[request_id] for r in reports if request_id in r.receives]
            if len(receives) < self.num_shards:
                continue
            failed = next((r for r in receives if r.state is TransferState.FAILED), None)
            if failed is not None:
                self._fail(actions, request_id, f"KV transfer failed: {failed.reason}")
            elif all(r.state is TransferState.DONE for r in receives):
                first_token = next((r.first_token_id for r in receives if r.first_token_id is not None), None)
                if first_token is None:  # every layer came, but prefill sampled no first token
                    self._fail(actions, request_id, NO_FIRST_TOKEN)
                else:
                    actions.landed.append((request_id, first_token))
            else:
                continue
            self.receiving.discard(request_id)
            self._forget.append(request_id)
        return actions

    def _fail(self, actions: HandoffActions, request_id: str, reason: str) -> None:
        # One shard failed; others may still accept chunks: all of them stop before its blocks
        # can be reused (forget_now), then the request ends.
        self.counts.num_kv_transfer_failures += 1
        self.counts.num_kv_lease_expirations += "lease expired" in reason  # kv_transfer.receiver's wording
        actions.forget_now.append(request_id)
        actions.abort.append((request_id, f"{KV_LOAD_FAILED}: {reason}"))

    def on_abort(self, request_id: str) -> AbortPlan:
        if request_id not in self.receiving:
            return AbortPlan()
        self.receiving.discard(request_id)
        # Every shard stops accepting this request's chunks before its blocks can be reused.
        return AbortPlan(orders=ConnectorStep(forget=[request_id]))

    def _orders(self) -> ConnectorStep:
        step = ConnectorStep(forget=self._forget)
        self._forget = []
        return step
