"""Request handling through the engine: validation before the cache, stop strings, logprobs,
seeded sampling, aborts, and the prefill -> decode hand-off between two engines."""

from __future__ import annotations

import pytest
import torch

from common.config import CacheConfig, EngineConfig, EngineRole, ModelConfig, ParallelConfig, SchedulerConfig
from common.errors import InvalidRequestError, UnsupportedModelError
from engine import SamplingParams
from engine.llm_engine import LLMEngine
from tests.conftest import PROMPTS

pytestmark = pytest.mark.slow


def make_engine(model_dir, role=EngineRole.COLOCATED, **cache) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir)),
            cache=CacheConfig(kv_cache_memory=cache.pop("kv_cache_memory", 64 * 2**20), **cache),
            scheduler=SchedulerConfig(role=role),
        )
    )


@pytest.fixture(scope="module")
def engine(smol_dir):
    instance = make_engine(smol_dir)
    yield instance
    instance.shutdown()


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        assert not eng.has_unfinished_requests()
        assert eng.num_blocks_held() == 0
        eng.check_integrity()


def run_to_completion(engine: LLMEngine, max_steps: int = 500) -> dict:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


@pytest.mark.parametrize(
    ("prompt", "params", "param", "code"),
    [
        ("", None, "prompt", "invalid_request"),
        ([], None, "prompt", "invalid_request"),
        ([10**9], None, "prompt", "invalid_request"),
        (list(range(100, 100 + 9000)), None, "prompt", "context_length_exceeded"),
    ],
)
def test_bad_prompts_are_refused_before_the_cache(engine, prompt, params, param, code):
    free_before = engine.kv.pool.num_free_blocks
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", prompt, params)
    assert info.value.param == param and info.value.code == code
    assert engine.kv.pool.num_free_blocks == free_before and not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop": {"x": 1}}, "stop"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("dup", "Hello", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", "Hello again")
    run_to_completion(engine)


def test_stop_string_split_across_tokens_truncates_and_frees(engine):
    # First find what greedy decoding writes, then stop on a string that spans a token boundary.
    engine.add_request("probe", PROMPTS[1], SamplingParams(temperature=0, max_tokens=20))
    text = run_to_completion(engine)["probe"].outputs[0].text
    assert "return" in text
    stop = text[text.index("return") - 2 : text.index("return") + 4]  # e.g. "  retu": crosses tokens
    engine.add_request("stop", PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))
    out = run_to_completion(engine)["stop"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    engine.add_request(
        "incl", PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, stop=[stop], include_stop_str_in_output=True)
    )
    assert run_to_completion(engine)["incl"].outputs[0].text == text[: text.index(stop) + len(stop)]


def test_logprobs_match_transformers(engine, hf_smol):
    ids = engine.tokenizer.encode(PROMPTS[0])
    engine.add_request("lp", ids, SamplingParams(temperature=0, max_tokens=1, logprobs=3))
    out = run_to_completion(engine)["lp"].outputs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_smol(torch.tensor([ids])).logits[0, -1].float(), -1)
    (entry,) = out.logprobs
    assert entry.token_id == out.token_ids[0] == int(ref.argmax())
    assert entry.logprob == pytest.approx(ref.max().item(), abs=1e-4)
    top_ids = [tid for tid, _ in entry.top]
    assert top_ids == ref.topk(3).indices.tolist()


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=10)
    engine.add_request("alone", PROMPTS[2], params)
    alone = run_to_completion(engine)["alone"].outputs[0].token_ids
    engine.add_request("other1", PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=10))
    engine.add_request("crowd", PROMPTS[2], params)
    engine.add_request("other2", PROMPTS[3], SamplingParams(temperature=1.0, seed=7, max_tokens=10))
    crowd = run_to_completion(engine)["crowd"].outputs[0].token_ids
    assert crowd == alone
    engine.add_request(
        "reseeded", PROMPTS[2], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=10)
    )
    assert run_to_completion(engine)["reseeded"].outputs[0].token_ids != alone


