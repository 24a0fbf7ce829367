"""A request as the engine tracks it: tokens, how many of them have KV, and its status.

There is no prefill/decode flag: a request is "in prefill" while num_computed_tokens is below
its prompt length, and every step computes the next ``num_tokens - num_computed_tokens`` (or a
budgeted chunk of them). That one data model serves all three engine roles.

    colocated: WAITING ─▶ RUNNING ─▶ FINISHED_*            (RUNNING ─▶ PREEMPTED ─▶ WAITING on block shortage)
    prefill:   WAITING ─▶ RUNNING ─▶ FINISHED_PREFILLED    (first token sampled; blocks held until released)
    decode:    WAITING_FOR_KV ─▶ WAITING ─▶ RUNNING ─▶ FINISHED_*   (prompt KV arrives into reserved blocks)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from common.sampling_params import SamplingParams

# The value of a token the device sampled and the host has not read yet (async scheduling): the
# last token of a request holds it from the step that computes it ahead until that step is read.
PLACEHOLDER_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    FINISHED_PREFILLED = "prefilled"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
    RequestStatus.FINISHED_PREFILLED,
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    has_placeholder: bool = False  # the last token is PLACEHOLDER_TOKEN

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_placeholder(self) -> None:
        """A token sampled on the device, counted now and filled in when it is read."""
        self.append_output_token(PLACEHOLDER_TOKEN)
        self.has_placeholder = True

    def fill_placeholder(self, token_id: int) -> None:
        self.output_token_ids[-1] = token_id
        self.all_token_ids[-1] = token_id
        self.has_placeholder = False

    def drop_placeholder(self) -> None:
        """The step that sampled it failed or its request ended: the token never was."""
        if self.has_placeholder:
            self.output_token_ids.pop()
            self.all_token_ids.pop()
            self.has_placeholder = False

    def drop_last_output_token(self) -> None:
        """The last token is taken back before it was emitted or computed (a constraint refused it)."""
        self.output_token_ids.pop()
        self.all_token_ids.pop()

    @property
    def num_known_tokens(self) -> int:
        return self.num_tokens - self.has_placeholder

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Token-level stop conditions (stop strings are the output processor's job)."""
        if not self.output_token_ids:
            return None
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens < params.min_tokens:  # nothing but the context ends it before then
            return RequestStatus.FINISHED_LENGTH if self.num_tokens >= max_model_len else None
        if not params.ignore_eos and last in self.eos_token_ids:
            self.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
