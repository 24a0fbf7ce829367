"""Model registry: Hugging Face architecture name -> our implementation."""

from __future__ import annotations

from common.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def resolve_architecture(config: dict, model_name: str) -> str:
    architectures = config.get("architectures") or []
    for arch in architectures:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise UnsupportedModelError(
        f"model {model_name!r} has architecture {architectures or '(none)'}; "
        f"pdserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def allowed_tp_degrees(num_heads: int, num_kv_heads: int, max_degree: int = 64) -> list[int]:
    """TP degrees that split query heads evenly and either split or replicate KV heads evenly."""
    return [
        d for d in range(1, max_degree + 1) if num_heads % d == 0 and (num_kv_heads % d == 0 or d % num_kv_heads == 0)
    ]


def check_tp_degree(model_name: str, num_heads: int, num_kv_heads: int, tp: int) -> None:
    allowed = allowed_tp_degrees(num_heads, num_kv_heads)
    if tp not in allowed:
        raise UnsupportedModelError(
            f"tensor_parallel_size={tp} does not divide model {model_name!r} "
            f"({num_heads} query heads, {num_kv_heads} KV heads); allowed degrees: {allowed}"
        )