def test_abort_mid_generation_frees_blocks(engine):
    engine.add_request("abort-me", PROMPTS[2], SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.num_blocks_held() > 0
    engine.abort_request("abort-me")
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["abort-me"].finished and outputs["abort-me"].outputs[0].finish_reason == "abort"
    assert engine.num_blocks_held() == 0


def test_prefill_role_hands_kv_to_decode_role(smol_dir, hf_smol, hf_reference):
    """The hand-off protocol in-process: reserve on decode, prefill elsewhere, copy the blocks
    through the layout contract, then decode. Tokens equal transformers' greedy output."""
    prefill = make_engine(smol_dir, EngineRole.PREFILL)
    decode = make_engine(smol_dir, EngineRole.DECODE)
    try:
        params = SamplingParams(temperature=0, max_tokens=12)
        prompts = [prefill.tokenizer.encode(p) for p in PROMPTS[:3]]
        for i, ids in enumerate(prompts):
            dst_blocks = decode.reserve(f"r{i}", ids, params)
            assert dst_blocks is not None
            prefill.add_request(f"r{i}", ids, params)
            handed = {}
            while prefill.has_unfinished_requests():
                for out in prefill.step():
                    handed[out.request_id] = out
            out = handed[f"r{i}"]
            assert out.outputs[0].finish_reason == "prefilled" and len(out.outputs[0].token_ids) == 1
            src_blocks = out.kv_block_ids
            for src_layer, dst_layer in zip(prefill.kv_caches, decode.kv_caches, strict=True):
                dst_layer[:, dst_blocks] = src_layer[:, src_blocks[: len(dst_blocks)]]
            prefill.release(f"r{i}")
            decode.kv_ready(f"r{i}", out.outputs[0].token_ids[0])
        finished = run_to_completion(decode)
        for i, ids in enumerate(prompts):
            assert finished[f"r{i}"].outputs[0].token_ids == hf_reference(hf_smol, ids, 12)
        assert prefill.num_blocks_held() == 0 and decode.num_blocks_held() == 0
        prefill.check_integrity()
        decode.check_integrity()
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_indivisible_tp_degree_names_allowed_degrees(smol_dir):
    with pytest.raises(UnsupportedModelError, match=r"allowed degrees: \[1, 3, 9\]"):
        LLMEngine(EngineConfig(model=ModelConfig(model=str(smol_dir)), parallel=ParallelConfig(2)))


def test_unsupported_architecture_is_named(tmp_path, smol_dir):
    import json
    import shutil

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*supports LlamaForCausalLM"):
        LLMEngine(EngineConfig(model=ModelConfig(model=str(tmp_path))))


def test_request_timeline_is_recorded_in_order(engine):
    engine.add_request("timed", PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))
    metrics = run_to_completion(engine)["timed"].metrics
    assert metrics is not None and metrics.ttft is not None and metrics.ttft > 0
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time <= metrics.finished_time


def test_decode_role_first_token_may_end_the_request(smol_dir):
    decode = make_engine(smol_dir, EngineRole.DECODE)
    try:
        ids = decode.tokenizer.encode(PROMPTS[0])
        assert decode.reserve("one", ids, SamplingParams(max_tokens=1)) is not None
        assert decode.num_blocks_held() > 0
        decode.kv_ready("one", first_token_id=ids[-1])
        (output,) = decode.step()
        assert output.finished and output.outputs[0].token_ids == [ids[-1]]
        assert output.outputs[0].finish_reason == "length"
        assert decode.num_blocks_held() == 0 and not decode.has_unfinished_requests()
        decode.check_integrity()
    finally:
        decode.shutdown()


