from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import InvalidRequestError, OverloadedError
from common.outputs import TokenLogprob
from common.sampling_params import SamplingParams
from common.serving import TTFTBreakdown
from router import protocol
from router.openai_bodies import (
    SSE_DONE,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    openai_finish_reason,
    sse,
    sse_error,
    usage,
    usage_chunk,
)
from router.protocol import (
    DEFAULT_MAX_TOKENS_CHAT,
    KNOWN_FIELDS,
    ApiError,
    api_error_from_exception,
    parse_chat_request,
    parse_completion_request,
)

MODEL = "smol"
USER = {"role": "user", "content": "hi"}


def completion(**fields):
    return parse_completion_request({"model": MODEL, "prompt": "hello", **fields}, MODEL)


def chat(**fields):
    return parse_chat_request({"model": MODEL, "messages": [USER], **fields}, MODEL)


def rejected(parse, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, MODEL)
    return info.value


def completion_error(**fields) -> ApiError:
    return rejected(parse_completion_request, {"model": MODEL, "prompt": "hello", **fields})


def chat_error(**fields) -> ApiError:
    return rejected(parse_chat_request, {"model": MODEL, "messages": [USER], **fields})


# --- errors -------------------------------------------------------------------------------------


def test_api_error_body_has_exactly_openai_fields():
    err = ApiError(400, "bad", param="temperature", code="invalid_value")
    assert err.body() == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}
    }
    assert (err.status, err.headers, str(err)) == (400, {}, "bad")


def test_exception_mapping():
    invalid = api_error_from_exception(InvalidRequestError("too long", param="prompt", code="context_length_exceeded"))
    assert (invalid.status, invalid.type, invalid.param, invalid.code) == (
        400,
        "invalid_request_error",
        "prompt",
        "context_length_exceeded",
    )
    overloaded = api_error_from_exception(OverloadedError("queue full"))
    assert (overloaded.status, overloaded.type, overloaded.headers) == (
        503,
        "service_unavailable",
        {"Retry-After": "1"},
    )
    assert overloaded.message == "queue full"
    original = ApiError(404, "gone", type="not_found_error")
    assert api_error_from_exception(original) is original
    internal = api_error_from_exception(KeyError("secret/path"))
    assert (internal.status, internal.type, internal.param) == (500, "server_error", None)
    assert "KeyError" in internal.message and "secret" not in internal.message


# --- request rejections -------------------------------------------------------------------------


@pytest.mark.parametrize("body", [None, [], "x", 3])
def test_body_must_be_object(body):
    for parse in (parse_completion_request, parse_chat_request):
        err = rejected(parse, body)
        assert (err.status, err.param, err.message) == (400, None, "request body must be a JSON object")


@pytest.mark.parametrize("model", [None, "", "  ", 3])
def test_model_required(model):
    err = rejected(parse_completion_request, {"model": model, "prompt": "x"})
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", "model")
    err = rejected(parse_chat_request, {"messages": [USER]})
    assert (err.status, err.param) == (400, "model")


def test_wrong_model_is_404():
    err = rejected(parse_chat_request, {"model": "gpt-4", "messages": [USER]})
    assert (err.status, err.type, err.param, err.code) == (404, "not_found_error", "model", "model_not_found")
    assert "'gpt-4'" in err.message and "'smol'" in err.message


@pytest.mark.parametrize(
    "prompt", [None, 3, [], [1, "a"], [-1], [True], [[]], [["a"]], {"text": "x"}, [1.0], ["a", [-1]]]
)
def test_bad_prompt(prompt):
    err = completion_error(prompt=prompt)
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", "prompt")
    assert "prompt" in err.message


