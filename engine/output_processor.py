"""Turns sampled tokens into RequestOutputs: incremental text, stop strings, logprobs, timings.

Lives on the driver only. Stop strings are found here (they need text); the scheduler is told
to finish the request, which frees its blocks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from engine.detokenizer import IncrementalDetokenizer, find_stop_string
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class RequestState:
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    metrics: RequestMetrics
    text: str = ""
    num_emitted_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    # prompt_logprobs: [i] scores prompt token i + 1; handed out once, with the first token.
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add(self, request: Request, prompt: str | None, generator: torch.Generator | None) -> RequestState:
        params = request.sampling_params
        state = RequestState(
            request=request,
            prompt=prompt,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens),
            generator=generator,
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
        )
        self.states[request.request_id] = state
        return state

    def record_logprob(self, request_id: str, logprob: TokenLogprob | None) -> None:
        state = self.states.get(request_id)
        if state is not None and state.logprobs is not None and logprob is not None:
            state.logprobs.append(logprob)

    def drop_last_logprob(self, request_id: str) -> None:
        """Its last token was taken back (Request.drop_last_output_token): so is its logprob."""
        state = self.states.get(request_id)
        if state is not None and state.logprobs and len(state.logprobs) > state.request.num_output_tokens:
            state.logprobs.pop()

    def record_prompt_logprobs(self, scores: dict[str, list[tuple[int, TokenLogprob]]]) -> None:
        for request_id, entries in scores.items():
            state = self.states.get(request_id)
            if state is None or state.prompt_logprobs is None:
                continue
            for position, logprob in entries:
                if position == len(state.prompt_logprobs) + 1:  # a recomputed position keeps its first score
                    state.prompt_logprobs.append(logprob)

    def mark_scheduled(self, request_ids: list[str], now: float) -> None:
        for request_id in request_ids:
            state = self.states.get(request_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now

    def append_tokens(self, request_id: str) -> tuple[list[int], str, str | None]:
        """Detokenize the tokens not yet emitted. Returns (new ids, new visible text, stop string hit).

        With stop strings, the last ``max_stop_len - 1`` characters are held back until the request
        ends: a stop string completed by a later token may begin inside them, and text once
        streamed cannot be taken back. On a hit the text is cut where the stop string says and
        the caller finishes the request.
        """
        state = self.states[request_id]
        request = state.request
        params = request.sampling_params
        new_ids = request.output_token_ids[state.num_emitted_tokens :]
        state.num_emitted_tokens = request.num_output_tokens
        if new_ids and state.metrics.first_token_time is None:
            state.metrics.first_token_time = time.monotonic()
        new_text = state.detokenizer.append(new_ids) if new_ids else ""
        if request.is_finished:
            new_text += state.detokenizer.flush()
        full = state.detokenizer.text
        hit = None
        visible = full
        if params.stop and request.status is not RequestStatus.FINISHED_PREFILLED:
            found = None
            if request.num_output_tokens >= params.min_tokens:  # before, no stop string ends it (vLLM's rule)
                found = find_stop_string(full, len(new_text), params.stop, params.include_stop_str_in_output)
            if found is not None:
                hit, keep = found
                visible = full[:keep]
            elif not request.is_finished:
                visible = full[: max(len(state.text), len(full) - (params.max_stop_len - 1))]
        delta = visible[len(state.text) :]
        state.text = visible
        return new_ids, delta, hit

    def build(self, request_id: str, new_ids: Sequence[int] = (), new_text: str = "") -> RequestOutput:
        """This step's output; a finished request's state is dropped here."""
        state = self.states[request_id]
        request = state.request
        finished = request.is_finished
        if finished:
            del self.states[request_id]
            state.metrics.finished_time = time.monotonic()
            state.metrics.num_preemptions = request.num_preemptions
        logprobs = state.logprobs
        new_logprobs = None
        if logprobs is not None:
            # Recorded before the tokens are emitted, so the last len(new_ids) belong to new_ids.
            new_logprobs = logprobs[max(0, len(logprobs) - len(new_ids)) :] if new_ids else []
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not state.prompt_logprobs_sent and (new_ids or finished):
            prompt_logprobs, state.prompt_logprobs_sent = state.prompt_logprobs, True
        completion = CompletionOutput(
            index=0,
            text=state.text,
            token_ids=list(request.output_token_ids) if finished else [],
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=(list(logprobs) if finished else []) if logprobs is not None else None,
            new_text=new_text,
            new_token_ids=list(new_ids),
            new_logprobs=new_logprobs,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=request.num_cached_tokens,
            metrics=state.metrics,
            error=request.error,
            prompt_logprobs=prompt_logprobs,
        )
