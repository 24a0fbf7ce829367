"""Finding and converting model files, without network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common.errors import ConfigError
from engine import model_loader


def test_gguf_is_converted_once_and_cached(tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF-placeholder")
    calls = []

    def fake_convert(src, out_dir):  # the real conversion runs in the default-model fixture
        calls.append(src)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(model_loader, "convert_gguf", fake_convert)
    first = model_loader.resolve_model_dir(str(gguf), cache_dir=str(tmp_path / "cache"))
    second = model_loader.resolve_model_dir(str(gguf), cache_dir=str(tmp_path / "cache"))
    assert first == second and (first / "config.json").exists() and len(calls) == 1
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".tiny") and p.is_dir()]  # no temp dirs left


def test_failed_conversion_leaves_nothing_half_written(tmp_path, monkeypatch):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"x")

    def failing_convert(src, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_loader, "convert_gguf", failing_convert)
    with pytest.raises(RuntimeError, match="disk full"):
        model_loader.resolve_model_dir(str(gguf), cache_dir=str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="neither a Hugging Face directory"):
        model_loader.resolve_model_dir(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        model_loader.resolve_model_dir(str(tmp_path))


def test_default_model_dir_has_weights_and_tokenizer(smol_dir):
    assert (smol_dir / "config.json").exists() and (smol_dir / "model.safetensors").exists()
    assert (smol_dir / "tokenizer.json").exists()


def _hub_cache(cache: Path, repo_id: str, model_dir: Path, commit: str = "0" * 40, ref: str = "main") -> Path:
    """``model_dir``'s files as huggingface_hub caches a download of ``repo_id``:
    models--org--name/snapshots/<commit>/... and refs/<ref> naming the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_id_resolves_to_its_cached_snapshot_offline_and_the_engine_serves_it(offline_hub, tiny_dir):
    from engine import LLM, SamplingParams

    snapshot = _hub_cache(offline_hub, "tiny-org/tiny-llama", tiny_dir)
    assert model_loader.resolve_model_dir("tiny-org/tiny-llama") == snapshot
    with LLM("tiny-org/tiny-llama", dtype="float32", kv_cache_memory=16 * 2**20) as llm:
        assert llm.engine.model_dir == snapshot
        out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    with LLM(str(tiny_dir), dtype="float32", kv_cache_memory=16 * 2**20) as local:
        expected = local.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    assert out[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_a_revision_picks_its_snapshot(offline_hub, tiny_dir):
    main = _hub_cache(offline_hub, "tiny-org/tiny-llama", tiny_dir)
    other = _hub_cache(offline_hub, "tiny-org/tiny-llama", tiny_dir, commit="1" * 40, ref="v2")
    assert model_loader.resolve_model_dir("tiny-org/tiny-llama", revision="v2") == other
    assert model_loader.resolve_model_dir("tiny-org/tiny-llama", revision="0" * 40) == main
    with pytest.raises(ConfigError, match="at revision 'v3'"):
        model_loader.resolve_model_dir("tiny-org/tiny-llama", revision="v3")


def test_a_hub_id_missing_offline_names_the_id_and_the_cache(offline_hub):
    with pytest.raises(ConfigError) as error:
        model_loader.resolve_model_dir("nobody/no-such-model")
    message = str(error.value)
    assert "'nobody/no-such-model'" in message and "HF_HUB_OFFLINE=1" in message and str(offline_hub) in message


def test_only_safetensors_and_only_the_index_shards_are_asked_for(tmp_path, monkeypatch):
    """What the download asks the Hub for: metadata first, then the shards the index names (not
    a second layout of the same weights, nor pickles); top-level files only."""
    calls = []

    def fake_download(repo_id, *, allow_patterns, ignore_patterns, **kwargs):
        calls.append((allow_patterns, ignore_patterns))
        snapshot = tmp_path / "snap"
        snapshot.mkdir(exist_ok=True)
        (snapshot / "config.json").write_text("{}")
        weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
        (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (snapshot / "model-00001-of-00002.safetensors").write_bytes(b"")
        return str(snapshot)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_download)
    model_loader.resolve_model_dir("org/sharded")
    (metadata, ignored), (weights, _) = calls
    assert "*.json" in metadata and not any("bin" in p or "safetensors" in p for p in metadata)
    assert weights == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert ignored == ["*/*"]


def test_pickled_weights_and_quantized_checkpoints_are_refused_by_name(tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (pickled / "pytorch_model.bin").write_bytes(b"\x80")
    with pytest.raises(ConfigError, match=r"no \*\.safetensors weights \(it has pytorch_model\.bin"):
        model_loader.resolve_model_dir(str(pickled))
    quantized = tmp_path / "awq"
    quantized.mkdir()
    (quantized / "model.safetensors").write_bytes(b"")
    (quantized / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}}))
    with pytest.raises(ConfigError, match=r"is quantized \(awq"):
        model_loader.resolve_model_dir(str(quantized))


def test_what_names_a_hub_id(tmp_path):
    from common.model_source import is_hub_id

    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("org/name.v1")
    (tmp_path / "org").mkdir()
    assert not is_hub_id(str(tmp_path / "org"))
    assert not any(is_hub_id(m) for m in ("./org/name", "/abs/name", "a/b/c", "name", "org/x.gguf", "org/../x"))
