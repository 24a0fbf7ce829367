"""The CPU layer loop (``engine.models.llama_cpu``): the path every CPU step takes when the
kernels are built. Its output must be the model's, whatever the step holds (decodes, first
prefill chunks, later chunks reading earlier context), with biases on either kind of linear
layer and across tensor-parallel shards, where a row-parallel bias must join once, after the
partial sums meet."""

from __future__ import annotations

import pytest
import torch

from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine import LLM, SamplingParams
from engine.attention import torch_paged
from engine.cpu_kernels import cpu_kernels
from engine.distributed.parallel import TensorParallel
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.models import llama
from tests.conftest import build_tiny_llama, load_hf

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels could not be built here"),
]

PROMPT_LENGTHS = (1, 9, 40, 130)


@pytest.fixture(scope="module")
def biased_dir(tmp_path_factory, smol_dir):
    """Every linear layer with a bias: q/k/v and o (attention_bias), gate/up and down (mlp_bias)."""
    return build_tiny_llama(
        tmp_path_factory.mktemp("biased") / "llama", smol_dir, seed=3, attention_bias=True, mlp_bias=True
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_biased_model_matches_transformers_at_every_tp(tp, biased_dir, hf_reference):
    hf = load_hf(biased_dir)
    prompts = [[7 + 3 * i for i in range(n)] for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # A 64-token budget splits the longer prompts into chunks that share steps with decodes.
    with LLM(str(biased_dir), tensor_parallel_size=tp, kv_cache_memory=8 * 2**20, max_num_batched_tokens=64) as llm:
        assert llm.engine.executor.driver.model.model.kernels is not None
        outputs = llm.generate(prompts, params)
        assert llm.engine.num_blocks_held() == 0
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_reference(hf, prompt, 12), f"prompt of {len(prompt)} tokens"


def _runner(model_dir, monkeypatch, kernels: bool) -> ModelRunner:
    with monkeypatch.context() as patch:
        if not kernels:
            patch.setattr(llama, "kernels_for", lambda device: None)
        config = EngineConfig(model=ModelConfig(model=str(model_dir)), cache=CacheConfig(kv_cache_memory=8 * 2**20))
        return ModelRunner(config, model_dir, TensorParallel.single(torch.device("cpu")))


@pytest.mark.parametrize("prefill_attention", ["tiled", "sdpa"])
def test_every_step_kind_agrees_with_the_module_path(biased_dir, monkeypatch, prefill_attention):
    """The same steps through the layer loop and through the modules (plain torch ops): decodes,
    first chunks and later chunks side by side, logits equal to float32 rounding; the loop's
    prefill chunks through the tiled kernel or SDPA (whichever the start-up probe picks)."""
    from engine.cpu_kernels.prefill_probe import use_tiled_prefill

    monkeypatch.setenv("PDSERVE_PREFILL_ATTENTION", prefill_attention)
    use_tiled_prefill.cache_clear()
    loop, modules = _runner(biased_dir, monkeypatch, kernels=True), _runner(biased_dir, monkeypatch, kernels=False)
    use_tiled_prefill.cache_clear()
    assert loop.model.model.kernels is not None and modules.model.model.kernels is None
    assert loop.backend.tiled_prefill is (prefill_attention == "tiled")
    steps = []
    engine_config = EngineConfig(
        model=ModelConfig(model=str(biased_dir)),
        cache=CacheConfig(kv_cache_memory=8 * 2**20),
        scheduler=SchedulerConfig(max_num_batched_tokens=48),
    )
    engine = LLMEngine(engine_config)  # records a real schedule's steps to replay on both runners
    try:
        record = engine.executor.driver.execute

        def recording(step, meta=None, carried=None):
            steps.append(step)
            return record(step, meta, carried)

        engine.executor.driver.execute = recording
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for i, n in enumerate(PROMPT_LENGTHS):
            engine.add_request(f"r{i}", [11 + 5 * j for j in range(n)], params)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()
    kinds = {(s.num_decodes > 0, len(s.query_lens) > s.num_decodes) for s in steps}
    assert (True, True) in kinds and (True, False) in kinds, "the schedule should mix decodes and prefill chunks"
    later_chunks = (
        seq > q
        for s in steps
        for q, seq in zip(s.query_lens[s.num_decodes :], s.seq_lens[s.num_decodes :], strict=True)
    )
    assert any(later_chunks), "some prefill chunk should read earlier context from the cache"
    try:
        for step in steps:
            bound = loop.backend.build_metadata(loop._tensors(step), loop.layout.block_size).prefill_attention
            assert (bound is not None) == (loop.backend.tiled_prefill and len(step.query_lens) > step.num_decodes)
            ours = loop.execute(step)
            with monkeypatch.context() as patch:  # the module path's metadata: masks, not the kernel's tables
                patch.setattr(torch_paged, "kernels_for", lambda device: None)
                theirs = modules.execute(step)
            assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), f"step with {step.num_decodes} decodes differs"
    finally:
        loop.close()
        modules.close()


def test_a_position_past_the_rotary_tables_is_refused(tiny_dir, monkeypatch):
    runner = _runner(tiny_dir, monkeypatch, kernels=True)
    model = runner.model.model
    too_far = model.rotary_emb.cos.shape[0]
    meta = runner.backend.build_metadata(runner._tensors(_one_token_step(too_far)), runner.layout.block_size)
    with pytest.raises(IndexError, match="past the rotary tables"):
        model(torch.tensor([5]), torch.tensor([too_far]), runner.kv_caches, meta)
    runner.close()


def _one_token_step(position: int):
    from engine.step_input import StepInput

    return StepInput([5], [position], [0], 0, [1], [1], [[0]], [0])


def test_bfloat16_layer_loop_with_biases_stays_close_to_float32(biased_dir):
    """The bf16 loop (oneDNN's packed products, biases fused into them where the CPU packs) against
    transformers in float32: bf16 keeps ~3 significant digits, a lost bias moves logits far more."""
    from tests.engine.test_model_parity import prefill_step

    config = EngineConfig(
        model=ModelConfig(model=str(biased_dir), dtype="bfloat16"), cache=CacheConfig(kv_cache_memory=8 * 2**20)
    )
    runner = ModelRunner(config, biased_dir, TensorParallel.single(torch.device("cpu")))
    try:
        assert runner.model.model.kernels is not None and runner.dtype == torch.bfloat16
        token_ids = [(13 * i + 5) % 30000 + 50 for i in range(40)]
        ours = runner.execute(prefill_step(token_ids, [0, 1, 2], 16))
    finally:
        runner.close()
    with torch.no_grad():
        ref = load_hf(biased_dir)(torch.tensor([token_ids])).logits[0]
    assert ((ours - ref).norm() / ref.norm()).item() < 0.05
