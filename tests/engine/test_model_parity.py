"""One forward pass of our model against transformers' in float32: logits within tolerance."""

from __future__ import annotations

import pytest
import torch

from common.config import CacheConfig, EngineConfig, ModelConfig
from engine.distributed.parallel import TensorParallel
from engine.model_runner import ModelRunner
from engine.step_input import StepInput

pytestmark = pytest.mark.slow


def prefill_step(token_ids: list[int], block_ids: list[int], block_size: int) -> StepInput:
    n = len(token_ids)
    slots = [block_ids[p // block_size] * block_size + p % block_size for p in range(n)]
    return StepInput(token_ids, list(range(n)), slots, 0, [n], [n], [block_ids], list(range(n)))


@pytest.mark.parametrize("model", ["smol", "tiny"])
def test_prefill_logits_match_transformers(model, smol_dir, tiny_dir, hf_smol, hf_tiny, record_property):
    model_dir, hf = (smol_dir, hf_smol) if model == "smol" else (tiny_dir, hf_tiny)
    config = EngineConfig(model=ModelConfig(model=str(model_dir)), cache=CacheConfig(kv_cache_memory=32 * 2**20))
    runner = ModelRunner(config, model_dir, TensorParallel.single(torch.device("cpu")))
    token_ids = [(17 * i + 3) % 40000 + 100 for i in range(75)]  # crosses several 16-token blocks
    blocks = [4, 1, 7, 2, 9]  # deliberately out of order: block tables, not contiguity
    ours = runner.execute(prefill_step(token_ids, blocks, 16))
    with torch.no_grad():
        ref = hf(torch.tensor([token_ids])).logits[0]
    max_abs = (ours - ref).abs().max().item()
    record_property("max_abs_logit_diff", max_abs)
    print(f"{model}: max |logit diff| = {max_abs:.3g}")
    assert max_abs < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize(
    ("model_type", "rope_scaling"),
    [
        ("qwen2", None),  # q/k/v biases
        ("mistral", None),
        ("llama", {"rope_type": "linear", "factor": 2.0}),
        (
            "llama",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ],
    ids=["qwen2", "mistral", "rope-linear", "rope-llama3"],
)
def test_architectures_and_rope_variants_match_transformers(model_type, rope_scaling, tmp_path, smol_dir):
    from tests.conftest import build_tiny_llama, load_hf

    model_dir = build_tiny_llama(
        tmp_path / model_type,
        smol_dir,
        model_type=model_type,
        rope_scaling=rope_scaling,
        tie_word_embeddings=model_type == "qwen2",
    )
    hf = load_hf(model_dir)
    config = EngineConfig(model=ModelConfig(model=str(model_dir)), cache=CacheConfig(kv_cache_memory=8 * 2**20))
    runner = ModelRunner(config, model_dir, TensorParallel.single(torch.device("cpu")))
    token_ids = [(29 * i + 11) % 30000 + 50 for i in range(150)]  # past the llama3 original context of 64
    ours = runner.execute(prefill_step(token_ids, list(range(10)), 16))
    with torch.no_grad():
        ref = hf(torch.tensor([token_ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_bfloat16_runs_close_to_float32(tiny_dir, hf_tiny):
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_dir), dtype="bfloat16"), cache=CacheConfig(kv_cache_memory=8 * 2**20)
    )
    runner = ModelRunner(config, tiny_dir, TensorParallel.single(torch.device("cpu")))
    assert runner.layout.dtype == "bfloat16" and runner.kv_caches[0].dtype == torch.bfloat16
    token_ids = list(range(100, 140))
    ours = runner.execute(prefill_step(token_ids, [0, 1, 2], 16))
    with torch.no_grad():
        ref = hf_tiny(torch.tensor([token_ids])).logits[0]
    # bf16 keeps ~3 significant digits: close to fp32, not equal.
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < 0.05