def test_bounded_waiting_queue_refuses_then_offline_api_feeds_gradually(tiny_dir):
    from common.errors import OverloadedError
    from engine import LLM

    with LLM(str(tiny_dir), kv_cache_memory=8 * 2**20, max_num_waiting=2) as llm:
        engine = llm.engine
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2))
        engine.add_request("b", [5, 6, 8], SamplingParams(max_tokens=2))
        with pytest.raises(OverloadedError, match="max_num_waiting=2"):
            engine.add_request("c", [5, 6, 9], SamplingParams(max_tokens=2))
        run_to_completion(engine)
        # The offline API never overflows the queue: it adds requests as room frees up.
        outputs = llm.generate([[10 + i, 11, 12] for i in range(7)], SamplingParams(max_tokens=3, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outputs] == [3] * 7
        # A bad prompt in the middle fails the call and leaves nothing behind.
        with pytest.raises(InvalidRequestError):
            llm.generate([[5, 6], [7, 8], [], [9, 10]], SamplingParams(max_tokens=50))
        assert engine.num_blocks_held() == 0 and not engine.has_unfinished_requests()
        engine.check_integrity()


def test_stop_string_on_the_last_allowed_token_reports_stop(engine):
    engine.add_request("probe1", PROMPTS[0], SamplingParams(temperature=0, max_tokens=1))
    first = run_to_completion(engine)["probe1"].outputs[0].text
    stop = first.strip()[:3]
    assert stop
    engine.add_request("last", PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, stop=[stop]))
    out = run_to_completion(engine)["last"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == first[: first.index(stop)]


def test_interrupted_tp_step_leaves_a_clean_shutdown(tiny_dir):
    import time

    from engine import LLM

    llm = LLM(str(tiny_dir), tensor_parallel_size=2, kv_cache_memory=8 * 2**20)
    engine = llm.engine
    engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=4))
    real_execute = engine.executor.driver.execute

    def interrupted(*args, **kwargs):  # Ctrl-C lands after the shards got the step message
        raise KeyboardInterrupt

    engine.executor.driver.execute = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.executor.driver.execute = real_execute
    with pytest.raises(RuntimeError, match="restart it"):
        engine.step()
    start = time.monotonic()
    llm.shutdown()  # must not wait on shards stuck in the interrupted step
    assert time.monotonic() - start < 15
    assert not any(w.is_alive() for w in engine.executor.workers)


def _exit_at_once() -> None:
    raise SystemExit(3)


def test_a_shard_dying_at_start_up_is_reported_at_once(tiny_dir):
    import multiprocessing as mp
    import time

    from engine.executor import WorkerLauncher, _ProcessHandle

    class DyingLauncher(WorkerLauncher):
        def launch(self, rank, world_size, init_method, config, model_dir):
            process = mp.get_context("spawn").Process(target=_exit_at_once, daemon=True)
            process.start()
            return _ProcessHandle(process)

    config = EngineConfig(
        model=ModelConfig(model=str(tiny_dir)),
        cache=CacheConfig(kv_cache_memory=8 * 2**20),
        parallel=ParallelConfig(tensor_parallel_size=2),
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"shard\(s\) \[1\] exited during start-up"):
        LLMEngine(config, launcher=DyingLauncher())
    assert time.monotonic() - start < 30  # not the 300 s rendezvous timeout


def test_streaming_outputs_carry_only_the_step_s_tokens(engine):
    """A step costs O(its new tokens): unfinished outputs leave the cumulative lists empty; the
    deltas concatenated are exactly what the final output holds."""
    engine.add_request("stream", PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        steps += [o for o in engine.step() if o.request_id == "stream"]
    *streaming, final = steps
    assert streaming and all(not o.finished for o in streaming) and final.finished
    assert all(o.outputs[0].token_ids == [] and o.outputs[0].logprobs == [] for o in streaming)
    deltas = [o.outputs[0] for o in steps]
    assert [t for d in deltas for t in d.new_token_ids] == final.outputs[0].token_ids
    assert len(final.outputs[0].token_ids) == 6
    assert [lp for d in deltas for lp in d.new_logprobs] == final.outputs[0].logprobs
    assert [lp.token_id for lp in final.outputs[0].logprobs] == final.outputs[0].token_ids
    assert "".join(d.new_text for d in deltas) == final.outputs[0].text


def test_a_seeded_requests_generator_is_on_the_device_its_logits_are(engine):
    """On CUDA a CPU generator cannot draw into the logits: the step raised and the replica's engine
    thread ended. Here both are the CPU; ``bench.gpu_check`` samples seeded rows on a GPU."""
    engine.add_request("seeded", PROMPTS[1], SamplingParams(temperature=0.8, seed=5, max_tokens=2))
    assert engine.outputs.states["seeded"].generator.device == engine.executor.driver.device
    run_to_completion(engine)
