"""OpenAI-compatible answers: response bodies, stream chunks, usage, logprobs and SSE framing.

Plain functions over dicts, no HTTP framework: ``router/responses.py`` calls them and writes what
they return.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from common.outputs import TokenLogprob
from common.serving import TTFTBreakdown
from router.protocol import ApiError, RequestKind
from router.tool_parsers.base import ToolCall, ToolCallDelta

# JSON has no -Infinity; OpenAI reports a token the model rules out with this value.
MIN_LOGPROB = -9999.0


def openai_finish_reason(engine_reason: str | None) -> str | None:
    """ "stop" and "length" pass through; "abort"/"error" are no OpenAI value: the caller sends an error."""
    return engine_reason if engine_reason in ("stop", "length") else None


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, ttft_breakdown: TTFTBreakdown | None = None
) -> dict[str, Any]:
    """OpenAI's usage object; pdserve adds ``ttft_breakdown`` (OpenAI clients ignore unknown fields)."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if ttft_breakdown is not None:
        body["ttft_breakdown"] = _ttft_breakdown(ttft_breakdown)
    return body


def _ttft_breakdown(breakdown: TTFTBreakdown) -> dict[str, float | None]:
    """Seconds to the microsecond; null for a part not known (no KV moved: kv_transfer_exposed_s)."""

    return {part: None if value is None else round(value, 6) for part, value in dataclasses.asdict(breakdown).items()}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def completion_logprobs(
    logprobs: Sequence[TokenLogprob], token_text: Callable[[int], str], text_offset: int = 0
) -> dict[str, Any]:
    """Legacy completions shape; ``text_offset`` is where the first token starts in the returned text."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for lp in logprobs:
        text = token_text(lp.token_id)
        tokens.append(text)
        token_logprobs.append(_finite(lp.logprob))
        offsets.append(text_offset)
        text_offset += len(text)
        # Two ids can decode to the same string (byte fallback): keep the likelier. Like vLLM,
        # the chosen token is always present, so logprobs=0 still yields one entry.
        top: dict[str, float] = {}
        for token_id, value in lp.top:
            top.setdefault(token_text(token_id), _finite(value))
        top.setdefault(text, _finite(lp.logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(logprobs: Sequence[TokenLogprob], token_text: Callable[[int], str]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    content = []
    for lp in logprobs:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(token_id, value) for token_id, value in lp.top]
        content.append(item)
    return {"content": content}


def _envelope(request_id: str, obj: str, model: str, created: int, choices: list[Any]) -> dict[str, Any]:
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}


def completion_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    prompt_logprobs: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_logprobs is not None:  # vLLM's field, on the choice
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def chat_choice(
    index: int,
    content: str | None,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    tool_calls: Sequence[ToolCall] = (),
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in tool_calls
        ]
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def tool_call_deltas(deltas: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """OpenAI's ``delta.tool_calls``: a call's id, type and name on its first delta only."""
    out = []
    for delta in deltas:
        entry: dict[str, Any] = {"index": delta.index}
        function: dict[str, Any] = {"arguments": delta.arguments}
        if delta.id is not None:
            entry["id"], entry["type"] = delta.id, "function"
        if delta.name is not None:
            function["name"] = delta.name
        entry["function"] = function
        out.append(entry)
    return out


def completions_body(request_id: str, model: str, created: int, choices: list[Any], usage: dict[str, Any]):
    return {**_envelope(request_id, "text_completion", model, created, choices), "usage": usage}


def chat_body(
    request_id: str,
    model: str,
    created: int,
    choices: list[Any],
    usage: dict[str, Any],
    prompt_logprobs: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    body = {**_envelope(request_id, "chat.completion", model, created, choices), "usage": usage}
    if prompt_logprobs is not None:  # vLLM's field, on the response
        body["prompt_logprobs"] = prompt_logprobs
    return body


def completion_response(
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    usage: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = completion_choice(0, text, finish_reason, logprobs)
    return completions_body(request_id, model, created, [choice], usage)


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    *,
    index: int = 0,
    prompt_logprobs: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    choice = completion_choice(index, text, finish_reason, logprobs, prompt_logprobs)
    return _envelope(request_id, "text_completion", model, created, [choice])


def usage_chunk(
    request_id: str, model: str, created: int, usage: dict[str, Any], kind: RequestKind = "completion"
) -> dict[str, Any]:
    """The last chunk before [DONE] when stream_options.include_usage is set: no choices, only usage."""
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    return {**_envelope(request_id, obj, model, created, []), "usage": usage}


def chat_response(
    request_id: str,
    model: str,
    created: int,
    content: str,
    finish_reason: str | None,
    usage: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return chat_body(request_id, model, created, [chat_choice(0, content, finish_reason, logprobs)], usage)


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    *,
    role: str | None = None,
    content: str | None = None,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    tool_calls: Sequence[ToolCallDelta] = (),
) -> dict[str, Any]:
    """The first chunk passes role="assistant", content=""; the last carries only finish_reason."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool_calls:
        delta["tool_calls"] = tool_call_deltas(tool_calls)
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(request_id, "chat.completion.chunk", model, created, [choice])


def prompt_logprobs_entries(
    prompt_ids: Sequence[int], scores: Sequence[TokenLogprob], token_text: Callable[[int], str]
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token a map from token
    id (as a string) to its logprob, rank and text: the prompt's token and the top alternatives."""
    entries: list[dict[str, Any] | None] = [None]
    for token_id, score in zip(prompt_ids[1:], scores, strict=True):
        # The prompt's own token first, then the alternatives (vLLM's order).
        entry: dict[str, Any] = {
            str(token_id): {
                "logprob": _finite(score.logprob),
                "rank": score.rank,
                "decoded_token": token_text(token_id),
            }
        }
        for rank, (alternative, value) in enumerate(score.top, start=1):
            entry.setdefault(
                str(alternative), {"logprob": _finite(value), "rank": rank, "decoded_token": token_text(alternative)}
            )
        entries.append(entry)
    return entries


def echoed_prompt_logprobs(
    prompt_ids: Sequence[int], scores: Sequence[TokenLogprob], token_text: Callable[[int], str]
) -> dict[str, Any]:
    """The completions logprobs of an echoed prompt (vLLM's shape): its first token has no score."""
    body = completion_logprobs(scores, token_text, len(token_text(prompt_ids[0])))
    first = token_text(prompt_ids[0])
    return {
        "tokens": [first, *body["tokens"]],
        "token_logprobs": [None, *body["token_logprobs"]],
        "top_logprobs": [None, *body["top_logprobs"]],
        "text_offset": [0, *body["text_offset"]],
    }


def joined_logprobs(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completions logprobs objects, one after the other (an echoed prompt's, then the answer's)."""
    if first is None or second is None:
        return first or second
    return {key: [*first[key], *second[key]] for key in first}


SSE_DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def sse_error(error: ApiError) -> bytes:
    """An error after the stream started: headers are sent, so the status travels in the event only."""
    return sse(error.body())
