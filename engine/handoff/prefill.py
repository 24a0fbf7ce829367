"""The prefill role's side of the KV hand-off: tickets, push windows, leases, cut-off pushes.

A request added with a ticket is pushed layer by layer while its prompt computes: each prompt
chunk's step pushes the blocks that chunk completed (a window of the ticket's blocks), and the
step that computes the end of the prompt pushes the rest and the "done" with the first token. Its
blocks stay held (FINISHED_PREFILLED) until every shard reports its part terminal, then they are
released and the hand-off's figures kept (``ended``) until its caller takes them.

A request that ends before its prompt did has its push cancelled on every shard, and its blocks
held until every shard reports that terminal too. It ends so when:
- it is aborted (``on_abort``);
- it is preempted (``after_schedule``: the router retries it under a fresh ticket);
- its ticket's lease runs out (``before_schedule``: the decode replica freed its reservation);
- one shard's push fails (``after_step``: a receiver refused it, or the lease ran out there);
- its step runs out of memory (``after_failed_step``).
"""

from __future__ import annotations

import logging
import math
import time

from common.kv_messages import ConnectorStep, PushReport, PushWindow, ShardReport, Ticket, TransferState
from engine.handoff.hooks import (
    AbortPlan,
    BlockFate,
    Ending,
    HandoffActions,
    HandoffCounts,
    SentKV,
    check_ticket_names,
)
from engine.request import RequestStatus
from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

MAX_ENDED_KEPT = 4096  # ended hand-offs a caller has not taken (AsyncEngine takes each at once)
PREEMPTED = "preempted while its KV was being pushed; retry"
LEASE_EXPIRED = "the KV lease expired before the prompt was computed"


