"""Reading checkpoint tensors one shard at a time.

A ``TensorSource`` is a lazy view of one checkpoint tensor: a TP layer asks for the slice it
owns, and only those bytes are read (safetensors slices are memory-mapped), so no rank ever
materializes the whole model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


class TensorSource:
    def __init__(self, name: str, slice_or_tensor) -> None:
        self.name = name
        self._src = slice_or_tensor

    @property
    def shape(self) -> list[int]:
        src = self._src
        return list(src.shape) if isinstance(src, torch.Tensor) else list(src.get_shape())

    def narrow(self, dim: int, start: int, size: int) -> torch.Tensor:
        assert start + size <= self.shape[dim], (
            f"{self.name}: shard [{start}, {start + size}) exceeds dim {dim} of size {self.shape[dim]}"
        )
        index = tuple([slice(None)] * dim + [slice(start, start + size)])
        return self._src[index]

    def full(self) -> torch.Tensor:
        return self._src[:] if not isinstance(self._src, torch.Tensor) else self._src


def iter_safetensors(model_dir: Path) -> Iterator[TensorSource]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open objects are not iterable
                yield TensorSource(name, f.get_slice(name))


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())