def test_a_batch_of_prompts_is_one_request_per_prompt():
    req = completion(prompt=["a", [5, 6], "b"], n=2)
    assert (req.num_prompts, req.prompt, req.batch) == (3, "a", ("a", [5, 6], "b"))
    assert [one.prompt for one in req.one_per_prompt()] == ["a", [5, 6], "b"]
    assert all(one.batch == () and one.num_prompts == 1 for one in req.one_per_prompt())
    single = completion(prompt=["only"])
    assert (single.prompt, single.batch, single.num_prompts) == ("only", (), 1)
    err = completion_error(prompt=["x"] * (protocol.MAX_BATCH_PROMPTS + 1))
    assert (err.status, err.param) == (400, "prompt") and str(protocol.MAX_BATCH_PROMPTS) in err.message


@pytest.mark.parametrize(
    "messages",
    [
        None,
        [],
        "hi",
        ["hi"],
        [{"content": "x"}],
        [{"role": "robot", "content": "x"}],
        [{"role": ["user"], "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text", "text": 3}]}],
        [{"role": "user", "content": ["x"]}],
    ],
)
def test_bad_messages(messages):
    err = rejected(parse_chat_request, {"model": MODEL, "messages": messages})
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", "messages")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("best_of", 2),
        ("best_of", True),
        ("guided_whitespace_pattern", " "),
        ("suffix", "end"),
        ("functions", [{"name": "f"}]),
        ("logits_processors", ["module:factory"]),
    ],
)
def test_unsupported_fields_named(field, value):
    for err in (completion_error(**{field: value}), chat_error(**{field: value})):
        assert (err.status, err.type, err.param, err.code) == (
            400,
            "invalid_request_error",
            field,
            "unsupported_parameter",
        )
        assert field in err.message and "not supported" in err.message


def test_unsupported_fields_at_noop_values_and_harmless_fields_accepted():
    noop = {"best_of": 1, "logit_bias": {}, "suffix": None, "tools": [], "functions": None}
    harmless = {"metadata": {"a": "b"}, "store": False, "service_tier": "auto", "parallel_tool_calls": True}
    req = chat(response_format={"type": "text"}, user="u1", some_future_field=[1, 2], **noop, **harmless)
    assert req.user == "u1" and req.sampling == SamplingParams(max_tokens=DEFAULT_MAX_TOKENS_CHAT)
    assert set(noop) | set(harmless) | {"response_format", "user"} <= KNOWN_FIELDS
    assert "some_future_field" not in KNOWN_FIELDS


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream": "true"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": "usage"}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"user": 5}, "user"),
        ({"echo": "yes"}, "echo"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": "2"}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"seed": "1"}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"include_stop_str_in_output": 0}, "include_stop_str_in_output"),
    ],
)
def test_completion_field_errors_name_the_param(fields, param):
    err = completion_error(**fields)
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"echo": True}, "echo"),
        ({"logprobs": 1}, "logprobs"),
        ({"logprobs": "true"}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),
        ({"stream": True, "stream_options": []}, "stream_options"),
    ],
)
def test_chat_field_errors_name_the_param(fields, param):
    err = chat_error(**fields)
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)


def test_sampling_error_keeps_its_code():
    err = completion_error(temperature=-1)
    assert err.code == "invalid_request" and "temperature" in err.message


# --- successful parsing -------------------------------------------------------------------------


def test_completion_defaults():
    req = completion()
    assert req == protocol.ParsedRequest(
        kind="completion",
        model=MODEL,
        prompt="hello",
        messages=None,
        sampling=SamplingParams(max_tokens=16),
        stream=False,
        include_usage=False,
        logprobs=None,
        echo=False,
        user=None,
    )


def test_chat_defaults():
    req = chat()
    assert (req.kind, req.prompt, req.messages) == ("chat", None, [{"role": "user", "content": "hi"}])
    assert req.sampling == SamplingParams(max_tokens=DEFAULT_MAX_TOKENS_CHAT)
    assert DEFAULT_MAX_TOKENS_CHAT >= 2**31 - 1  # until the context is full: the intake clips it
    assert (req.stream, req.include_usage, req.logprobs, req.echo, req.user) == (False, False, None, False, None)


