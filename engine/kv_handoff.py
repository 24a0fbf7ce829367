"""The driver's bookkeeping of KV hand-offs through the shards' connectors (engine.kv_connector).

Prefill role: a request added with a ticket is pushed layer by layer while its prompt computes:
each prompt chunk's step pushes the blocks that chunk completed (a window of the ticket's blocks),
the step that computes the end of the prompt pushes the rest and the "done". Its blocks stay held
(FINISHED_PREFILLED) until every shard reports its part terminal, then they are released. A
request that ends before its prompt did (aborted, preempted, its lease run out, one shard's push
failed) has its push cancelled on every shard; its blocks are held until every shard reports that
terminal too.

Decode role: a reserved request's ticket is registered on every shard; when every shard reports
DONE the request is queued to decode with the first token prefill sampled; when any reports
FAILED it ends with that error and its blocks are freed.

The messages both ways are common.kv_messages' (ConnectorStep out, one ShardReport per shard
back), with the TransferState enum kv_transfer uses too: the engine never imports the transfer
library.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from common.kv_messages import ConnectorStep, PushWindow, ShardReport, Ticket, TransferState
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


@dataclass(slots=True)
class HandoffResult:
    sent: list[SentKV] = field(default_factory=list)
    received: list[tuple[str, int]] = field(default_factory=list)  # (request id, first token id)
    failed_receives: list[tuple[str, str]] = field(default_factory=list)  # (request id, reason)
    failed_pushes: list[tuple[str, str]] = field(default_factory=list)  # mid-prompt: (request id, reason)


class KVHandoff:
    def __init__(self, num_shards: int, block_size: int | None = None) -> None:
        """``block_size``: push each prompt chunk's completed blocks (None: the whole prompt in the
        step that computes its end)."""
        self.num_shards = num_shards
        self.block_size = block_size
        self.tickets: dict[str, Ticket] = {}  # prefill: request id -> ticket, until its push starts
        self.sending: set[str] = set()
        self.pushing: dict[str, int] = {}  # prefill, mid-prompt: request id -> ticket blocks pushed so far
        self.push_leases: dict[str, float] = {}  # of those, the ticket's lease deadline (monotonic)
        # request id -> the lease deadline of its waiting ticket, on this process's monotonic clock
        # (a ticket's lease is a duration: kv_transfer.ticket)
        self._ticket_deadlines: dict[str, float] = {}
        self.receiving: set[str] = set()
        self.cancelled: set[str] = set()  # of ``sending``, the pushes this side cut off
        self._forget: list[str] = []
        self._cancel: list[str] = []

    def send_on_prefill(self, request_id: str, ticket: Ticket) -> None:
        self.tickets[request_id] = ticket
        self._ticket_deadlines[request_id] = time.monotonic() + float(ticket.get("lease_s", math.inf))

    def expect(self, request_id: str) -> None:
        """The caller registers the ticket on every shard itself (before handing it out)."""
        self.receiving.add(request_id)

    def drop(self, request_id: str) -> None:
        """The request ended before its transfer started (abort): forget its ticket."""
        self.tickets.pop(request_id, None)
        self._ticket_deadlines.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """The request ended mid-prompt with its push started: the next message cancels it (the
        caller holds the blocks until the transfer is reported terminal)."""
        if self.end_push(request_id):
            self.cancelled.add(request_id)
            self._cancel.append(request_id)

    def abandon(self, request_id: str) -> bool:
        """The request's step failed (out of memory) with its push under way, mid-prompt or with its
        last window ordered and its layers never all computed: cancelled as ``cancel`` does (the
        caller holds the blocks until the transfer is reported terminal). Whether there was one."""
        if request_id in self.pushing:
            self.cancel(request_id)
            return True
        if request_id not in self.sending or request_id in self.cancelled:
            return False
        self.cancelled.add(request_id)
        self._cancel.append(request_id)
        return True

    def end_push(self, request_id: str) -> bool:
        """Forget a mid-prompt push (its prompt ended or it was cut off); whether there was one."""
        self.push_leases.pop(request_id, None)
        return self.pushing.pop(request_id, None) is not None

    def expired(self, now: float) -> list[str]:
        """Prompts not yet computed whose ticket's lease is over, started pushes included."""
        waiting = [rid for rid in self.tickets if now >= self._ticket_deadlines.get(rid, math.inf)]
        return waiting + [rid for rid, deadline in self.push_leases.items() if now >= deadline]

    @property
    def busy(self) -> bool:
        return bool(self.sending or self.receiving or self._forget or self._cancel)

    def connector_step(self, scheduled: SchedulerOutput | None) -> ConnectorStep:
        """The connectors' orders for the next step (expects are registered at once by expect_kv)."""
        pushes = []
        for chunk in scheduled.chunks if scheduled is not None else ():
            request_id = chunk.request_id
            started = request_id in self.pushing
            if not started and request_id not in self.tickets:
                continue
            if chunk.samples:  # the prompt's end: the rest of its blocks, then the "done"
                first = self.pushing.get(request_id, 0)
                self.end_push(request_id)
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

    def merge(self, reports: list[ShardReport]) -> HandoffResult:
        """Fold every shard's report; a transfer ends when all shards report it terminal."""
        result = HandoffResult()
        for request_id in list(self.sending):
            pushes = [r.pushes[request_id] for r in reports if request_id in r.pushes]
            failed = next((p for p in pushes if p.state is TransferState.FAILED), None)
            if failed is not None and request_id in self.pushing:
                # A shard's push failed mid-prompt (a receiver refused it, its lease ran out): the
                # request ends now, and the other shards' pushes are cancelled rather than left to
                # run to the prompt's end.
                self.cancel(request_id)
                result.failed_pushes.append((request_id, failed.reason or "failed"))
            if len(pushes) < self.num_shards or not all(p.state.is_terminal for p in pushes):
                continue
            failure = next((p.reason or "failed" for p in pushes if p.state is TransferState.FAILED), None)
            times = [p.seconds for p in pushes if p.seconds is not None]
            num_bytes = sum(p.num_bytes for p in pushes)
            windows = max((p.num_windows for p in pushes), default=1)
            seconds = max(times) if times else None
            cancelled = request_id in self.cancelled
            result.sent.append(SentKV(request_id, failure, seconds, num_bytes, windows, cancelled))
            self.sending.discard(request_id)
            self.cancelled.discard(request_id)
            self._forget.append(request_id)
        for request_id in list(self.receiving):
            receives = [r.receives[request_id] for r in reports if request_id in r.receives]
            if len(receives) < self.num_shards:
                continue
            failed = next((r for r in receives if r.state is TransferState.FAILED), None)
            if failed is not None:
                result.failed_receives.append((request_id, f"KV transfer failed: {failed.reason}"))
            elif all(r.state is TransferState.DONE for r in receives):
                first_token = next((r.first_token_id for r in receives if r.first_token_id is not None), None)
                if first_token is None:  # every layer came, but prefill sampled no first token
                    reason = "KV transfer failed: the prefill side sent no first token"
                    result.failed_receives.append((request_id, reason))
                else:
                    result.received.append((request_id, first_token))
            else:
                continue
            self.receiving.discard(request_id)
            self._forget.append(request_id)
        return result