class PrefillHandoff:
    def __init__(self, num_shards: int, block_size: int | None = None) -> None:
        """``block_size``: push each prompt chunk's completed blocks (None: the whole prompt in the
        step that computes its end)."""
        self.num_shards = num_shards
        self.block_size = block_size
        self.tickets: dict[str, Ticket] = {}  # request id -> ticket, until its push starts
        # request id -> the lease deadline of its waiting ticket, on this process's monotonic clock
        # (a ticket's lease is a duration: kv_transfer.ticket)
        self._ticket_deadlines: dict[str, float] = {}
        self.sending: set[str] = set()  # pushes started, not yet terminal on every shard
        self.pushing: dict[str, int] = {}  # of those, mid-prompt: request id -> ticket blocks pushed so far
        self.push_leases: dict[str, float] = {}  # of those, the ticket's lease deadline (monotonic)
        self.cancelled: set[str] = set()  # of ``sending``, the pushes this side cut off
        self._forget: list[str] = []
        self._cancel: list[str] = []
        self.ended: dict[str, SentKV] = {}
        self.counts = HandoffCounts()

    @property
    def busy(self) -> bool:
        return bool(self.sending or self._forget or self._cancel)

    def holds_id(self, request_id: str) -> bool:
        return request_id in self.sending

    # --- intake ------------------------------------------------------------------------------
    def check_ticket(self, request_id: str, ticket: Ticket) -> None:
        check_ticket_names(request_id, ticket)

    def accept_ticket(self, request_id: str, ticket: Ticket) -> None:
        self.tickets[request_id] = ticket
        self._ticket_deadlines[request_id] = time.monotonic() + float(ticket.get("lease_s", math.inf))

    def expect(self, request_id: str, ticket: Ticket) -> ConnectorStep:
        raise AssertionError("expect_kv needs a decode-role engine with a kv_connector")

    # --- the step ----------------------------------------------------------------------------
    def before_schedule(self, now: float) -> HandoffActions:
        """Prompts whose ticket's lease ran out would be computed for nobody: they end now, before
        another chunk of theirs is computed (a push begun with their first chunks is cancelled)."""
        actions = HandoffActions()
        if not (self.tickets or self.push_leases):
            return actions
        waiting = [rid for rid in self.tickets if now >= self._ticket_deadlines.get(rid, math.inf)]
        for request_id in waiting + [rid for rid, deadline in self.push_leases.items() if now >= deadline]:
            self.counts.num_prefills_expired += 1
            logger.warning("%s: its KV lease ran out before its prompt was computed; dropped", request_id)
            actions.abort.append((request_id, LEASE_EXPIRED))
        return actions

    def after_schedule(self, scheduled: SchedulerOutput) -> tuple[HandoffActions, ConnectorStep | None]:
        """A request preempted mid-prompt with its push started ends with an error (the router
        retries it under a fresh ticket). Its blocks are already free: the push, cancelled in this
        step's orders, may still read them while they are reused, which only corrupts KV that no
        receiver will ever count as done."""
        actions = HandoffActions()
        for request_id in scheduled.preempted_request_ids:
            if request_id not in self.pushing:
                continue
            self._cancel_push(request_id)
            self.counts.num_kv_pushes_cancelled += 1
            logger.warning("%s: preempted mid-prompt with its KV push started; it ends (retryable)", request_id)
            actions.end.append(Ending(request_id, RequestStatus.FINISHED_ERROR, PREEMPTED, hold_blocks=False))
        return actions, self._orders(scheduled)

    def after_step(self, reports: list[ShardReport]) -> HandoffActions:
        """Fold every shard's report; a push ends when all shards report it terminal."""
        actions = HandoffActions()
        for request_id in list(self.sending):
            pushes = [r.pushes[request_id] for r in reports if request_id in r.pushes]
            failed = next((p for p in pushes if p.state is TransferState.FAILED), None)
            if failed is not None and request_id in self.pushing:
                # Failed mid-prompt: the request ends now, the other shards' pushes are cancelled
                # rather than left to run to the prompt's end, and its blocks are held until every
                # shard has let go of them.
                reason = failed.reason or "failed"
                self._cancel_push(request_id)
                self.counts.num_kv_transfer_failures += 1
                logger.warning("KV push of %s failed mid-prompt: %s", request_id, reason)
                error = f"KV transfer failed: {reason}"
                actions.end.append(Ending(request_id, RequestStatus.FINISHED_ERROR, error, hold_blocks=True))
            if len(pushes) < self.num_shards or not all(p.state.is_terminal for p in pushes):
                continue
            sent = _sent(request_id, pushes, cancelled=request_id in self.cancelled)
            self.sending.discard(request_id)
            self.cancelled.discard(request_id)
            self._forget.append(request_id)
            actions.release.append(request_id)  # every shard is done reading the source blocks
            if sent.cancelled:  # cut off mid-prompt and counted then; the request has ended
                continue
            if sent.failure is not None:
                self.counts.num_kv_transfer_failures += 1
                logger.warning("KV hand-off of %s failed: %s", request_id, sent.failure)
            self.ended[request_id] = sent
            if len(self.ended) > MAX_ENDED_KEPT:  # nobody took the oldest (a bare engine)
                del self.ended[next(iter(self.ended))]
        return actions

    def on_abort(self, request_id: str) -> AbortPlan:
        if self.tickets.pop(request_id, None) is not None:  # aborted before its push started
            self._ticket_deadlines.pop(request_id, None)
            return AbortPlan()
        if request_id in self.pushing:
            # Part of its prompt's KV is on the wire: cancelled now, its blocks held until every
            # shard reports the push ended (the sending threads may still read them).
            self._cancel_push(request_id)
            self.counts.num_kv_pushes_cancelled += 1
            return AbortPlan(BlockFate.HOLD, self._orders(None))
        if request_id in self.sending:
            return AbortPlan(BlockFate.ON_THE_WIRE)
        return AbortPlan()

    def after_failed_step(self, request_ids: list[str], error: str) -> tuple[ConnectorStep | None, HandoffActions]:
        """Pushes the step had under way (mid-prompt, or with the last window ordered and its layers
        never all computed) are cut off before the step ends, so no "done" follows layers it may
        have pushed; their requests end with their blocks held, the others are aborted."""
        actions = HandoffActions()
        for request_id in request_ids:
            if self._abandon(request_id):
                self.counts.num_kv_pushes_cancelled += 1
                actions.end.append(Ending(request_id, RequestStatus.FINISHED_ERROR, error, hold_blocks=True))
            else:
                actions.abort.append((request_id, error))
        return (self._orders(None) if actions.end else None), actions

    def poll(self) -> ConnectorStep | None:
        """A round between steps tells of acknowledgements now, not after the next forward pass,
        which on a busy prefill replica can take seconds."""
        return self._orders(None) if self.sending else None

    # --- the books ---------------------------------------------------------------------------
    def _cancel_push(self, request_id: str) -> None:
        """End a mid-prompt push: the next orders cancel it on every shard."""
        self.push_leases.pop(request_id, None)
        if self.pushing.pop(request_id, None) is not None:
            self.cancelled.add(request_id)
            self._cancel.append(request_id)

    def _abandon(self, request_id: str) -> bool:
        if request_id in self.pushing:
            self._cancel_push(request_id)
            return True
        if request_id not in self.sending or request_id in self.cancelled:
            return False
        self.cancelled.add(request_id)
        self._cancel.append(request_id)
        return True

    def _orders(self, scheduled: SchedulerOutput | None) -> ConnectorStep:
        """The connectors' orders for the next step: the windows its prompt chunks complete."""
        pushes = []
        for chunk in scheduled.chunks if scheduled is not None else ():
            request_id = chunk.request_id
            started = request_id in self.pushing
            if not started and request_id not in self.tickets:
                continue
            if chunk.samples:  # the prompt's end: the rest of its blocks, then the "done"
                first = self.pushing.pop(request_id, 0)
                self.push_leases.pop(request_id, None)
                block_ids, last = chunk.block_ids[first:], True
            elif self.block_size is not None and chunk.in_prompt:
                first = self.pushing.get(request_id, 0)
                end = (chunk.start_position + len(chunk.token_ids)) // self.block_size  # blocks now full
                if end <= first:
                    continue
                self.pushing[request_id] = end
                block_ids, last = chunk.block_ids[first:end], False
            else:
                continue
            ticket = None
            if not started:
                deadline = self._ticket_deadlines.pop(request_id, math.inf)
                # What is left of the lease after the prompt waited here, for the shards' senders.
                ticket = {**self.tickets.pop(request_id), "lease_s": max(0.0, deadline - time.monotonic())}
                self.sending.add(request_id)
                if request_id in self.pushing:
                    self.push_leases[request_id] = deadline
            pushes.append(PushWindow(request_id, block_ids, ticket, last))
        step = ConnectorStep(pushes=pushes, forget=self._forget, cancel=self._cancel)
        self._forget, self._cancel = [], []
        return step


def _sent(request_id: str, pushes: list[PushReport], cancelled: bool) -> SentKV:
    failure = next((p.reason or "failed" for p in pushes if p.state is TransferState.FAILED), None)
    times = [p.seconds for p in pushes if p.seconds is not None]
    num_bytes = sum(p.num_bytes for p in pushes)
    windows = max((p.num_windows for p in pushes), default=1)
    return SentKV(request_id, failure, max(times) if times else None, num_bytes, windows, cancelled)