def test_every_sampling_field_maps():
    fields = {
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 1234,
        "stop": ["\n", "END"],
        "stop_token_ids": [2, 3],
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "n": 1,
        "logprobs": 3,
    }
    expected = SamplingParams(**{**fields, "stop": ("\n", "END"), "stop_token_ids": (2, 3)})
    req = completion(**fields)
    assert req.sampling == expected and req.logprobs == 3
    chat_fields = {k: v for k, v in fields.items() if k != "logprobs"}
    req = chat(**chat_fields, logprobs=True, top_logprobs=3)
    assert req.sampling == expected and req.logprobs == 3


def test_nulls_mean_defaults():
    nulls = dict.fromkeys(["max_tokens", "temperature", "top_p", "seed", "stop", "n", "logprobs", "stream", "echo"])
    assert completion(**nulls).sampling == SamplingParams(max_tokens=16)
    req = chat(max_completion_tokens=None, max_tokens=None, top_logprobs=None, logprobs=None, stream_options=None)
    assert req.sampling == SamplingParams(max_tokens=DEFAULT_MAX_TOKENS_CHAT)
    assert req.logprobs is None and not req.include_usage


def test_stop_string_and_null():
    assert completion(stop="###").sampling.stop == ("###",)
    assert completion(stop=None).sampling.stop == ()


def test_chat_max_completion_tokens_preferred():
    assert chat(max_tokens=10).sampling.max_tokens == 10
    assert chat(max_completion_tokens=20, max_tokens=10).sampling.max_tokens == 20
    assert chat(max_completion_tokens=None, max_tokens=10).sampling.max_tokens == 10


def test_chat_logprobs():
    req = chat(logprobs=True)
    assert req.logprobs == 0 and req.sampling.logprobs == 0
    req = chat(logprobs=True, top_logprobs=5)
    assert req.logprobs == 5 and req.sampling.logprobs == 5
    req = chat(logprobs=False)
    assert req.logprobs is None and req.sampling.logprobs is None


def test_completion_logprobs_with_echo_score_the_prompt_too():
    req = completion(logprobs=0)
    assert (req.logprobs, req.sampling.logprobs, req.echo, req.sampling.prompt_logprobs) == (0, 0, False, None)
    assert completion(echo=True).sampling.prompt_logprobs is None
    # Together they ask for the prompt tokens' logprobs (lm-eval's loglikelihood), with as many alternatives.
    req = completion(logprobs=2, echo=True)
    assert (req.sampling.logprobs, req.sampling.prompt_logprobs, req.asks_prompt_logprobs) == (2, 2, False)
    req = completion(logprobs=1, echo=True, prompt_logprobs=4)
    assert (req.sampling.prompt_logprobs, req.asks_prompt_logprobs) == (4, True)
    assert chat(prompt_logprobs=0).sampling.prompt_logprobs == 0


def test_stream_options():
    assert (completion(stream=True).stream, completion(stream=True).include_usage) == (True, False)
    req = chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False})
    assert (req.stream, req.include_usage) == (True, True)
    assert completion(stream=True, stream_options={}).include_usage is False


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("text", "text"), ("", ""), ([1, 2, 3], [1, 2, 3]), (["only"], "only"), ([[4, 5]], [4, 5]), ([0], [0])],
)
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompt == expected


def test_chat_messages_roles_and_content_parts():
    messages = [
        {"role": "developer", "content": "be terse"},
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": [{"type": "text", "text": "q"}], "name": "ann"},
        {"role": "assistant", "content": "x", "refusal": None},
        {"role": "tool", "content": [], "tool_call_id": "t1"},
    ]
    req = parse_chat_request({"model": MODEL, "messages": messages}, MODEL)
    assert req.messages == [
        {"role": "developer", "content": "be terse"},
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "q", "name": "ann"},
        {"role": "assistant", "content": "x"},
        {"role": "tool", "content": "", "tool_call_id": "t1"},
    ]


def test_parsed_request_is_frozen():
    req = completion()
    with pytest.raises(AttributeError):
        req.stream = True  # type: ignore[misc]


