"""A step's outputs made while the device runs the next step (SchedulerConfig.overlap_outputs, on
by default on CUDA). On CPU the kernels return when done, so the overlap itself is not measurable
here; what is tested is the protocol: the previous step's outputs are made between the next step's
launch and the read of its sampled ids, and clients see exactly what the synchronous loop gives
them (tokens, text, logprobs, stop strings, aborts), with no block leaked."""

from __future__ import annotations

import pytest

from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine import SamplingParams
from engine.llm_engine import LLMEngine
from engine.sampler import PendingSample

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]


def make_engine(model_dir, overlap: bool) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype="float32"),
            cache=CacheConfig(kv_cache_memory=32 * 2**20),
            scheduler=SchedulerConfig(max_num_seqs=8, overlap_outputs=overlap),
        )
    )


@pytest.fixture(scope="module")
def engines(tiny_dir):
    pair = {overlap: make_engine(tiny_dir, overlap) for overlap in (False, True)}
    yield pair
    for engine in pair.values():
        engine.shutdown()


@pytest.fixture(autouse=True)
def no_leaks(engines):
    yield
    for engine in engines.values():
        assert not engine.has_unfinished_requests()
        assert engine.num_blocks_held() == 0
        engine.check_integrity()


def stream(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]], abort_after: dict | None = None):
    """Every output the engine gives, per request, stepping until nothing is left."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list] = {request_id: [] for request_id in requests}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 500, "the engine never finished"
        for output in engine.step():
            outputs[output.request_id].append(output)
        for request_id, after in (abort_after or {}).items():
            if steps == after:
                engine.abort_request(request_id)
    return outputs


def summary(outputs: dict[str, list]) -> dict:
    """What a client sees of each request: the streamed ids and text, the final output."""
    seen = {}
    for request_id, parts in outputs.items():
        final = parts[-1]
        assert final.finished and not any(p.finished for p in parts[:-1]), request_id
        completion = final.outputs[0]
        streamed_text = "".join(p.outputs[0].new_text for p in parts)
        streamed_ids = [t for p in parts for t in p.outputs[0].new_token_ids]
        logprobs = completion.logprobs
        seen[request_id] = (
            completion.token_ids,
            completion.text,
            completion.finish_reason,
            streamed_ids,
            streamed_text,
            [(lp.token_id, round(lp.logprob, 5)) for lp in logprobs] if logprobs else None,
        )
    return seen


def test_outputs_equal_the_synchronous_loop(engines):
    requests = {
        f"r{i}": (prompt, SamplingParams(max_tokens=6 + 5 * i, temperature=0.0, logprobs=2 if i % 2 else None))
        for i, prompt in enumerate(PROMPTS)
    }
    plain = summary(stream(engines[False], requests))
    overlapped = summary(stream(engines[True], requests))
    assert overlapped == plain
    for request_id, (ids, text, reason, streamed_ids, streamed_text, _) in plain.items():
        assert streamed_ids == ids and streamed_text == text and reason == "length", request_id


def test_a_stop_string_found_a_step_late_ends_the_request_at_the_same_token(engines):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    free_run = summary(stream(engines[False], {"free": (PROMPTS[0], params)}))["free"]
    text = free_run[1]
    assert len(text) > 12, "the tiny model's text is too short to place a stop string in"
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    requests = {
        "stopped": (PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop])),
        "beside": (PROMPTS[1], SamplingParams(max_tokens=24, temperature=0.0)),
    }
    plain = summary(stream(engines[False], requests))
    overlapped = summary(stream(engines[True], requests))
    assert plain["stopped"][2] == "stop" and stop not in plain["stopped"][1]
    assert overlapped == plain


def test_an_aborted_request_keeps_its_made_tokens_and_frees_its_blocks(engines):
    requests = {
        "kept": (PROMPTS[2], SamplingParams(max_tokens=16, temperature=0.0)),
        "aborted": (PROMPTS[3], SamplingParams(max_tokens=40, temperature=0.0)),
    }
    plain = summary(stream(engines[False], requests, abort_after={"aborted": 6}))
    overlapped = summary(stream(engines[True], requests, abort_after={"aborted": 6}))
    assert plain["aborted"][2] == "abort"
    # Aborted between the same two steps, the client has seen the same tokens in both loops.
    assert overlapped == plain


def test_the_last_steps_outputs_are_made_while_the_next_step_is_in_flight(engines, monkeypatch):
    engine = engines[True]
    events: list[str] = []
    real_read, real_emit = PendingSample.read, engine._emit_new_tokens

    def read(self):
        events.append("read")
        return real_read(self)

    def emit(request):
        events.append(f"emit:{request.num_output_tokens}")
        return real_emit(request)

    real_launch = engine.sampler.launch

    def launch(logits, rows, mask=None):
        events.append("launch")
        return real_launch(logits, rows, mask)

    monkeypatch.setattr(PendingSample, "read", read)
    monkeypatch.setattr(engine, "_emit_new_tokens", emit)
    monkeypatch.setattr(engine.sampler, "launch", launch)
    stream(engine, {"one": (PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0))})
    # Prefill samples token 1 (its output waits); each decode step makes the previous token's
    # output between its launch and its read; the last token ends the request and goes out at once.
    assert events == [
        "launch", "read",
        "launch", "emit:1", "read",
        "launch", "emit:2", "read",
        "launch", "emit:3", "read", "emit:4",
    ]  # fmt: skip
