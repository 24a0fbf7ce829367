"""What an engine returns for a request, step by step. Torch-free: pools and the router share it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The chosen token's log-probability and the ``top`` most likely alternatives, descending."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 for the likeliest token; prompt_logprobs only


@dataclass(slots=True)
class RequestMetrics:
    """Request-lifetime timeline (time.monotonic seconds); maps one to one onto trace spans."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # (start, end, tokens) of each step that computed part of the prompt (for its trace spans)
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # everything so far (a str is shared, not copied)
    # Every generated token (and its logprob) on the final output only: a streaming output leaves
    # them empty and carries the step's new_* fields, so a step costs O(its new tokens), not O(all).
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "prefilled"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    new_text: str = ""  # what this step added, for streaming
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] | None = None  # the logprobs of new_token_ids (when asked for)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    kv_block_ids: list[int] | None = None  # prefill role: blocks held for the hand-off until released
    # prompt_logprobs, on the output with the first token: [i] scores prompt token i + 1 (the first
    # prompt token has no score). None when not asked for, or already handed out.
    prompt_logprobs: list[TokenLogprob] | None = None
