"""Linear weights packed once for oneDNN (float32 and bfloat16): the same products as F.linear, on every layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.config import CacheConfig, EngineConfig, ModelConfig
from engine import model_runner
from engine.distributed.parallel import TensorParallel
from engine.layers.linear import cpu_packing_available, linear, linear_modules, pack_weight
from engine.model_runner import ModelRunner

CPU = torch.device("cpu")


def needs_packing(dtype: torch.dtype) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not cpu_packing_available(CPU, dtype), reason=f"the engine does not pack {dtype} here")


@needs_packing(torch.bfloat16)
@pytest.mark.parametrize("rows", [1, 3, 64, 257])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_packed_bfloat16_product_is_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(960, 576, generator=g).bfloat16().t().contiguous().t()  # column-major, as stored
    bias = torch.randn(960, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, 576, generator=g).bfloat16()
    got = linear(x, weight, bias, pack_weight(weight))
    assert got.shape == (rows, 960) and got.dtype == torch.bfloat16
    exact = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
    # float32 sums rounded once to bfloat16: within ~1 bf16 ulp of the exact product.
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=2**-7)


@needs_packing(torch.float32)
@pytest.mark.parametrize("rows", [1, 3, 64, 257])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_packed_float32_product_is_f_linear_to_float32_rounding(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(960, 576, generator=g) * 0.05
    bias = torch.randn(960, generator=g) if with_bias else None
    x = torch.randn(rows, 576, generator=g)
    got = linear(x, weight, bias, pack_weight(weight))
    assert got.shape == (rows, 960) and got.dtype == torch.float32
    exact = F.linear(x.double(), weight.double(), bias.double() if bias is not None else None)
    # float32 arithmetic, not bfloat16 underneath (oneDNN's fpmath mode stays strict): a sum of
    # 576 products rounds to ~1e-6 here, a bfloat16 product would be off by ~1e-2.
    assert (got.double() - exact).abs().max().item() < 5e-5


def runner(model_dir, dtype: str) -> ModelRunner:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=dtype), cache=CacheConfig(kv_cache_memory=8 << 20)
    )
    return ModelRunner(config, model_dir, TensorParallel.single(CPU))


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param("bfloat16", marks=needs_packing(torch.bfloat16)),
        pytest.param("float32", marks=needs_packing(torch.float32)),
    ],
)
def test_a_runner_packs_every_linear_weight(tiny_dir, monkeypatch, dtype):
    packed = runner(tiny_dir, dtype)
    with monkeypatch.context() as patch:
        patch.setattr(model_runner, "cpu_packing_available", lambda device, dtype: False)
        plain = runner(tiny_dir, dtype)
    modules = linear_modules(packed.model)
    assert len(modules) == 4 * 2 + 1  # qkv, o, gate_up, down of each of the tiny model's 2 layers, and the LM head
    tolerance = {"atol": 3e-2, "rtol": 2**-7} if dtype == "bfloat16" else {"atol": 1e-5, "rtol": 1e-5}
    for module, reference in zip(modules, linear_modules(plain.model), strict=True):
        assert module.packed is not None and reference.packed is None
        assert module.weight.shape == reference.weight.shape and module.weight.dtype == getattr(torch, dtype)
        x = torch.randn(2, module.weight.shape[1]).to(module.weight.dtype)
        torch.testing.assert_close(
            linear(x, module.weight, None, module.packed).float(), F.linear(x, reference.weight).float(), **tolerance
        )


@needs_packing(torch.bfloat16)
def test_packing_releases_the_plain_weights_but_not_the_tied_embedding(tiny_dir):
    model = runner(tiny_dir, "bfloat16").model
    for layer in model.model.layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert module.weight.untyped_storage().nbytes() <= 2  # one bf16 element: the values live in .packed
    embedding = model.model.embed_tokens.weight
    assert embedding.untyped_storage().nbytes() == embedding.numel() * 2  # rows still looked up
    if model.shape.tie_word_embeddings:
        assert model.lm_head.weight is embedding


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unpacked_weights_are_column_major_for_float32_only(tiny_dir, monkeypatch, dtype):
    """Where torch cannot pack (bfloat16 on an AVX2-only CPU): MKL's float32 product ran faster
    on column-major weights, torch's own bfloat16 loops 14-16x slower (the bfloat16 tests took
    14 minutes each on such a machine), so bfloat16 weights stay as the checkpoint lays them."""
    monkeypatch.setattr(model_runner, "cpu_packing_available", lambda device, dtype: False)
    for module in linear_modules(runner(tiny_dir, dtype).model):
        weight = module.weight
        assert weight.stride() == ((1, weight.shape[0]) if dtype == "float32" else (weight.shape[1], 1)), module
