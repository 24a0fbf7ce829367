"""Decides, each step, which tokens of which requests get computed. Pure Python, no torch.

Each step has a token budget. Running requests go first, in arrival order: a request still in
its prompt gets a chunk of at most ``prefill_chunk`` tokens, a decoding one gets its one new
token. A step that runs decoding requests may also cap its prompt tokens (``prompt_token_cap``,
from the engine's ``max_decode_stall_s``): their tokens then wait for a short step, not for a
whole prompt; a request held back by the cap keeps its place, and ones behind it that do not
compute prompt tokens (decode role: KV received) are admitted past it. When blocks run out, the
most recently admitted running request is preempted (its blocks freed, recomputed later from its
tokens). Then waiting requests are admitted while budget, seats (``max_num_seqs``) and blocks
last; admission first reuses prefix-cached blocks.

Roles change admission, not the data model:
  colocated  a request runs until a stop condition.
  prefill    a request ends (FINISHED_PREFILLED) after its first sampled token; its blocks stay
             held for the KV hand-off until ``release()``.
  decode     ``reserve()`` allocates blocks for a prompt whose KV will arrive from elsewhere;
             ``kv_ready()`` marks the prompt computed, appends the first token and queues it.
             A plain ``add_request`` still works (local prefill fallback).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from common.config import EngineRole, SchedulerConfig
from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledChunk:
    request_id: str
    token_ids: list[int]  # tokens whose KV this step computes
    start_position: int  # the request's num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table
    samples: bool  # the chunk reaches the request's last token, so the step samples a new one
    in_prompt: bool = False  # the chunk computes prompt tokens (a prefill chunk, not a decode step)
    # prompt_logprobs: the chunk's first this-many tokens each score the prompt token after them.
    num_prompt_logprobs: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # A step scheduled ahead (may_preempt=False) left a running request out for want of blocks:
    # the step after it must be scheduled with preemption.
    blocked: bool = False
    # ``advance`` counted the step's tokens before its sampled ids were read (async scheduling).
    advanced: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.role = config.role
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: dict[str, Request] = {}  # decode role: blocks allocated, KV not yet arrived
        self.handoff: dict[str, Request] = {}  # prefill role: finished, blocks held for the KV hand-off

    # --- intake ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self._enqueue(request)

    def reserve(self, request: Request) -> list[int] | None:
        """Decode role: hold blocks for a prompt whose KV will be pushed in; None if they do not fit."""
        assert self.role is EngineRole.DECODE, f"reserve() needs the decode role, not {self.role.value}"
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        if self.kv.allocate_slots(request, request.num_prompt_tokens) is None:
            return None
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request.request_id] = request
        self.reserved[request.request_id] = request
        return self.kv.block_ids(request.request_id)

    def kv_ready(self, request_id: str, first_token_id: int) -> Request | None:
        """Decode role: the prompt's KV has landed in the reserved blocks; queue the request to decode.

        None if the reservation is gone (aborted meanwhile): a late transfer is not an error."""
        request = self.reserved.pop(request_id, None)
        if request is None:
            return None
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_computed_blocks(request)
        request.append_output_token(first_token_id)
        stop = request.check_stop(self.max_model_len)
        if stop is not None:
            self._finish(request, stop)
        else:
            request.status = RequestStatus.WAITING
            self._enqueue(request)
        return request

    # --- the step --------------------------------------------------------------------------
    def schedule(
        self, prompt_token_cap: int | None = None, *, may_preempt: bool = True, skip: Collection[str] = ()
    ) -> SchedulerOutput:
        """The step's chunks. ``prompt_token_cap``: the most prompt tokens the step computes when it
        also runs decoding requests (None: no cap beyond the token budget).

        A step scheduled ahead of the one still on the device (async scheduling) passes
        ``may_preempt=False``: a request preempted then would lose a token not yet read, so a
        running request without room waits, and the output says ``blocked``. ``skip``: requests that
        sit this step out, running (the step on the device samples their last token) or waiting
        (their constraint's grammar is still compiling: they take no blocks until it is ready)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        prompt_budget = budget if prompt_token_cap is None or not self.num_decoding() else max(1, prompt_token_cap)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.request_id in skip:
                index += 1
                continue
            num_new = self._num_new_tokens(request, budget)
            if _in_prompt(request):
                num_new = min(num_new, prompt_budget)
                if num_new <= 0:  # held back by the cap; it keeps its blocks and its place
                    index += 1
                    continue
                prompt_budget -= num_new
            if not may_preempt and self.kv.allocate_slots(request, num_new) is None:
                out.blocked = True
                break
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pop_victim(index)
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new
            index += 1

        # Admitting while this step preempted would only thrash the blocks just freed.
        evicted: list[str] = []
        index = 0  # waiting requests before it are held back by the prompt cap
        while (
            not out.preempted_request_ids
            and not out.blocked
            and index < len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[index]
            in_prompt = _in_prompt(request)
            if (in_prompt and prompt_budget <= 0) or request.request_id in skip:
                index += 1
                continue
            hits: list[KVBlock] = []
            num_hit_tokens = 0
            # A prompt's logprobs need its every position computed: no prefix-cache hit (vLLM's rule).
            if request.request_id not in self.kv.req_blocks and request.sampling_params.prompt_logprobs is None:
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(
                request.num_tokens - request.num_computed_tokens - num_hit_tokens,
                budget,
                self._chunk_limit(request, num_hit_tokens),
            )
            if in_prompt:
                num_new = min(num_new, prompt_budget)
            if self.kv.allocate_slots(request, num_new, hits) is None:
                # Nothing running will ever free blocks; waiting requests that hold some (decode role:
                # KV received, not yet admitted) give them up and recompute later, or nobody moves.
                holder = self._waiting_block_holder(exclude=request) if not self.running else None
                if holder is None:
                    break
                self._preempt_waiting(holder)
                evicted.append(holder.request_id)
                continue
            if in_prompt:
                prompt_budget -= num_new
            del self.waiting[index]
            self.kv.pool.record_lookup(request.num_tokens, num_hit_tokens)
            if hits:
                request.num_computed_tokens += num_hit_tokens
                request.num_cached_tokens = max(request.num_cached_tokens, num_hit_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        out.preempted_request_ids.extend(evicted)
        return out

    def advance(self, out: SchedulerOutput) -> set[str]:
        """Async scheduling: count a launched step's tokens before its sampled ids are read, so the
        next step can be scheduled now. Each sampled request gets a placeholder for its new token
        (filled by ``update_from_output``). Returns the requests that this token ends by length:
        the next step skips them."""
        ending = set()
        for chunk in out.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += len(chunk.token_ids)
            self.kv.cache_computed_blocks(request)  # before the placeholder: it is never hashed
            if not chunk.samples:
                continue
            request.append_placeholder()
            max_tokens = request.sampling_params.max_tokens
            if request.num_output_tokens >= max_tokens or request.num_tokens >= self.max_model_len:
                ending.add(request.request_id)
        out.advanced = True
        return ending

    def drop_placeholders(self, out: SchedulerOutput) -> None:
        """The advanced step failed before its ids were read: its sampled tokens never were."""
        if out.advanced:
            for chunk in out.chunks:
                request = self.requests.get(chunk.request_id)
                if request is not None and chunk.samples:
                    request.drop_placeholder()

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests by the step's result; returns the requests that got a token."""
        updated = []
        for chunk in out.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                if request is not None and out.advanced and chunk.samples:
                    request.drop_placeholder()  # ended (aborted) after the advance
                continue  # aborted while the step ran
            if not out.advanced:
                request.num_computed_tokens += len(chunk.token_ids)
                self.kv.cache_computed_blocks(request)
            if not chunk.samples:
                continue
            if out.advanced:
                request.fill_placeholder(sampled_token_ids[chunk.request_id])
            else:
                request.append_output_token(sampled_token_ids[chunk.request_id])
            stop = request.check_stop(self.max_model_len)
            if self.role is EngineRole.PREFILL:
                # Always hand off, even when the first token already ends the request: its KV may be
                # on the wire, so the blocks stay held until release(); decode sees the stop itself.
                stop = RequestStatus.FINISHED_PREFILLED
            if stop is not None:
                self.running.remove(request)
                self._finish(request, stop)
            updated.append(request)
        return updated

    # --- endings ---------------------------------------------------------------------------
    def finish_request(self, request_id: str, status: RequestStatus, error: str | None = None) -> Request | None:
        """End a request from outside the step (stop string, abort, transfer failure); frees its blocks."""
        assert status.is_finished and status is not RequestStatus.FINISHED_PREFILLED
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request_id in self.handoff:
            return self.release(request_id)
        if request.is_finished:
            return request
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_KV:
            del self.reserved[request_id]
        else:
            self.waiting.remove(request)
        request.error = error
        self._finish(request, status)
        return request

    def hold_for_handoff(self, request_id: str, status: RequestStatus, error: str | None) -> Request | None:
        """Prefill role: end a request mid-prompt whose KV push has started, its blocks held (as a
        FINISHED_PREFILLED request's are) until ``release()``: the push may still read them."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return request
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.error = error
        request.status = status
        self.handoff[request_id] = request
        return request

    def release(self, request_id: str) -> Request | None:
        """Prefill role: the KV has been handed off (or abandoned); free the held blocks."""
        request = self.handoff.pop(request_id, None)
        if request is not None:
            self.kv.free(request)
            self.requests.pop(request_id, None)
        return request

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if status is RequestStatus.FINISHED_PREFILLED:
            self.handoff[request.request_id] = request
            return
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def _waiting_block_holder(self, exclude: Request) -> Request | None:
        for request in reversed(self.waiting):
            if request is not exclude and request.request_id in self.kv.req_blocks:
                return request
        return None

    def _preempt_waiting(self, request: Request) -> None:
        """Free a waiting request's blocks; it keeps its place in the queue and recomputes its tokens."""
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._enqueue(request, first=True)

    def _enqueue(self, request: Request, first: bool = False) -> None:
        """Into the waiting queue: at its end (``first``: its front, a preempted request) under fcfs;
        by (priority, arrival) under the priority policy."""
        if self.config.policy == "priority":
            key = _urgency(request)
            position = next((i for i, other in enumerate(self.waiting) if _urgency(other) > key), len(self.waiting))
            self.waiting.insert(position, request)
        elif first:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _pop_victim(self, scheduled: int) -> Request:
        """The running request to preempt for blocks, among those the step has not scheduled yet
        (from ``scheduled`` on): the latest admitted under fcfs, the least urgent under priority."""
        if self.config.policy != "priority":
            return self.running.pop()
        victim = max(self.running[scheduled:], key=_urgency)
        self.running.remove(victim)
        return victim

    # --- helpers ---------------------------------------------------------------------------
    def num_decoding(self) -> int:
        """Requests past their prompt, running or (decode role: KV received) waiting to be: the
        batch a prompt computed here in capped chunks would run beside."""
        return sum(not _in_prompt(r) for r in self.running) + sum(
            not _in_prompt(r) for r in self.waiting if r.num_computed_tokens
        )

    def _chunk_limit(self, request: Request, num_hit_tokens: int = 0) -> int:
        in_prompt = request.num_computed_tokens + num_hit_tokens < request.num_tokens - 1
        return self.config.prefill_chunk if in_prompt else 1 << 30

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        return min(remaining, budget, self._chunk_limit(request))

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        scored = 0
        if request.sampling_params.prompt_logprobs is not None:
            scored = max(0, min(start + num_new, request.num_prompt_tokens - 1) - start)
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            start_position=start,
            block_ids=self.kv.block_ids(request.request_id),
            samples=start + num_new == request.num_tokens,
            in_prompt=start < request.num_prompt_tokens,
            num_prompt_logprobs=scored,
        )

    # --- introspection ---------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.reserved)

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished > 0

    def num_prefill_tokens_queued(self) -> int:
        """Prompt tokens of waiting and still-prefilling requests not computed yet: the prefill work
        a new prompt on this engine would queue behind (prefix-cache hits of waiting ones included)."""
        queued = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        return queued + sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.running)

    def iter_live(self) -> Iterable[Request]:
        yield from self.running
        yield from self.waiting
        yield from self.reserved.values()


def _urgency(request: Request) -> tuple[int, float]:
    """Sort key under the priority policy: lower runs first; ties by arrival."""
    return request.sampling_params.priority, request.arrival_time


def _in_prompt(request: Request) -> bool:
    """Its next chunk computes prompt tokens (a fresh or preempted request's, not a decode's)."""
    return request.num_computed_tokens < request.num_prompt_tokens
