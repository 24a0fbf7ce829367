"""Model shapes as data: the numbers a cost model needs (parameter count, weight and KV bytes, FLOPs per token).

Counts follow the Hugging Face configs of each model. Only matrices are counted as weights worth streaming;
norms and biases are < 0.1% of the bytes and are left out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    bytes_per_param: int
    gated_mlp: bool = True  # Llama-style gate/up/down (3 matrices); OPT has fc1/fc2 (2 matrices)
    tie_word_embeddings: bool = False  # the LM head reuses the embedding matrix
    max_position_embeddings: int = 0  # learned position embeddings (OPT); 0 for rotary models

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1 (model {self.name})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.bytes_per_param not in (1, 2, 4):
            raise ValueError(f"bytes_per_param={self.bytes_per_param} must be 1, 2 or 4 (int8, fp16/bf16, fp32)")

    @property
    def layer_params(self) -> int:
        """Matrix parameters of one decoder layer (q, k, v, o projections and the MLP)."""
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return q_and_o + k_and_v + mlp

    @property
    def embedding_params(self) -> int:
        return (self.vocab_size + self.max_position_embeddings) * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.lm_head_params
        return self.num_layers * self.layer_params + self.embedding_params + head

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param

    @property
    def streamed_weight_bytes(self) -> int:
        """Bytes every forward pass reads: all layers and the LM head (an embedding lookup reads a few rows only)."""
        return (self.num_layers * self.layer_params + self.lm_head_params) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, over all KV heads (a whole replica, not one shard)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    @property
    def matmul_flops_per_token(self) -> int:
        """Dense FLOPs of one token through every layer (2 per multiply-add); the LM head is counted apart
        because prefill computes logits for the last position of each prompt only."""
        return 2 * self.num_layers * self.layer_params

    @property
    def lm_head_flops(self) -> int:
        return 2 * self.lm_head_params

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair over all layers: QK^T and the weighted sum of V, 2 each per head dim."""
        return 4 * self.num_layers * self.num_heads * self.head_dim


MODELS: dict[str, ModelShape] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct); pdserve runs it in float32 on CPU.
    "smollm2-135m": ModelShape(
        name="smollm2-135m",
        num_layers=30,
        hidden_size=576,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        bytes_per_param=4,
        tie_word_embeddings=True,
    ),
    # facebook/opt-13b in fp16: DistServe's chatbot model. ~12.9B parameters, ~25.7 GB.
    "opt-13b": ModelShape(
        name="opt-13b",
        num_layers=40,
        hidden_size=5120,
        num_heads=40,
        num_kv_heads=40,
        head_dim=128,
        intermediate_size=20480,
        vocab_size=50272,
        bytes_per_param=2,
        gated_mlp=False,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    ),
    # meta-llama/Meta-Llama-3-8B in bf16: ~8.0B parameters, GQA with 8 KV heads.
    "llama-3-8b": ModelShape(
        name="llama-3-8b",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        bytes_per_param=2,
    ),
}


def get_model(name: str) -> ModelShape:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model shape {name!r}; known: {', '.join(MODELS)}") from None
