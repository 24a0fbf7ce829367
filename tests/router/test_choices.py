"""router.choices and the answers built from several choices (n > 1, a batch of prompts), with
the echoed prompt's logprobs and vLLM's prompt_logprobs field: the merge, the order choices start
in, cancellation, and the JSON and streamed bodies. The cluster tests run them on real pools."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from common.errors import OverloadedError
from common.outputs import TokenLogprob
from common.serving import StreamDelta
from router import openai_bodies as bodies
from router import protocol
from router.choices import merged_choices
from router.intake import Intake, TokenizedPrompt
from router.responses import ResponseWriter

MODEL = "smol"


def run(coroutine):
    return asyncio.run(coroutine)


class Choices:
    """Fake orchestrator runs: choice i yields two deltas, texts "i:a", "i:b"; records when each starts."""

    def __init__(self, fail: set[int] = frozenset(), hang: set[int] = frozenset()) -> None:
        self.events: list[str] = []
        self.closed: set[int] = set()
        self.fail = fail
        self.hang = hang

    async def start(self, index: int) -> AsyncIterator[StreamDelta]:
        self.events.append(f"start {index}")
        try:
            if index in self.fail:
                raise OverloadedError("full")
            yield StreamDelta(f"r-{index}", [index], f"{index}:a", num_cached_tokens=index)
            self.events.append(f"sent {index}")
            if index in self.hang:
                await asyncio.Event().wait()
            await asyncio.sleep(0)
            yield StreamDelta(f"r-{index}", [index], f"{index}:b", finish_reason="length")
        finally:
            self.closed.add(index)


def test_every_choice_s_deltas_arrive_tagged_and_a_prompt_s_others_start_after_its_first():
    choices = Choices()

    async def collect():
        return [d async for d in merged_choices(choices.start, num_prompts=2, n=2)]

    deltas = run(collect())
    assert sorted((d.index, d.new_text) for d in deltas) == sorted(
        (i, f"{i}:{part}") for i in range(4) for part in "ab"
    )
    assert all(d.new_text.startswith(f"{d.index}:") for d in deltas)
    events = choices.events
    for leader, follower in ((0, 1), (2, 3)):
        assert events.index(f"sent {leader}") < events.index(f"start {follower}")
    assert choices.closed == {0, 1, 2, 3}


def test_one_choice_is_passed_on_as_it_is():
    choices = Choices()

    async def collect():
        return [d async for d in merged_choices(choices.start, num_prompts=1, n=1)]

    assert [(d.index, d.new_text) for d in run(collect())] == [(0, "0:a"), (0, "0:b")]


def test_a_choice_refused_before_any_delta_fails_the_request_and_the_others_are_cancelled():
    choices = Choices(fail={1}, hang={0})

    async def collect():
        merged = merged_choices(choices.start, num_prompts=1, n=2)
        got = []
        with pytest.raises(OverloadedError):
            async for delta in merged:
                got.append(delta)
        return got

    assert [d.index for d in run(collect())] == [0]
    assert choices.closed == {0, 1}  # the hanging leader was cancelled and closed


def test_closing_the_merged_stream_cancels_every_choice():
    choices = Choices(hang={0, 1, 2})

    async def first_then_close():
        merged = merged_choices(choices.start, num_prompts=3, n=1)
        await merged.__anext__()
        await merged.aclose()

    run(first_then_close())
    assert choices.closed == {0, 1, 2}


def _intake(body: dict, prompts: list[list[int]]) -> Intake:
    kind = "chat" if "messages" in body else "completion"
    parsed = protocol.parse_request({"model": MODEL, **body}, MODEL, kind)
    texts = body.get("prompt") if isinstance(body.get("prompt"), list) else [body.get("prompt")]
    return Intake(
        parsed, [TokenizedPrompt(ids, text, parsed.sampling) for ids, text in zip(prompts, texts, strict=True)]
    )


def _writer() -> ResponseWriter:
    return ResponseWriter(MODEL, lambda ids: "".join(f"<{i}>" for i in ids))


async def _deltas(items: list[StreamDelta]) -> AsyncIterator[StreamDelta]:
    for item in items:
        yield item


def _respond(intake: Intake, items: list[StreamDelta]) -> dict:
    async def go():
        stream = _deltas(items)
        first = await stream.__anext__()
        return await _writer().collect(intake, "cmpl-1", first, stream, {})

    return json.loads(run(go()).body)


def _stream(intake: Intake, items: list[StreamDelta]) -> list[dict]:
    async def go():
        stream = _deltas(items)
        first = await stream.__anext__()
        return [c async for c in _writer().sse(intake, "cmpl-1", first, stream)]

    chunks = run(go())
    assert chunks[-1] == bodies.SSE_DONE
    return [json.loads(c[6:]) for c in chunks[:-1]]


def test_a_batch_with_n_two_answers_one_choice_per_prompt_and_sample_and_counts_each_prompt_once():
    intake = _intake({"prompt": ["x", "y"], "n": 2, "max_tokens": 1}, [[1, 2], [3, 4, 5]])
    items = [
        StreamDelta("r", [10 + i], f"t{i}", finish_reason="length", index=i, num_cached_tokens=i) for i in (3, 1, 0, 2)
    ]
    body = _respond(intake, items)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "t0"), (1, "t1"), (2, "t2"), (3, "t3")]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (5, 4, 9)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 + 2  # each prompt's first choice's

    streamed = _stream(intake, items)
    assert sorted(chunk["choices"][0]["index"] for chunk in streamed) == [0, 1, 2, 3]
    assert all(chunk["choices"][0]["finish_reason"] == "length" for chunk in streamed)


def test_the_echoed_prompt_comes_with_its_tokens_logprobs_as_lm_eval_reads_them():
    prompt = [1, 2, 3]
    scores = [TokenLogprob(2, -1.5, ((7, -0.5),), 3), TokenLogprob(3, -0.25, ((3, -0.25),), 1)]
    answer = [TokenLogprob(9, -0.125, ((9, -0.125),))]
    intake = _intake({"prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 1}, [prompt])
    items = [StreamDelta("r", [9], "<9>", logprobs=answer, prompt_logprobs=scores, finish_reason="length")]
    choice = _respond(intake, items)["choices"][0]
    assert choice["text"] == "abc<9>"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["<1>", "<2>", "<3>", "<9>"]
    assert logprobs["token_logprobs"] == [None, -1.5, -0.25, -0.125]
    assert logprobs["top_logprobs"] == [None, {"<7>": -0.5, "<2>": -1.5}, {"<3>": -0.25}, {"<9>": -0.125}]
    assert logprobs["text_offset"] == [0, 3, 6, 3]  # the prompt's token texts, then the answer's after "abc"
    assert "prompt_logprobs" not in choice  # the client did not set vLLM's field

    (opening, *_rest) = _stream(intake, items)
    assert opening["choices"][0]["text"] == "abc"
    assert opening["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.5, -0.25]


def test_prompt_logprobs_come_in_vllm_s_shape_on_the_choice_and_on_a_chat_response():
    scores = [TokenLogprob(2, -1.5, ((7, -0.5),), 3)]
    intake = _intake({"prompt": "ab", "prompt_logprobs": 1, "max_tokens": 1}, [[1, 2]])
    items = [StreamDelta("r", [9], "<9>", prompt_logprobs=scores, finish_reason="length")]
    expected = [
        None,
        {
            "2": {"logprob": -1.5, "rank": 3, "decoded_token": "<2>"},
            "7": {"logprob": -0.5, "rank": 1, "decoded_token": "<7>"},
        },
    ]
    entries = _respond(intake, items)["choices"][0]["prompt_logprobs"]
    assert entries == expected and list(entries[1]) == ["2", "7"]  # the prompt's token first, as vLLM
    chat = _intake({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}, [[1, 2]])
    assert _respond(chat, items)["prompt_logprobs"] == expected
    assert _stream(chat, items)[0]["prompt_logprobs"] == expected


def test_a_prompt_s_first_choice_scores_it_for_every_choice_of_it():
    prompt = [1, 2]
    scores = [TokenLogprob(2, -1.5, ((2, -1.5),), 1)]
    intake = _intake({"prompt": "ab", "echo": True, "logprobs": 0, "max_tokens": 1, "n": 2}, [prompt])
    items = [
        StreamDelta("r", [9], "<9>", prompt_logprobs=scores, finish_reason="length", index=0),
        StreamDelta("r", [8], "<8>", finish_reason="length", index=1),  # a later choice: not scored again
    ]
    for choice in _respond(intake, items)["choices"]:
        assert choice["logprobs"]["token_logprobs"][:2] == [None, -1.5]
    openings = [c for c in _stream(intake, items) if c["choices"][0]["text"] == "ab"]
    assert [c["choices"][0]["index"] for c in openings] == [0, 1]
    assert all(c["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.5] for c in openings)
    params = intake.parsed.sampling
    assert params.prompt_logprobs == 0
    assert [params.for_choice(i, score_prompt=i == 0).prompt_logprobs for i in range(2)] == [0, None]


def test_an_answer_whose_prompt_scores_never_came_is_an_error_not_an_empty_score():
    # A prefill replica's reply lost after its KV landed: the first delta carries no prompt_logprobs.
    intake = _intake({"prompt": "ab", "echo": True, "logprobs": 1, "max_tokens": 1}, [[1, 2]])
    items = [StreamDelta("r", [9], "<9>", finish_reason="length")]
    assert "error" in _respond(intake, items)
    assert [chunk.get("error") is not None for chunk in _stream(intake, items)] == [True]
