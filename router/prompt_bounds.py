"""What a prompt must satisfy before any tokenizer or pool spends time on it: the context's length
in messages, in characters (no token is longer than the vocabulary's longest) and in token ids, and
ids inside the vocabulary. Plain functions: the router runs them on its loop for small bodies, and
the parse process (router.parse_process) runs them before it answers for large ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError
from router.protocol import ParsedRequest


@dataclass(frozen=True)
class PromptBounds:
    max_model_len: int
    max_token_chars: int  # the vocabulary's longest token, in characters
    vocab_size: int


def context_length_exceeded(max_model_len: int, what: str, param: str = "prompt") -> InvalidRequestError:
    return InvalidRequestError(
        f"This model's maximum context length is {max_model_len} tokens; the prompt has {what} (the prompt "
        "and at least one generated token must fit); shorten it.",
        param=param,
        code="context_length_exceeded",
    )


def check_prompt_chars(parsed: ParsedRequest, max_model_len: int, max_token_chars: int) -> None:
    """Before tokenizing: a prompt whose characters could not fit in the context even if every
    token were the vocabulary's longest is refused without spending the tokenizer's time on it."""
    if parsed.kind == "chat":
        assert parsed.messages is not None
        if len(parsed.messages) >= max_model_len:  # the template gives each message a token at least
            what = f"{len(parsed.messages)} messages: at least one token each"
            raise context_length_exceeded(max_model_len, what, "messages")
        # Every string a message carries (content parts, names, tool calls) reaches the template.
        chars = sum(characters(message) for message in parsed.messages)
        if parsed.tools is not None:  # the template shows them too
            chars += characters(parsed.tools.as_openai())
        where, param = "characters in its messages", "messages"
    elif isinstance(parsed.prompt, str):
        chars, where, param = len(parsed.prompt), "characters", "prompt"
    else:
        return
    if chars > max_model_len * max_token_chars:
        what = f"{chars} {where}: more tokens than that, as no token is over {max_token_chars} characters"
        raise context_length_exceeded(max_model_len, what, param)


def characters(value: Any) -> int:
    """The characters of every string in a decoded JSON value (keys included)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(key) + characters(item) for key, item in value.items())
    if isinstance(value, list):
        return sum(characters(item) for item in value)
    return 0


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    if not ids or any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"prompt token ids must be ints in [0, {vocab_size})", param="prompt")


def check_length(prompt_ids: list[int], max_model_len: int) -> None:
    if len(prompt_ids) >= max_model_len:
        raise context_length_exceeded(max_model_len, f"{len(prompt_ids)} tokens")


def check_bounds(parsed: ParsedRequest, bounds: PromptBounds) -> None:
    """Every check that needs no tokenizer, in the order the router makes them (each prompt of a batch)."""
    for one in parsed.one_per_prompt():
        check_prompt_chars(one, bounds.max_model_len, bounds.max_token_chars)
        if one.kind == "completion" and isinstance(one.prompt, list):
            check_token_ids(one.prompt, bounds.vocab_size)
            check_length(one.prompt, bounds.max_model_len)
