"""Finding and converting model files, without network."""

from __future__ import annotations

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
