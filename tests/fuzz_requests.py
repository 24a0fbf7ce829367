"""Hypothesis strategies for the OpenAI endpoints' request bodies, and the check every answer must
pass: no 5xx, OpenAI's error JSON on every refusal, a stream that ends with ``[DONE]``.

Bodies mix plausible values of every field the router knows (so the fuzzer gets past the first
check and reaches the deeper ones) with arbitrary JSON in any field, unknown fields, JSON that is
not an object, and raw bytes. ``max_tokens`` stays small whatever else is drawn, so a body that is
valid costs a real cluster a few tokens only.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from hypothesis import strategies as st

from router.protocol import KNOWN_FIELDS

# Lone surrogates too: "\ud800" is valid JSON, but no tokenizer takes it (st.text never draws them).
SURROGATES = st.lists(st.characters() | st.characters(categories=["Cs"]), min_size=1, max_size=12).map("".join)
TEXT = st.one_of(st.text(max_size=12), st.text(max_size=12), st.text(max_size=12), SURROGATES)
SCALARS = st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | TEXT
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
TEXT_PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": TEXT}))
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "robot"])},
        optional={"content": TEXT | st.text(max_size=40) | TEXT_PARTS | JSON, "name": st.text(max_size=5)},
    ),
    max_size=3,
)
BOOLEANS = ("stream", "echo", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output")

# Per field: values it takes (so that most bodies reach the checks after parsing), then values of
# its shape out of range. max_tokens stays small in both: a valid body costs a real cluster a few tokens.
_VALID: dict[str, st.SearchStrategy] = {
    "prompt": st.text(max_size=40)
    | TEXT
    | st.lists(st.integers(0, 40_000), min_size=1, max_size=8)
    | st.lists(TEXT | st.lists(st.integers(0, 40_000), min_size=1, max_size=4), min_size=2, max_size=3),  # a batch
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": TEXT}),
        min_size=1,
        max_size=3,
    ),
    "max_tokens": st.integers(1, 4),
    "max_completion_tokens": st.integers(1, 4),
    "n": st.integers(1, 3),
    "prompt_logprobs": st.integers(0, 3),
    "priority": st.just(0),
    "min_tokens": st.integers(0, 1),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 60),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**63 - 1),
    "stop": TEXT | st.lists(TEXT, max_size=16),
    "stop_token_ids": st.lists(st.integers(0, 40_000), max_size=6),
    "logprobs": st.integers(0, 20),
    "top_logprobs": st.integers(0, 20),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "cache_salt": TEXT,
    **{name: st.booleans() for name in BOOLEANS},
}
_EDGE: dict[str, st.SearchStrategy] = {
    "prompt": st.lists(st.integers(-3, 60_000), max_size=8) | st.lists(TEXT | st.lists(st.integers(0, 99)), max_size=2),
    "messages": MESSAGES,
    "max_tokens": st.integers(-2, 0) | st.sampled_from([None, "4", 1.5, True, [], {}]),
    "n": st.integers(-1, 40) | st.sampled_from([1.5, "2", True]),
    "prompt_logprobs": st.integers(-1, 22) | st.booleans(),
    "priority": st.integers(-(2**40), 2**40),
    "temperature": st.floats(-1, 3) | st.just(float("nan")),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 60),
    "min_p": st.floats(-0.5, 1.5),
    "seed": st.integers(-(2**65), 2**65),
    "stop": st.lists(TEXT, max_size=20) | st.text(min_size=250, max_size=260),
    "stop_token_ids": st.lists(st.integers(-2, 60_000), max_size=300),
    "logprobs": st.integers(-1, 22) | st.booleans(),
    "top_logprobs": st.integers(-1, 22),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": JSON}),
    "presence_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
}
_EDGE["max_completion_tokens"] = _EDGE["max_tokens"]


def _objects(model: str, chat: bool) -> st.SearchStrategy[dict]:
    """The model and the prompt (or messages), up to three more fields that take their values, and
    half the time one field (any known one, or an unknown one) with a value out of range or of any
    JSON at all: most bodies get past parsing, and every field's checks are tried one at a time."""
    fields = sorted(KNOWN_FIELDS - {"model", "prompt", "messages", "max_tokens", "max_completion_tokens"})
    core = st.fixed_dictionaries(
        {
            "model": st.sampled_from([model] * 6 + ["gpt-9", ""]),
            "messages" if chat else "prompt": _VALID["messages" if chat else "prompt"],
            "max_tokens": _VALID["max_tokens"],
        }
    )
    extras = st.lists(st.sampled_from(sorted(_VALID)), max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: _VALID[name] for name in names})
    )
    # Not arbitrary JSON in max_tokens: a huge number there would ask a real cluster for a whole context.
    odd = st.sampled_from(sorted(_EDGE)).flatmap(lambda name: st.fixed_dictionaries({name: _EDGE[name]}))
    anything = st.sampled_from([*fields, "model", "prompt", "messages", "surprise"]).flatmap(
        lambda name: st.fixed_dictionaries({name: JSON})
    )
    junk = st.just({}) | st.just({}) | odd | anything
    return st.tuples(core, extras, junk).map(lambda parts: {**parts[0], **parts[1], **parts[2]})


