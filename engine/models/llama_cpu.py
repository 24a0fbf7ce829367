"""The Llama layer stack on CPU with the compiled kernels: one flat loop over the layers.

Through the modules (``LlamaDecoderLayer`` and its sublayers, each calling a kernel wrapper) a layer
was ~15 Python calls, each with its module dispatch, its argument checks and a fresh output
tensor. At batch 1 the calls around the products took a third of a step (bf16 SmolLM2 on 2 cores:
23-24 ms a forward with 16 ms of weight products), twice what the same calls cost in a
microbenchmark: each product streams the weights through the caches and evicts the
interpreter's working set, so every call after it runs cold. Here a layer is its four products
and five or six kernel calls (the decodes' attention, and every prefill chunk's in one call of the
tiled prefill kernel) taking raw pointers checked once per step, its activations in buffers
allocated once per step (17-18 ms the same forward). The kernels' arithmetic is unchanged; the
plain torch modules (CUDA's path) agree to float32 rounding on every kind of step
(``tests/engine/test_llama_cpu.py``), and greedy output equals transformers' (the oracle tests).

The products stay torch's (oneDNN on weights packed at load; F.linear where torch cannot pack);
tensor parallelism all-reduces the row-parallel outputs as ``RowParallelLinear`` does; the
model's ``layer_hook`` (a KV connector pushing each layer out) runs after each layer as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.torch_paged import TorchAttentionMetadata, attend_prefills
from engine.cpu_kernels import CPUKernels


def _product(x: torch.Tensor, module, bias: torch.Tensor | None) -> torch.Tensor:
    """``engine.layers.linear.linear`` through ``module``'s weight (its packed copy where it has one)."""
    if module.packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, module.packed, bias, "none", [], "")
    return F.linear(x, module.weight, bias)


