"""Attention over the paged KV cache, behind a backend interface (see ``backend.py``)."""

from engine.attention.backend import AttentionBackend, AttentionMetadata, StepTensors, get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "StepTensors", "get_backend"]
