"""Every request field a vLLM or OpenAI client sends, per endpoint: honoured, harmless, or refused.

- **Honoured**: read by ``router/protocol.py`` and acted on as vLLM acts on it.
- **Harmless**: accepted and ignored because they change nothing in the answer (a caller's
  metadata, a caching hint for OpenAI's own servers).
- **Refused**: not implemented, and they would change the answer: a request that sets one to
  anything but its no-op value gets a 400 naming it, never a 200 that dropped it.

``tests/router/test_request_fields.py`` walks the fields of vLLM's ``CompletionRequest`` and
``ChatCompletionRequest`` and of the openai client's request types and holds each to exactly one
of the three. A field no such client defines is ignored, as vLLM ignores one (with a log line).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

RequestKind = Literal["completion", "chat"]

# OpenAI field name == SamplingParams field name; null means "use the default".
SAMPLING_FIELDS = (
    *("n", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty"),
    # vLLM extensions
    *("top_k", "min_p", "stop_token_ids", "repetition_penalty", "ignore_eos", "skip_special_tokens"),
    *("include_stop_str_in_output", "min_tokens", "logit_bias", "prompt_logprobs"),
    # Not sampling, but carried with it to the engine; refused unless the pools schedule by it.
    "priority",
)
# The output's constraint (router/structured_request.py): OpenAI's field, vLLM's, vLLM's older ones.
CONSTRAINT_FIELDS = (
    *("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"),
    "guided_decoding_backend",
)
_BOTH = frozenset(
    {"model", "max_tokens", "stream", "stream_options", "cache_salt", "logprobs", *SAMPLING_FIELDS, *CONSTRAINT_FIELDS}
)
HONOURED: dict[RequestKind, frozenset[str]] = {
    "completion": _BOTH | {"prompt", "echo"},
    "chat": _BOTH
    | {"messages", "max_completion_tokens", "top_logprobs"}
    | {"add_generation_prompt", "continue_final_message", "chat_template_kwargs"}
    | {"tools", "tool_choice", "parallel_tool_calls"},  # router/tool_request.py
}
HARMLESS = frozenset(
    {
        *("user", "metadata", "store", "service_tier", "safety_identifier"),
        # OpenAI's hints for its own prompt cache; this server's prefix cache needs none.
        *("prompt_cache_key", "prompt_cache_options", "prompt_cache_retention"),
        # Only a reasoning parser acts on it, and this server has none: the text is never split.
        "include_reasoning",
    }
)


def _absent(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == [] or value == ""


def _is(*no_ops: Any) -> Callable[[Any], bool]:
    """A field whose no-op is null or one of ``no_ops`` (compared by type too: True is not 1)."""
    return lambda value: value is None or any(type(value) is type(n) and value == n for n in no_ops)


# Refused on both endpoints unless at their no-op value: name -> whether a value is a no-op.
_REFUSED_BOTH: dict[str, Callable[[Any], bool]] = {
    "best_of": _is(1),
    "use_beam_search": _is(False),
    "length_penalty": _is(1.0, 1),
    "spaces_between_special_tokens": _is(True),
    "truncate_prompt_tokens": _absent,
    "allowed_token_ids": _absent,
    "bad_words": _empty,
    "guided_whitespace_pattern": _absent,
    "structural_tag": _absent,
    "logits_processors": _empty,
    "return_tokens_as_token_ids": _is(False),
    "return_token_ids": _is(False),
    "kv_transfer_params": _empty,
    "vllm_xargs": _empty,
    "request_id": _absent,
    # One endpoint's fields sent to the other are refused too: the client meant them.
    "suffix": _empty,
    "prompt_embeds": _empty,
    # OpenAI's deprecated spelling of tools and tool_choice (vLLM refuses it too).
    "functions": _empty,
    "function_call": _is("none", "auto"),
    "documents": _empty,
    "chat_template": _absent,
    "mm_processor_kwargs": _empty,
    "reasoning_effort": _absent,
    "verbosity": _absent,
    "audio": _absent,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _absent,
    "web_search_options": _absent,
    "moderation": _absent,
}
REFUSED: dict[RequestKind, dict[str, Callable[[Any], bool]]] = {
    # add_special_tokens at vLLM's default of each endpoint: the tokenizer's own special tokens on
    # completions, the chat template's alone on chat.
    "completion": {
        **_REFUSED_BOTH,
        "tools": _empty,
        "tool_choice": _is("none", "auto"),
        "parallel_tool_calls": _absent,
        "add_special_tokens": _is(True),
        "add_generation_prompt": _is(True),
        "continue_final_message": _is(False),
        "chat_template_kwargs": _empty,
    },
    # vLLM's chat echo prepends the last message; /v1/completions echoes the prompt.
    "chat": {**_REFUSED_BOTH, "add_special_tokens": _is(False), "echo": _is(False)},
}
# Why a refused field is refused, where its name alone does not say what to do instead.
HINTS = {
    "functions": "send them as tools",
    "function_call": "send it as tool_choice",
    "tools": "tools are a chat field: use /v1/chat/completions",
    "request_id": "send the request's id as the X-Request-Id header",
    "echo": "only /v1/completions echoes the prompt",
    "chat_template": "this server applies its own chat template (the model's, or pdserve serve --chat-template)",
}

KNOWN_FIELDS = frozenset().union(*HONOURED.values(), HARMLESS, *(refused.keys() for refused in REFUSED.values()))


def refused_field(body: dict[str, Any], kind: RequestKind) -> tuple[str, str] | None:
    """The first field of ``body`` that this endpoint refuses at the value given, and the message
    that says so; None when it sets none."""
    for name, is_no_op in REFUSED[kind].items():
        if name in body and not is_no_op(body[name]):
            instead = HINTS.get(name, "remove it from the request")
            return name, f"{name} is not supported by this server; {instead}"
    return None
