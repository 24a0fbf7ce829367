"""The driver's bookkeeping of KV hand-offs through the shards' connectors (engine.kv_connector).

Prefill role: a request added with a ticket is pushed, layer by layer, in the step that computes
the end of its prompt; its blocks stay held (FINISHED_PREFILLED) until every shard reports its
part terminal, then they are released. Decode role: a reserved request's ticket is registered
on every shard; when every shard reports DONE the request is queued to decode with the first
token prefill sampled; when any reports FAILED it ends with that error and its blocks are freed.

Transfer states arrive as ints of kv_transfer.state.TransferState (2 = DONE, 3 = FAILED); the
engine reads only these two values and never imports the transfer library.
"""

from __future__ import annotations

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


@dataclass(slots=True)
class HandoffResult:
    sent: list[SentKV] = field(default_factory=list)
    received: list[tuple[str, int]] = field(default_factory=list)  # (request id, first token id)
    failed_receives: list[tuple[str, str]] = field(default_factory=list)  # (request id, reason)


class KVHandoff:
    def __init__(self, num_shards: int) -> None:
        self.num_shards = num_shards
        self.tickets: dict[str, dict] = {}  # prefill: request id -> ticket to push when its prompt is done
        self.sending: set[str] = set()
        self.receiving: set[str] = set()
        self._forget: list[str] = []

    def send_on_prefill(self, request_id: str, ticket: dict) -> None:
        self.tickets[request_id] = ticket

    def expect(self, request_id: str) -> None:
        """The caller registers the ticket on every shard itself (before handing it out)."""
        self.receiving.add(request_id)

    def drop(self, request_id: str) -> None:
        """The request ended before its transfer started (abort): forget its ticket."""
        self.tickets.pop(request_id, None)

    @property
    def busy(self) -> bool:
        return bool(self.sending or self.receiving or self._forget)

    def meta_for(self, scheduled: SchedulerOutput | None) -> dict:
        """The connector message for the next step (expects are registered at once by expect_kv)."""
        sends = []
        for chunk in scheduled.chunks if scheduled is not None else ():
            if chunk.samples and chunk.request_id in self.tickets:
                sends.append({"ticket": self.tickets.pop(chunk.request_id), "block_ids": chunk.block_ids})
                self.sending.add(chunk.request_id)
        meta = {"sends": sends, "expects": [], "forget": self._forget}
        self._forget = []
        return meta

    def merge(self, reports: list[dict]) -> HandoffResult:
        """Fold every shard's report; a transfer ends when all shards report it terminal."""
        result = HandoffResult()
        for request_id in list(self.sending):
            states = [r["sends"][request_id] for r in reports if request_id in r.get("sends", {})]
            if len(states) < self.num_shards or any(s[0] < _DONE for s in states):
                continue
            failure = next((s[1] or "failed" for s in states if s[0] == _FAILED), None)
            times = [s[2] for s in states if len(s) > 2 and s[2] is not None]
            num_bytes = sum(s[3] for s in states if len(s) > 3)
            result.sent.append(SentKV(request_id, failure, max(times) if times else None, num_bytes))
            self.sending.discard(request_id)
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
