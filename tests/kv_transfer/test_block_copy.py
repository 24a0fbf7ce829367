"""Block copies: coalesced slices and index kernels move exactly the blocks asked for, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.block_copy import copy_blocks, gather_plan, plan_block_copy, scatter_plan


def _reference(dst: torch.Tensor, src: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> torch.Tensor:
    out = dst.clone()
    for s, d in zip(src_ids, dst_ids, strict=True):
        out[:, d] = src[:, s]
    return out


CASES = {
    "consecutive": (list(range(3, 19)), list(range(40, 56))),
    "two runs": ([*range(0, 8), *range(20, 28)], [*range(8, 16), *range(30, 38)]),
    "scattered": ([37, 2, 19, 5, 44, 11, 0, 63, 28, 7, 50, 33], [1, 60, 14, 9, 22, 48, 3, 35, 57, 26, 40, 12]),
    "one block": ([5], [9]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_matches_the_blockwise_reference(case, dtype):
    src_ids, dst_ids = CASES[case]
    g = torch.Generator().manual_seed(0)
    src = torch.randn(2, 64, 4, 3, 8, generator=g).to(dtype)
    dst = torch.randn(2, 64, 4, 3, 8, generator=g).to(dtype)
    expected = _reference(dst, src, src_ids, dst_ids)
    plan = plan_block_copy(src_ids, dst_ids)
    assert (plan.runs is not None) == (case != "scattered")
    copy_blocks(dst, src, plan)
    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("case", list(CASES))
def test_gather_then_scatter_through_a_contiguous_payload(case):
    src_ids, dst_ids = CASES[case]
    src = torch.randn(2, 64, 4, 3, 8)
    dst = torch.zeros(2, 64, 4, 3, 8)
    payload = torch.empty(2, len(src_ids), 4, 3, 8)
    copy_blocks(payload, src, gather_plan(src_ids))
    assert torch.equal(payload, src[:, src_ids])
    copy_blocks(dst, payload, scatter_plan(dst_ids))
    assert torch.equal(dst, _reference(torch.zeros_like(dst), src, src_ids, dst_ids))


def test_head_slices_copy_only_their_heads():
    src = torch.randn(2, 16, 4, 4, 8)
    dst = torch.zeros(2, 16, 4, 2, 8)
    copy_blocks(dst, src[:, :, :, 1:3], plan_block_copy([0, 1, 2, 9], [4, 5, 6, 0]))
    assert torch.equal(dst[:, [4, 5, 6, 0]], src[:, [0, 1, 2, 9], :, 1:3])
    assert torch.count_nonzero(dst[:, [1, 2, 3, 7]]) == 0


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="3 source blocks for 2"):
        plan_block_copy([1, 2, 3], [4, 5])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stack_of_layers_copies_along_dim_2(case, dtype):
    src_ids, dst_ids = CASES[case]
    g = torch.Generator().manual_seed(1)
    src = torch.randn(3, 2, 64, 4, 3, 8, generator=g).to(dtype)
    dst = torch.zeros(3, 2, 64, 4, 3, 8, dtype=dtype)
    copy_blocks(dst, src, plan_block_copy(src_ids, dst_ids), dim=2)
    for layer in range(3):
        expected = _reference(torch.zeros_like(dst[layer]), src[layer], src_ids, dst_ids)
        assert torch.equal(dst[layer].view(torch.uint8), expected.view(torch.uint8))
