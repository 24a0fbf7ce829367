"""The hook through which KV leaves or enters a model instance, hosted on every shard.

vLLM's KV-connector split: the driver decides (which windows to push or tickets to expect this
step: a ``ConnectorStep`` riding on the step message); each shard's connector moves bytes around
its own forward pass and answers with a ``ShardReport`` (common.kv_messages). The engine never
imports an implementation: it loads one by ``"module:factory"`` name, so a transfer library plugs
in without the engine depending on it.

Per step, on every shard:

    start_step(step)                   before the forward pass (register pushes / expected tickets)
    after_layer(i, kv[i])              after layer i wrote its KV (a sender pushes layer i now)
    end_step(sampled) -> ShardReport   after the forward; ``sampled`` (request id -> first token) on
                                       the driver, None elsewhere; the driver merges every shard's
"""

from __future__ import annotations

import hashlib
import importlib
from typing import Any, Protocol

import torch

from common.kv_layout import KVCacheLayout
from common.kv_messages import ConnectorStep, ShardReport


class KVConnector(Protocol):
    endpoint: str | None  # where this shard receives KV (None for a send-only connector)

    def start_step(self, step: ConnectorStep) -> None: ...

    def after_layer(self, layer: int, kv_layer: torch.Tensor) -> None: ...

    def end_step(self, sampled: dict[str, int] | None) -> ShardReport: ...

    def close(self) -> None: ...


def load_connector(
    spec: str, options: dict[str, Any], layout: KVCacheLayout, kv_caches: list[torch.Tensor], model_id: str
) -> KVConnector:
    """Build the connector named ``"package.module:factory"`` for one shard."""
    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory(layout=layout, kv_caches=kv_caches, model_id=model_id, **options)


def model_fingerprint(config_json: bytes) -> str:
    """What both ends of a KV transfer compare to know they run the same model."""
    return hashlib.sha256(config_json).hexdigest()[:16]