# --- responses ----------------------------------------------------------------------------------


def test_usage_and_finish_reason():
    assert usage(10, 5, cached_tokens=4) == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert usage(1, 2)["prompt_tokens_details"] == {"cached_tokens": 0}
    assert "ttft_breakdown" not in usage(1, 2)  # a request without one (none reached a first token)
    assert [openai_finish_reason(r) for r in ("stop", "length", "abort", "error", None, "prefilled")] == [
        "stop",
        "length",
        None,
        None,
        None,
        None,
    ]


def test_usage_carries_the_ttft_breakdown_to_the_microsecond_with_nulls_for_unknown_parts():
    body = usage(10, 5, 4, TTFTBreakdown(0.01234567, 0.5, None, 0.0000004))
    assert body["ttft_breakdown"] == {
        "queue_s": 0.012346,
        "prefill_s": 0.5,
        "kv_transfer_exposed_s": None,
        "other_s": 0.0,
    }
    assert json.loads(json.dumps(body))["ttft_breakdown"]["kv_transfer_exposed_s"] is None
    assert body["total_tokens"] == 15 and body["prompt_tokens_details"] == {"cached_tokens": 4}


def test_completion_shapes():
    u = usage(3, 2)
    assert completion_response("cmpl-1", MODEL, 100, "hi there", "length", u) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 100,
        "model": MODEL,
        "choices": [{"index": 0, "text": "hi there", "logprobs": None, "finish_reason": "length"}],
        "usage": u,
    }
    chunk = completion_chunk("cmpl-1", MODEL, 100, " there", logprobs={"tokens": []})
    assert chunk == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 100,
        "model": MODEL,
        "choices": [{"index": 0, "text": " there", "logprobs": {"tokens": []}, "finish_reason": None}],
    }
    assert usage_chunk("cmpl-1", MODEL, 100, u) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 100,
        "model": MODEL,
        "choices": [],
        "usage": u,
    }


def test_chat_shapes():
    u = usage(3, 2)
    response = chat_response("chatcmpl-1", MODEL, 7, "hello", "stop", u)
    assert response["object"] == "chat.completion" and response["usage"] == u
    assert response["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "hello"}, "logprobs": None, "finish_reason": "stop"}
    ]
    first = chat_chunk("chatcmpl-1", MODEL, 7, role="assistant", content="")
    assert first == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": MODEL,
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ],
    }
    assert chat_chunk("c", MODEL, 7, content="lo")["choices"][0]["delta"] == {"content": "lo"}
    last = chat_chunk("c", MODEL, 7, finish_reason="stop")["choices"][0]
    assert (last["delta"], last["finish_reason"]) == ({}, "stop")
    tail = usage_chunk("c", MODEL, 7, u, kind="chat")
    assert (tail["object"], tail["choices"], tail["usage"]) == ("chat.completion.chunk", [], u)


VOCAB = {1: "Hel", 2: "lo", 3: " wör", 4: "ld", 5: "lo"}


def test_completion_logprobs_format():
    lps = [
        TokenLogprob(1, -0.5, top=((1, -0.5), (2, -1.5))),
        TokenLogprob(2, -0.25, top=((4, -0.1), (5, -0.2))),  # id 5 decodes like the chosen id 2: first entry wins
        TokenLogprob(3, float("-inf")),
    ]
    out = completion_logprobs(lps, VOCAB.__getitem__, text_offset=10)
    assert out == {
        "tokens": ["Hel", "lo", " wör"],
        "token_logprobs": [-0.5, -0.25, -9999.0],
        "top_logprobs": [{"Hel": -0.5, "lo": -1.5}, {"ld": -0.1, "lo": -0.2}, {" wör": -9999.0}],
        "text_offset": [10, 13, 15],
    }
    assert completion_logprobs([], VOCAB.__getitem__) == {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }


