"""A prefill chunk after earlier context (a later chunk, a prefix-cache hit) through SDPA: on CUDA
without a mask tensor (a mask with GQA sends CUDA's SDPA to its math path, which materialises
every score), as a lower-right causal bias over K/V expanded to the query heads. Both forms must
give the masked result, for every GQA ratio and chunk/context split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention.torch_paged import attend_after_context


def _reference(query, keys, values, scale):
    """Plain softmax attention, K/V repeated per group (Hugging Face's repeat_kv order), causal from the end."""
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    n, context = query.shape[2], keys.shape[2]
    scores = (query @ keys.transpose(-1, -2)) * scale
    allowed = torch.arange(context)[None, :] <= torch.arange(context - n, context)[:, None]
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ values


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize(("chunk", "context"), [(1, 17), (5, 12), (16, 16), (33, 300)])
def test_the_unmasked_form_equals_the_masked_one(heads, kv_heads, chunk, context):
    g = torch.Generator().manual_seed(heads * 1000 + context)
    query = torch.randn(1, heads, chunk, 64, generator=g)
    keys, values = (torch.randn(1, kv_heads, context, 64, generator=g) for _ in range(2))
    mask = torch.arange(context)[None, :] <= torch.arange(context - chunk, context)[:, None]
    expected = _reference(query, keys, values, 0.125)
    masked = attend_after_context(query, keys, values, context, mask, 0.125)
    unmasked = attend_after_context(query, keys, values, context, None, 0.125)
    torch.testing.assert_close(masked, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unmasked, expected, atol=1e-5, rtol=1e-5)


def test_a_misaligned_bias_would_be_caught():
    """The check above can fail: top-left causality (``is_causal``) is not the chunk's."""
    g = torch.Generator().manual_seed(0)
    query, keys, values = torch.randn(1, 2, 4, 64, generator=g), *(torch.randn(1, 2, 12, 64, generator=g) for _ in "kv")
    wrong = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=0.125)
    assert not torch.allclose(wrong, _reference(query, keys, values, 0.125), atol=1e-3)
