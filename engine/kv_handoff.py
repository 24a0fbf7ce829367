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

Transfer states arrive as ints of kv_transfer.state.TransferState (2 = DONE, 3 = FAILED); the
engine reads only these two values and never imports the transfer library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.scheduler import SchedulerOutput

_DONE, _FAILED = 2, 3


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
        self.tickets: dict[str, dict] = {}  # prefill: request id -> ticket, until its push starts
        self.sending: set[str] = set()
        self.pushing: dict[str, int] = {}  # prefill, mid-prompt: request id -> ticket blocks pushed so far
        self.push_leases: dict[str, float] = {}  # of those, the ticket's lease deadline (wall clock)
        self.receiving: set[str] = set()
        self.cancelled: set[str] = set()  # of ``sending``, the pushes this side cut off
        self._forget: list[str] = []
        self._cancel: list[str] = []

    def send_on_prefill(self, request_id: str, ticket: dict) -> None:
        self.tickets[request_id] = ticket

    def expect(self, request_id: str) -> None:
        """The caller registers the ticket on every shard itself (before handing it out)."""
        self.receiving.add(request_id)

    def drop(self, request_id: str) -> None:
        """The request ended before its transfer started (abort): forget its ticket."""
        self.tickets.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """The request ended mid-prompt with its push started: the next message cancels it (the
        caller holds the blocks until the transfer is reported terminal)."""
        if self.end_push(request_id):
            self.cancelled.add(request_id)
            self._cancel.append(request_id)

    def end_push(self, request_id: str) -> bool:
        """Forget a mid-prompt push (its prompt ended or it was cut off); whether there was one."""
        self.push_leases.pop(request_id, None)
        return self.pushing.pop(request_id, None) is not None

    def expired(self, now: float) -> list[str]:
        """Prompts not yet computed whose ticket's lease is over, started pushes included."""
        waiting = [rid for rid, ticket in self.tickets.items() if now >= ticket.get("lease_deadline", math.inf)]
        return waiting + [rid for rid, deadline in self.push_leases.items() if now >= deadline]

    @property
    def busy(self) -> bool:
        return bool(self.sending or self.receiving or self._forget or self._cancel)

    def meta_for(self, scheduled: SchedulerOutput | None) -> dict:
        """The connector message for the next step (expects are registered at once by expect_kv)."""
        sends = []
        for chunk in scheduled.chunks if scheduled is not None else ():
            request_id = chunk.request_id
            started = request_id in self.pushing
            if not started and request_id not in self.tickets:
                continue
            if chunk.samples:  # the prompt's end: the rest of its blocks, then the "done"
                first = self.pushing.get(request_id, 0)
                self.end_push(request_id)
                item = {"block_ids": chunk.block_ids[first:], "last": True}
            elif self.block_size is not None and chunk.in_prompt:
                first = self.pushing.get(request_id, 0)
                end = (chunk.start_position + len(chunk.token_ids)) // self.block_size  # blocks now full
                if end <= first:
                    continue
                self.pushing[request_id] = end
                item = {"block_ids": chunk.block_ids[first:end], "last": False}
            else:
                continue
            if started:
                item["request_id"] = request_id
            else:
                item["ticket"] = ticket = self.tickets.pop(request_id)
                self.sending.add(request_id)
                if request_id in self.pushing:
                    self.push_leases[request_id] = ticket.get("lease_deadline", math.inf)
            sends.append(item)
        meta = {"sends": sends, "expects": [], "forget": self._forget, "cancel": self._cancel}
        self._forget, self._cancel = [], []
        return meta

    def merge(self, reports: list[dict]) -> HandoffResult:
        """Fold every shard's report; a transfer ends when all shards report it terminal."""
        result = HandoffResult()
        for request_id in list(self.sending):
            states = [r["sends"][request_id] for r in reports if request_id in r.get("sends", {})]
            failed = next((s for s in states if s[0] == _FAILED), None)
            if failed is not None and request_id in self.pushing:
                # A shard's push failed mid-prompt (a receiver refused it, its lease ran out): the
                # request ends now, and the other shards' pushes are cancelled rather than left to
                # run to the prompt's end.
                self.cancel(request_id)
                result.failed_pushes.append((request_id, failed[1] or "failed"))
            if len(states) < self.num_shards or any(s[0] < _DONE for s in states):
                continue
            failure = next((s[1] or "failed" for s in states if s[0] == _FAILED), None)
            times = [s[2] for s in states if len(s) > 2 and s[2] is not None]
            num_bytes = sum(s[3] for s in states if len(s) > 3)
            windows = max((s[4] for s in states if len(s) > 4), default=1)
            seconds = max(times) if times else None
            cancelled = request_id in self.cancelled
            result.sent.append(SentKV(request_id, failure, seconds, num_bytes, windows, cancelled))
            self.sending.discard(request_id)
            self.cancelled.discard(request_id)
            self._forget.append(request_id)
        for request_id in list(self.receiving):
            states = [r["receives"][request_id] for r in reports if request_id in r.get("receives", {})]
            if len(states) < self.num_shards:
                continue
            failed = next((s for s in states if s[0] == _FAILED), None)
            if failed is not None:
                result.failed_receives.append((request_id, f"KV transfer failed: {failed[1]}"))
            elif all(s[0] == _DONE for s in states):
                first_token = next(s[2] for s in states if s[2] is not None)
                result.received.append((request_id, first_token))
            else:
                continue
            self.receiving.discard(request_id)
            self._forget.append(request_id)
        return result