def test_chat_logprobs_format():
    out = chat_logprobs([TokenLogprob(3, -0.5, top=((3, -0.5), (4, -2.0))), TokenLogprob(4, -1.0)], VOCAB.__getitem__)
    wor = list(" wör".encode())
    assert wor == [32, 119, 195, 182, 114]
    assert out == {
        "content": [
            {
                "token": " wör",
                "logprob": -0.5,
                "bytes": wor,
                "top_logprobs": [
                    {"token": " wör", "logprob": -0.5, "bytes": wor},
                    {"token": "ld", "logprob": -2.0, "bytes": [108, 100]},
                ],
            },
            {"token": "ld", "logprob": -1.0, "bytes": [108, 100], "top_logprobs": []},
        ]
    }


def test_sse_framing():
    assert sse({"a": 1, "b": "ü"}) == 'data: {"a":1,"b":"ü"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"
    event = sse_error(ApiError(503, "busy", type="service_unavailable"))
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == {
        "error": {"message": "busy", "type": "service_unavailable", "param": None, "code": None}
    }


def test_router_modules_import_no_torch_ray_or_engine():
    # The router process must not pull in torch, Ray or the engine just to parse and place requests.
    code = (
        "import sys, router.protocol, router.openai_bodies, router.placement; "
        "print(sorted(m for m in ('torch', 'ray', 'engine') if m in sys.modules))"
    )
    repo_root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo_root, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),  # not UTF-8
        (b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),  # past Python's digit limit
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"model": "m", "prompt": "a \\ud800 b"}', "lone surrogate \\ud800"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}', "lone surrogate"),
    ],
)
def test_bodies_that_are_not_clean_json_are_a_400_not_a_500(raw, why):
    with pytest.raises(ApiError) as refused:
        protocol.decode_body(raw)
    assert refused.value.status == 400 and why in refused.value.message


def test_clean_json_with_escaped_surrogate_pairs_decodes():
    body = protocol.decode_body(b'{"model": "m", "prompt": "smile \\ud83d\\ude00", "n": 1}')
    assert body == {"model": "m", "prompt": "smile \U0001f600", "n": 1}


def test_cache_salt_is_read_on_both_endpoints_and_checked():
    assert completion(cache_salt="tenant-a").cache_salt == "tenant-a"
    assert chat(cache_salt="t").cache_salt == "t"
    assert completion().cache_salt is None and completion(cache_salt=None).cache_salt is None
    too_long = "x" * (protocol.MAX_CACHE_SALT_CHARS + 1)
    for salt in ("", 7, ["a"], too_long):
        error = completion_error(cache_salt=salt)
        assert error.status == 400 and error.param == "cache_salt"
        assert chat_error(cache_salt=salt).param == "cache_salt"


def test_logit_bias_and_min_tokens_reach_the_sampling_params_as_vllm_reads_them():
    for parse in (completion, chat):
        req = parse(logit_bias={"50256": -100, "7": 5.5}, min_tokens=3, max_tokens=8)
        assert req.sampling.logit_bias == ((7, 5.5), (50256, -100.0)) and req.sampling.min_tokens == 3


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # past int()'s digit limit: a 400, not a 500
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"1": "high"}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
    ],
)
def test_logit_bias_and_min_tokens_out_of_bounds_are_refused_by_name(fields, param):
    for error in (completion_error(**fields), chat_error(**fields)):
        assert (error.status, error.param) == (400, param), error.message


def test_the_chat_template_options_are_read_on_chat_and_refused_on_completions():
    from router.protocol import ChatTemplateOptions

    assert chat().chat_template == ChatTemplateOptions(True, False, {})
    options = chat(add_generation_prompt=False, continue_final_message=True, chat_template_kwargs={"x": 1})
    assert options.chat_template == ChatTemplateOptions(False, True, {"x": 1})
    for fields, param in (
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
        ({"continue_final_message": True}, "continue_final_message"),  # beside the default generation prompt
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ):
        assert (chat_error(**fields).status, chat_error(**fields).param) == (400, param)
    error = completion_error(add_generation_prompt=False)
    assert (error.param, error.code) == ("add_generation_prompt", "unsupported_parameter")