def _row_parallel(x: torch.Tensor, module, bias: torch.Tensor | None) -> torch.Tensor:
    """``RowParallelLinear.forward``: the partial sums meet, then the bias joins once."""
    y = module.tp.all_reduce(_product(x, module, None))
    return y + bias if bias is not None else y


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's modules and parameters, looked up once: ``nn.Module`` attribute lookups
    of submodules and parameters cost a Python call each, ~400 a step. The modules stay the
    owners (a layer's ``packed`` weight is read from its module every step)."""

    qkv: nn.Module
    qkv_bias: torch.Tensor | None
    o: nn.Module
    o_bias: torch.Tensor | None
    gate_up: nn.Module
    gate_up_bias: torch.Tensor | None
    down: nn.Module
    down_bias: torch.Tensor | None
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor

    @classmethod
    def of(cls, layer: nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(
            attn.qkv_proj,
            attn.qkv_proj.bias,
            attn.o_proj,
            attn.o_proj.bias,
            mlp.gate_up_proj,
            mlp.gate_up_proj.bias,
            mlp.down_proj,
            mlp.down_proj.bias,
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
        )


def _layers(model) -> list[_Layer]:
    if model.cpu_layers is None:
        model.cpu_layers = [_Layer.of(layer) for layer in model.layers]
    return model.cpu_layers


def _check_step(model, kv_caches: list[torch.Tensor], positions: torch.Tensor, dtype: torch.dtype) -> None:
    """What the kernels trust, checked once a step: a mistake would read or write out of bounds."""
    attn = model.layers[0].self_attn
    for kv_cache in kv_caches:
        assert kv_cache.is_contiguous() and kv_cache.dtype == dtype, "KV caches must be contiguous, model dtype"
        assert kv_cache.shape[3:] == (attn.num_kv_heads, attn.head_dim), "KV cache heads differ from the model's"
    assert kv_caches[0].shape[2] & (kv_caches[0].shape[2] - 1) == 0, "block size must be a power of two"
    assert positions.dtype == torch.int64 and positions.is_contiguous()
    if positions.numel() and int(positions.max()) >= model.rotary_emb.cos.shape[0]:
        # The kernel reads the tables by position unchecked; indexing them in torch would raise.
        raise IndexError(f"position {int(positions.max())} is past the rotary tables ({model.rotary_emb.cos.shape[0]})")


@torch.inference_mode()
def forward_layers(
    model,
    kernels: CPUKernels,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[torch.Tensor],
    meta: TorchAttentionMetadata,
) -> torch.Tensor:
    """``LlamaModel.forward`` on CPU: the final norm's output [tokens, hidden]."""
    first = model.layers[0]
    attn = first.self_attn
    dtype = model.norm.weight.dtype
    _check_step(model, kv_caches, positions, dtype)
    rms_norm, rotary = kernels.raw("rms_norm", dtype), kernels.raw("rotary", dtype)
    write_kv = kernels.raw("write_kv", dtype)
    silu_and_mul = kernels.raw("silu_and_mul", dtype)

    num_heads, num_kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    qkv_width = q_width + 2 * kv_width
    hidden_size = model.norm.weight.shape[0]
    intermediate = first.mlp.down_proj.in_per_shard
    eps = model.norm.eps
    scale, block_size = attn.scale, kv_caches[0].shape[2]
    element = torch.finfo(dtype).bits // 8

    residual = model.embed_tokens(input_ids)  # a fresh tensor: the layers add into it in place
    rows = residual.shape[0]
    # The step's activations, reused by every layer: each is read by the product that follows it
    # before the next layer writes it again.
    normed = torch.empty((rows, hidden_size), dtype=dtype)
    attn_out = torch.empty((rows, q_width), dtype=dtype)
    act = torch.empty((rows, intermediate), dtype=dtype)
    residual_ptr, normed_ptr = residual.data_ptr(), normed.data_ptr()
    attn_out_ptr, act_ptr = attn_out.data_ptr(), act.data_ptr()
    positions_ptr, slots_ptr = positions.data_ptr(), meta.slot_mapping.data_ptr()
    cos_ptr, sin_ptr = model.rotary_emb.cos.data_ptr(), model.rotary_emb.sin.data_ptr()
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.shape == (rows,)
    # Each attention kernel with the sequences it serves this step: the decodes (one query row
    # each), and every prefill chunk through the tiled kernel where the backend bound them (else SDPA).
    attention_calls = [
        (kernels.raw(op, dtype), bound.sequences)
        for op, bound in (("paged_attention", meta.decode_attention), ("prefill_attention", meta.prefill_attention))
        if bound is not None
    ]
    # The backend binds the decodes' tables only where it found the kernels too; without them
    # the decode rows of attn_out would stay unwritten.
    assert meta.num_decodes == 0 or meta.decode_attention is not None, "decode steps need the kernel's tables"
    delta: torch.Tensor | None = None  # the previous layer's MLP output, added inside the next norm

    for i, (layer, kv_cache) in enumerate(zip(_layers(model), kv_caches, strict=True)):
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        key_ptr, value_ptr = key_cache.data_ptr(), value_cache.data_ptr()

        rms_norm(
            residual_ptr, hidden_size, delta.data_ptr() if delta is not None else None, hidden_size,
            layer.input_norm.data_ptr(), normed_ptr, hidden_size, rows, hidden_size, eps,
        )  # fmt: skip
        qkv = _product(normed, layer.qkv, layer.qkv_bias)
        q_ptr = qkv.data_ptr()
        k_ptr, v_ptr = q_ptr + q_width * element, q_ptr + (q_width + kv_width) * element
        rotary(
            q_ptr, qkv_width, num_heads, k_ptr, qkv_width, num_kv_heads, cos_ptr, sin_ptr, positions_ptr, rows, head_dim
        )  # fmt: skip
        write_kv(k_ptr, qkv_width, v_ptr, qkv_width, key_ptr, value_ptr, slots_ptr, rows, kv_width)
        for attention, seqs in attention_calls:
            status = attention(
                q_ptr, qkv_width, key_ptr, value_ptr, attn_out_ptr, q_width,
                seqs.block_tables, seqs.block_table_stride, seqs.query_start, seqs.query_len,
                seqs.context_len, seqs.num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
            )  # fmt: skip
            if status != 0:
                raise MemoryError("a CPU attention kernel could not allocate its buffers")
        if meta.prefills and meta.prefill_attention is None:
            q, k, v = qkv.view(rows, -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
            attend_prefills(q, k, v, key_cache, value_cache, meta, scale, attn_out.view(rows, num_heads, head_dim))
        o = _row_parallel(attn_out, layer.o, layer.o_bias)
        rms_norm(
            residual_ptr, hidden_size, o.data_ptr(), hidden_size,
            layer.post_attention_norm.data_ptr(), normed_ptr, hidden_size, rows, hidden_size, eps,
        )  # fmt: skip
        gate_up = _product(normed, layer.gate_up, layer.gate_up_bias)
        silu_and_mul(gate_up.data_ptr(), 2 * intermediate, act_ptr, intermediate, rows, intermediate)
        delta = _row_parallel(act, layer.down, layer.down_bias)
        if model.layer_hook is not None:
            model.layer_hook(i, kv_cache)

    out = torch.empty((rows, hidden_size), dtype=dtype)
    rms_norm(
        residual_ptr, hidden_size, delta.data_ptr() if delta is not None else None, hidden_size,
        model.norm.weight.data_ptr(), out.data_ptr(), hidden_size, rows, hidden_size, eps,
    )  # fmt: skip
    return out
