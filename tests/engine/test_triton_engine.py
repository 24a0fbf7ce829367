"""The GPU path's engine on CPU: the Triton backend and fused layer ops run in Triton's interpreter,
and the CUDA-graph runner's buffer protocol (buckets, padding) replays eagerly.

Graph capture itself, streams and the kernels' compiled speed need a GPU (``bench.gpu_check``);
everything a graph replays is the code tested here: greedy float32 output equal to transformers',
padded buckets equal to unpadded batches.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' modules are imported
pytest.importorskip("triton")

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs, bucket_for, capture_sizes

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# 1 to 40 tokens: a one-token prompt, block boundaries (16), a chunk after earlier context.
PROMPT_LENGTHS = (1, 5, 16, 17, 40)


def prompts(lengths=PROMPT_LENGTHS, offset: int = 0) -> list[list[int]]:
    return [[7 + (offset + 13 * i + j) % 900 for j in range(n)] for i, n in enumerate(lengths)]


def triton_llm(tiny_dir, **kwargs) -> LLM:
    # block_size 16 and a 24-token prefill chunk: prompts cross blocks and continue after context.
    options = {"kv_cache_memory": 4 * 2**20, "max_prefill_chunk": 24, "max_num_seqs": 8, **kwargs}
    return LLM(str(tiny_dir), dtype="float32", attention_backend="triton", **options)


def expected(hf_tiny, hf_reference, batch) -> list[list[int]]:
    return [hf_reference(hf_tiny, p, GREEDY.max_tokens) for p in batch]


def test_capture_sizes_and_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(65) == [1, 2, 4, 8, 16, 32, 48, 64, 80]
    sizes = capture_sizes(64)
    assert [bucket_for(sizes, n) for n in (1, 2, 3, 5, 9, 17, 64)] == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_for(sizes, 65) is None


def test_triton_backend_and_fused_layers_give_transformers_tokens(tiny_dir, hf_tiny, hf_reference):
    batch = prompts()
    with triton_llm(tiny_dir) as llm:
        runner = llm.engine.executor.driver
        assert runner.attention_backend == "triton" and runner.graphs is None  # CPU: no capture
        assert runner.model.model.norm.fused is not None  # the fused layer ops are the ones run
        outputs = llm.generate(batch, GREEDY)
        # A prefix hit: the first prompt again, longer, reads its first blocks from the cache.
        longer = batch[-1] + [11, 12, 13]
        (again,) = llm.generate([longer], GREEDY)
        assert again.num_cached_tokens >= 32
        assert llm.engine.num_blocks_held() == 0
    assert [o.outputs[0].token_ids for o in outputs] == expected(hf_tiny, hf_reference, batch)
    assert again.outputs[0].token_ids == hf_reference(hf_tiny, longer, GREEDY.max_tokens)


def test_padded_graph_buckets_give_the_tokens_of_unpadded_batches(tiny_dir, hf_tiny, hf_reference):
    """Every decode step goes through the graph runner's static buffers, replayed eagerly: batches
    of 3, 5 and 6 decodes pad to buckets of 4 and 8 (rows of slot -1, context 0). Outputs are made
    while the next step runs and each step is queued before the last one is read (its decodes'
    ids taken from the device), as on CUDA by default."""
    batch = prompts((3, 9, 17, 20, 33, 2), offset=5)
    with triton_llm(tiny_dir, overlap_outputs=True, async_scheduling=True) as llm:
        runner = llm.engine.executor.driver
        runner.graphs = runner.decode_graphs()
        assert runner.graphs.sizes == [1, 2, 4, 8]
        assert runner.graphs.capture().memory_bytes == 0  # off CUDA: nothing captured, replayed eagerly
        runs: list[tuple[int, int]] = []
        real_run = runner.graphs.run

        def counted(decodes, carried=None):
            hidden = real_run(decodes, carried)
            runs.append((len(decodes.input_ids), bucket_for(runner.graphs.sizes, len(decodes.input_ids))))
            return hidden

        runner.graphs.run = counted
        outputs = llm.generate(batch[:3], GREEDY) + llm.generate(batch[3:], GREEDY) + llm.generate(batch, GREEDY)
        assert llm.engine.num_blocks_held() == 0
        assert runner.num_graph_replays == len(runs)
        assert llm.engine.num_steps_ahead > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected(hf_tiny, hf_reference, batch + batch)
    assert any(n < size for n, size in runs), f"no step was padded: {runs}"
    assert {size for _, size in runs} >= {4, 8}, runs


def test_padding_rows_store_nothing_where_a_real_slot_would_be_written(tiny_dir):
    """The protocol's padding matters: a padding row that kept a real slot would overwrite a live
    token's KV. Here the runner is made to skip the reset of the slots past the batch: the next,
    smaller batch's padding rows then store into the previous batch's slots."""
    with triton_llm(tiny_dir) as llm:
        runner = llm.engine.executor.driver
        graphs: DecodeGraphs = runner.decode_graphs()
        graphs.token_inputs[2, :4] = 3  # a slot a live token could own
        before = runner.kv_caches[0][:, 0].clone()
        graphs.seq_lens[:4] = 1
        graphs._forward(4)
        assert not runner.kv_caches[0][:, 0].equal(before)  # slot 3 (block 0) was written
        graphs.token_inputs[2, :4] = -1
        before = runner.kv_caches[0].clone()
        graphs._forward(4)
        assert runner.kv_caches[0].equal(before)  # padding stores nothing


def test_the_graphs_memory_reserve_covers_the_largest_bucket_and_grows_with_it():
    from engine.cuda_graphs import memory_reserve

    small = memory_reserve(8, 576, 576, 192, 1536, 2, 16)
    large = memory_reserve(256, 576, 576, 192, 1536, 2, 16)
    assert 64 * 2**20 < small < large
    # An 8B layer at 256 rows in bfloat16: at least the gate/up activations of the bucket, twice.
    assert memory_reserve(256, 4096, 4096, 1024, 14336, 2, 16) > 2 * 256 * 2 * 14336 * 2


def test_the_start_up_check_passes_here_and_names_a_kernel_that_is_wrong(monkeypatch):
    import torch

    from engine.attention import triton_kernels
    from engine.attention.triton_selfcheck import triton_unusable

    cpu = torch.device("cpu")
    assert triton_unusable(cpu, torch.float32, 9, 3, 64, 16) is None
    assert triton_unusable(cpu, torch.bfloat16, 4, 2, 32, 16) is None
    real = triton_kernels.paged_decode_attention

    def off_by_one(q, key_cache, value_cache, block_tables, seq_lens, scale, out, num_splits=1):
        return real(q, key_cache, value_cache, block_tables, seq_lens - 1, scale, out, num_splits)

    monkeypatch.setattr(triton_kernels, "paged_decode_attention", off_by_one)
    assert "paged decode attention differs" in triton_unusable(cpu, torch.float32, 9, 3, 64, 16)

    def broken(*args, **kwargs):
        raise RuntimeError("PTX JIT compilation failed")

    monkeypatch.setattr(triton_kernels, "paged_decode_attention", broken)
    assert "PTX JIT compilation failed" in triton_unusable(cpu, torch.float32, 9, 3, 64, 16)
