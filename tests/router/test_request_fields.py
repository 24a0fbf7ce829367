"""No request field a vLLM or OpenAI client sends is dropped silently (router/request_fields.py).

Every field of vLLM's ``CompletionRequest`` and ``ChatCompletionRequest`` and of the installed
openai client's request types is, on each endpoint, in exactly one of: honoured, harmless, refused
by name. Each refused field, set to anything but its no-op, gets a 400 naming it; at its no-op it
is accepted.
"""

from __future__ import annotations

import pytest

from router.protocol import ApiError, parse_chat_request, parse_completion_request
from router.request_fields import HARMLESS, HONOURED, REFUSED

MODEL = "smol"

# vllm-project/vllm, vllm/entrypoints/openai/protocol.py: CompletionRequest's fields in the release
# with structured_outputs (the newest read), with the names older releases had in their place.
VLLM_COMPLETION = {
    *("model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n"),
    *("presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user"),
    *("use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids"),
    *("include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens"),
    *("spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs"),
    *("prompt_embeds", "add_special_tokens", "response_format", "structured_outputs", "priority"),
    *("request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt"),
    *("kv_transfer_params", "vllm_xargs"),
    # older releases
    *("best_of", "bad_words", "guided_json", "guided_regex", "guided_choice", "guided_grammar"),
    *("guided_decoding_backend", "guided_whitespace_pattern", "structural_tag"),
}
# The same file at 0052bed36509: ChatCompletionRequest's fields, with the newer release's additions.
VLLM_CHAT = {
    *("messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens"),
    *("max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream"),
    *("stream_options", "temperature", "top_p", "tools", "tool_choice", "reasoning_effort"),
    *("include_reasoning", "parallel_tool_calls", "user", "best_of", "use_beam_search", "top_k", "min_p"),
    *("repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos"),
    *("min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens"),
    *("prompt_logprobs", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt"),
    *("continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs"),
    *("mm_processor_kwargs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"),
    *("structural_tag", "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id"),
    *("logits_processors", "return_tokens_as_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs"),
    # newer releases
    *("structured_outputs", "return_token_ids"),
}


def _openai_fields(module) -> set[str]:
    """The fields of the openai client's request type (its TypedDict and those it extends)."""
    base = module.CompletionCreateParamsBase
    fields = {name for klass in base.__mro__ for name in getattr(klass, "__annotations__", {})}
    return fields | {"stream"}  # declared on the streaming and non-streaming subtypes


def _client_fields(kind: str) -> set[str]:
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    if kind == "completion":
        return VLLM_COMPLETION | _openai_fields(completion_create_params)
    return VLLM_CHAT | _openai_fields(chat_create_params)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_every_field_a_client_sends_is_honoured_harmless_or_refused_and_only_one(kind):
    honoured, refused = HONOURED[kind], set(REFUSED[kind])
    assert not honoured & HARMLESS and not honoured & refused and not HARMLESS & refused
    unclassified = _client_fields(kind) - honoured - HARMLESS - refused
    assert not unclassified, f"{kind}: fields no table names, which would be dropped silently: {sorted(unclassified)}"


# A value that asks for something each refused field's no-op does not.
ASKING = {
    "best_of": 2,
    "response_format": {"type": "json_object"},
    "use_beam_search": True,
    "length_penalty": 0.5,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 8,
    "allowed_token_ids": [1, 2],
    "bad_words": ["sea"],
    "structured_outputs": {"json": {"type": "object"}},
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "a"',
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ",
    "structural_tag": "{}",
    "logits_processors": ["module:factory"],
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"k": 1},
    "request_id": "mine",
    "suffix": "end",
    "prompt_embeds": "AAAA",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "functions": [{"name": "f"}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "function_call": {"name": "f"},
    "add_generation_prompt": False,
    "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False},
    "mm_processor_kwargs": {"size": 1},
    "reasoning_effort": "low",
    "verbosity": "low",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "moderation": {"model": "x"},
}
ASKING_BY_KIND = {
    "completion": {**ASKING, "add_special_tokens": False},
    "chat": {**ASKING, "add_special_tokens": True, "echo": True},
}
NO_OP = {
    "completion": {"best_of": 1, "logit_bias": {}, "min_tokens": 0, "priority": 0, "add_special_tokens": True},
    "chat": {
        **{"tool_choice": "auto", "add_generation_prompt": True, "continue_final_message": False},
        **{"add_special_tokens": False, "echo": False, "modalities": ["text"], "response_format": {"type": "text"}},
    },
}


def _parse(kind: str, **fields):
    if kind == "completion":
        return parse_completion_request({"model": MODEL, "prompt": "hello", **fields}, MODEL)
    return parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}, MODEL)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_each_refused_field_asking_for_something_gets_a_400_naming_it(kind):
    asking = ASKING_BY_KIND[kind]
    assert set(REFUSED[kind]) <= set(asking), (
        f"a refused field without a value to try: {set(REFUSED[kind]) - set(asking)}"
    )
    for name in REFUSED[kind]:
        with pytest.raises(ApiError) as refused:
            _parse(kind, **{name: asking[name]})
        error = refused.value
        assert (error.status, error.param, error.code) == (400, name, "unsupported_parameter"), name
        assert error.message.startswith(f"{name} is not supported"), error.message


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_refused_fields_at_their_no_op_and_harmless_fields_are_accepted(kind):
    harmless = {"user": "u", "metadata": {"a": "b"}, "store": True, "service_tier": "auto", "prompt_cache_key": "k"}
    for no_ops in (dict.fromkeys(REFUSED[kind]), NO_OP[kind]):  # null, then the value that asks nothing
        parsed = _parse(kind, **no_ops, **harmless, some_future_field=[1])
        assert parsed.user == "u"


def test_lm_eval_s_loglikelihood_request_asks_for_the_prompt_s_logprobs():
    # lm-eval's loglikelihood tasks: the prompt echoed with its tokens' logprobs, one token generated.
    parsed = _parse("completion", echo=True, logprobs=1, max_tokens=1)
    assert (parsed.echo, parsed.sampling.logprobs, parsed.sampling.prompt_logprobs) == (True, 1, 1)
