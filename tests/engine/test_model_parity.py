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