def _structural(model: str) -> st.SearchStrategy[bytes]:
    """Bodies no JSON encoder writes: integers past Python's digit limit, nesting past its parser's."""
    digits = st.integers(1, 20_000).map(lambda n: b'{"model": "%s", "max_tokens": %s}' % (model.encode(), b"9" * n))
    nesting = st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n)
    return digits | nesting


def requests(model: str) -> st.SearchStrategy[tuple[str, bytes]]:
    """(path, body as bytes): mostly JSON objects for that endpoint, sometimes anything at all."""

    def bodies(chat: bool) -> st.SearchStrategy[bytes]:
        objects = _objects(model, chat)
        as_json = st.one_of(objects, objects, objects, objects, objects, JSON).map(lambda b: json.dumps(b).encode())
        return st.one_of(as_json, as_json, as_json, as_json, st.binary(max_size=64), _structural(model))

    completions = st.tuples(st.just("/v1/completions"), bodies(False))
    return completions | st.tuples(st.just("/v1/chat/completions"), bodies(True))


def post_and_check(url: str, body: bytes, timeout_s: float = 60.0) -> int:
    """POST ``body``; fail on a 5xx, a refusal not in OpenAI's error format, or a stream that does
    not end with [DONE]. A request that hangs fails on the timeout. Returns the status."""
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, content_type, payload = response.status, response.headers["content-type"], response.read()
    except urllib.error.HTTPError as exc:
        status, content_type, payload = exc.code, exc.headers["content-type"], exc.read()
    assert status < 500, (status, payload[:300], body[:300])
    if status != 200:
        error = json.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], payload
    elif content_type.startswith("text/event-stream"):
        events = [line for line in payload.decode().split("\n\n") if line]
        assert events[-1] == "data: [DONE]", payload[-300:]
        assert all(json.loads(event[6:]).get("error") is None for event in events[:-1]), payload[:300]
    else:
        assert json.loads(payload)["choices"], payload
    return status


def models_requests() -> st.SearchStrategy[tuple[str, str, bytes, dict]]:
    """(method, path with a query, body, headers) for /v1/models: every method, any query, any body,
    any authorization and content type."""
    query = st.one_of(st.just(""), st.text(alphabet="abc=&%0123456789xyz?", max_size=24).map(lambda q: "?" + q))
    headers = st.fixed_dictionaries(
        {},
        optional={
            "Authorization": st.sampled_from(["", "Bearer", "Bearer x", "Basic abc", "Bearer " + "k" * 300]),
            "content-type": st.sampled_from(["application/json", "text/plain", "", "multipart/form-data"]),
        },
    )
    return st.tuples(
        st.sampled_from(["GET", "GET", "GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
        query.map(lambda q: "/v1/models" + q),
        st.binary(max_size=64) | JSON.map(lambda b: json.dumps(b).encode()),
        headers,
    )


def request_and_check(url: str, method: str, body: bytes, headers: dict, timeout_s: float = 30.0) -> int:
    """Any method on a read-only endpoint: no 5xx; a refusal (but a bodiless HEAD) in OpenAI's error format."""
    request = urllib.request.Request(url, data=body or None, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read()
    assert status < 500, (method, url, status, payload[:300])
    if status == 200 and method == "GET":
        assert json.loads(payload)["object"] == "list", payload[:300]
    elif status != 200 and method != "HEAD":
        error = json.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], payload[:300]
    return status
