"""The Llama family (Llama, Mistral, Qwen2) on tensor-parallel layers.

Attribute names follow Hugging Face's, so checkpoint keys map one to one, except the fused
``qkv_proj`` (q/k/v_proj) and ``gate_up_proj`` (gate/up_proj) handled in ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.cpu_kernels import CPUKernels, kernels_for
from engine.distributed.parallel import TensorParallel
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, RotaryInputs, apply_rotary, rope_parameters
from engine.models.llama_cpu import forward_layers
from engine.weights import TensorSource


@dataclass(frozen=True)
class LlamaShape:
    """The numbers of a Llama-family config that the layers need, read once from config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool  # Llama's attention_bias covers o_proj too; Qwen2's q/k/v biases do not
    mlp_bias: bool
    rope: dict

    @classmethod
    def from_config(cls, config: dict) -> LlamaShape:
        num_heads = config["num_attention_heads"]
        model_type = config.get("model_type", "llama")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            rope=rope_parameters(config),
        )


class LlamaAttention(nn.Module):
    def __init__(self, shape: LlamaShape, tp: TensorParallel, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            shape.hidden_size, shape.head_dim, shape.num_heads, shape.num_kv_heads, shape.qkv_bias, tp, dtype
        )
        self.o_proj = RowParallelLinear(shape.num_heads * shape.head_dim, shape.hidden_size, shape.o_bias, tp, dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = shape.head_dim
        self.scale = shape.head_dim**-0.5
        self.backend = backend
        self.rotary_inplace = None  # the Triton kernel where the model runs them (use_triton_ops)

    def forward(self, hidden, kv_cache, meta: AttentionMetadata, rope: RotaryInputs):
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.rotary_inplace is not None:
            self.rotary_inplace(q, k, rope.positions, rope.cos_table, rope.sin_table)
        else:
            q, k = apply_rotary(q, k, rope)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.view(-1, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, shape: LlamaShape, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        size = shape.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(shape.hidden_size, [size, size], shape.mlp_bias, tp, dtype)
        self.down_proj = RowParallelLinear(size, shape.hidden_size, shape.mlp_bias, tp, dtype)
        self.silu_and_mul = None  # the Triton kernel where the model runs them (use_triton_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu_and_mul is not None:
            return self.down_proj(self.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """``forward(residual, delta)``: the residual stream and the previous layer's MLP output not yet
    added to it; returns the same pair. Each add happens inside the RMSNorm that follows it (one
    pass over memory in the CPU kernel), and the last one in the model's final norm."""

    def __init__(self, shape: LlamaShape, tp: TensorParallel, backend: AttentionBackend, dtype):
        super().__init__()
        self.self_attn = LlamaAttention(shape, tp, backend, dtype)
        self.mlp = LlamaMLP(shape, tp, dtype)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)

    def forward(self, residual, delta, kv_cache, meta, rope: RotaryInputs):
        attn_out = self.self_attn(self.input_layernorm(residual, delta), kv_cache, meta, rope)
        return residual, self.mlp(self.post_attention_layernorm(residual, attn_out))


class LlamaModel(nn.Module):
    """The layer stack. With the CPU kernels (``kernels``) a step runs as one flat loop over the
    layers (``engine.models.llama_cpu``), the modules only holding the weights; without them
    (CUDA, or no C compiler) through the modules' own forward passes."""

    def __init__(self, shape, tp, backend, dtype, max_positions: int, kernels: CPUKernels | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(shape.vocab_size, shape.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(shape, tp, backend, dtype) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(shape.head_dim, max_positions, shape.rope, dtype)
        self.kernels = kernels
        self.cpu_layers = None  # the layer loop's lookups of the layers' parts (engine.models.llama_cpu)
        self.layer_hook = None  # called as hook(i, kv_caches[i]) after layer i, e.g. to push its KV out

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
        if self.kernels is not None:
            return forward_layers(self, self.kernels, input_ids, positions, kv_caches, meta)
        residual = self.embed_tokens(input_ids)  # a fresh tensor: the layers add into it in place
        delta = None
        rope = self.rotary_emb.for_positions(positions)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            residual, delta = layer(residual, delta, kv_cache, meta, rope)
            if self.layer_hook is not None:
                self.layer_hook(i, kv_cache)
        return self.norm(residual, delta)


_STACKED = {  # checkpoint name part -> (fused module name part, shard id)
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def _load_whole(param: nn.Parameter, source: TensorSource, shard_id: object = None) -> None:
    param.data.copy_(source.full())


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        shape: LlamaShape,
        tp: TensorParallel,
        backend: AttentionBackend,
        dtype: torch.dtype,
        max_positions: int,
        cpu_kernels: bool = True,
    ):
        super().__init__()
        self.shape = shape
        kernels = kernels_for(tp.device) if cpu_kernels else None
        if kernels is not None and not kernels.supports(dtype):
            kernels = None
        self.model = LlamaModel(shape, tp, backend, dtype, max_positions, kernels)
        self.lm_head = ParallelLMHead(shape.vocab_size, shape.hidden_size, tp, dtype)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def use_triton_ops(self) -> None:
        """RMSNorm with its residual add, rotary in place and SiLU-and-multiply as one Triton kernel
        each (engine.layers.triton_ops): the GPU path's layers, ~20 fewer launches a layer."""
        from engine.layers import triton_ops

        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fused = triton_ops.fused_add_rms_norm
            elif isinstance(module, LlamaAttention):
                module.rotary_inplace = triton_ops.rotary_inplace
            elif isinstance(module, LlamaMLP):
                module.silu_and_mul = triton_ops.silu_and_mul

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, sources: Iterable[TensorSource]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for source in sources:
            name = source.name
            if "rotary_emb.inv_freq" in name or (self.shape.tie_word_embeddings and name == "lm_head.weight"):
                continue
            shard_id = None
            for part, (fused, sid) in _STACKED.items():
                if part in name:
                    name, shard_id = name.replace(part, fused), sid
                    break
            param = params.get(name)
            if param is None:
                raise KeyError(f"checkpoint tensor {source.name!r} has no place in {type(self).__name__}")
            loader = getattr(param, "weight_loader", _load_whole)
            loader(param, source, shard_id)
            loaded.add(name)
        expected = {n for n in params if not (self.shape.tie_word_embeddings and n == "lm_head.weight")}
        missing = expected - loaded
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
