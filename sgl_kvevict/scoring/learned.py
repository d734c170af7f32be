"""Learned scores (KVzap / Fast KVzip style): a per-layer linear map from the attention-input hidden
states to the log of the KVzip score, available during the prefill itself at almost no cost.

``s_l[g, p] = W_l[g] . x_l[p] + b_l[g]`` with ``x_l[p]`` the input of layer ``l``'s attention at
position ``p`` (after the input layernorm, ``WindowStats.hidden_states``) and ``g`` a KV head; it
predicts ``log max_i max_{h in g} A[h, i, p]`` over KVzip's reconstruction queries (``scoring.kvzip``).
The weights are fitted offline by ridge regression (``python -m sgl_kvevict.reference.train_scorer``)
and stored as a safetensors file (``weight [L, H_kv, d_model]``, ``bias [L, H_kv]``, fp32) with a
JSON manifest beside it (same name, ``.json``): the model's fingerprint and shape, the corpus, the
fit metrics and the command that made them. A KVzap checkpoint folder as NVIDIA publishes it
(``scoring.kvzap_checkpoint``: linear, or an MLP with one GELU hidden layer) serves as the weights too:
the same map from the same attention inputs.

Contract with the engines (``StatsRequest(hidden_states=True)``): during the forward that prefills
the segment, per layer, the engine takes the input of that layer's attention (after the input
layernorm, before the q/k/v projections) at the segment's positions and calls
``compressor.observe(layer, WindowStats(window=w, hidden_states=[n, d_model], hidden_start=start))``
(``w``: the segment's window, unused here; no other statistic, no extra pass). An engine that prefills
the segment in several forwards (chunked prefill) calls it once per forward with that forward's rows,
in order (``RowScorer``). The scores are computed in fp32 whatever the model's dtype.

Which weights: the score's own knob ``learned_weights`` (``LearnedKnobs``), or else the weights
bundled in ``scoring/weights/`` whose manifest has the served model's fingerprint
(``model_fingerprint``). ``resolve_learned_weights(knobs, model_dir)`` finds and checks them before the model loads (the
launcher's call: one ``ConfigError`` line for a model without weights or weights that do not fit);
engines bind the scorer to their model with ``policy.for_model(model_dir)``.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sgl_kvevict.settings import CommonSettings, ConfigError, Settings, setting
from sgl_kvevict.scoring.base import Reduction, RowScorer
from sgl_kvevict.scoring.kvzap_checkpoint import KVZAP_MODEL_TYPE, KVZAP_WEIGHTS_FILE, read_kvzap_checkpoint
from sgl_kvevict.scoring.window import StatsRequest, WindowStats

LEARNED_SCORE = "learned"
BUNDLED_WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
TRAIN_COMMAND = "python -m sgl_kvevict.reference.train_scorer"
# The config.json fields that fix a model's architecture and shapes; with samples of its weight
# files they identify the model (``model_fingerprint``).
FINGERPRINT_FIELDS = (
    "architectures",
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)
# Bytes hashed from the start and the end of each weight file: the safetensors header (tensor names,
# dtypes, shapes) and tensor data from both ends, enough to tell two checkpoints of one
# architecture apart without reading gigabytes.
_SAMPLED_BYTES = 1 << 20


# --------------------------------------------------------------------------------------------------
# The model side: shape and fingerprint of a HF model folder
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What a learned scorer's weights must match."""

    num_layers: int
    hidden_size: int
    num_kv_heads: int

    @classmethod
    def of(cls, model_dir: Path) -> "ModelShape":
        config = _model_config(Path(model_dir))
        return cls(
            config["num_hidden_layers"],
            config["hidden_size"],
            config.get("num_key_value_heads") or config["num_attention_heads"],
        )

    def __str__(self) -> str:
        return f"{self.num_layers} layers, hidden size {self.hidden_size}, {self.num_kv_heads} KV heads"


def _model_config(model_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read {model_dir / 'config.json'}: {error}") from None


@functools.lru_cache(maxsize=16)
def model_fingerprint(model_dir: Path) -> str:
    """sha256 (hex) of a model folder's architecture fields and samples of its safetensors files."""
    model_dir = Path(model_dir)
    config = _model_config(model_dir)
    digest = hashlib.sha256(json.dumps({k: config.get(k) for k in FINGERPRINT_FIELDS}, sort_keys=True).encode())
    for weights_file in sorted(model_dir.glob("*.safetensors")):
        size = weights_file.stat().st_size
        digest.update(f"{weights_file.name}:{size}".encode())
        with open(weights_file, "rb") as f:
            digest.update(f.read(_SAMPLED_BYTES))
            f.seek(max(size - _SAMPLED_BYTES, 0))
            digest.update(f.read(_SAMPLED_BYTES))
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LearnedWeights:
    """A per-layer regressor from a layer's attention inputs ``x`` to one score per KV head: linear,
    ``weight[l] x + bias[l]``, or with one hidden layer (KVzap's MLP),
    ``weight[l] gelu(hidden_weight[l] x + hidden_bias[l]) + bias[l]``.

    weight: fp32 ``[L, H_kv, d_in]`` (``d_in``: d_model, or the hidden width); bias: fp32 ``[L, H_kv]``;
    hidden_weight: fp32 ``[L, hidden, d_model]`` and hidden_bias ``[L, hidden]``, or None (linear);
    manifest: what made them (the JSON beside our files; a KVzap folder's config)."""

    weight: torch.Tensor
    bias: torch.Tensor
    manifest: dict[str, Any]
    hidden_weight: Optional[torch.Tensor] = None
    hidden_bias: Optional[torch.Tensor] = None
    # Per-device copies, made once per device an engine scores on (the policy is shared).
    _on_device: dict[torch.device, tuple[Optional[torch.Tensor], ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def shape(self) -> ModelShape:
        num_layers, num_kv_heads, _ = self.weight.shape
        first = self.weight if self.hidden_weight is None else self.hidden_weight
        return ModelShape(num_layers, first.shape[2], num_kv_heads)

    def for_heads(self, rows: torch.Tensor, real: torch.Tensor) -> "LearnedWeights":
        """The output rows ``rows`` only, each scaled by ``real`` (0: a padded head); the hidden layer
        is shared by every head."""
        return LearnedWeights(
            self.weight[:, rows] * real[:, None], self.bias[:, rows] * real, self.manifest, self.hidden_weight,
            self.hidden_bias,
        )

    def for_layers(self, layers: tuple[int, ...]) -> "LearnedWeights":
        """The maps of ``layers`` only, in that order."""
        rows = list(layers)
        hidden = (None, None) if self.hidden_weight is None else (self.hidden_weight[rows], self.hidden_bias[rows])
        return LearnedWeights(self.weight[rows], self.bias[rows], self.manifest, *hidden)

    def scores(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 ``[H_kv, n]`` for the attention inputs ``hidden [n, d_model]`` of ``layer``, on their device."""
        if hidden.device not in self._on_device:
            self._on_device[hidden.device] = tuple(
                None if tensor is None else tensor.to(hidden.device)
                for tensor in (self.weight, self.bias, self.hidden_weight, self.hidden_bias)
            )
        weight, bias, hidden_weight, hidden_bias = self._on_device[hidden.device]
        x = hidden.float()
        if hidden_weight is not None:
            x = torch.nn.functional.gelu(torch.addmm(hidden_bias[layer], x, hidden_weight[layer].t()))
        return torch.addmm(bias[layer], x, weight[layer].t()).t()

    def check_fits(self, model: ModelShape, model_dir: Path, source: Path) -> None:
        if self.shape != model:
            raise ConfigError(
                f"learned weights {source} are for a model with {self.shape}, but {model_dir} has {model}; "
                f"{ways_to_get_weights(model_dir)}"
            )

    def save(self, path: Path) -> None:
        """Write linear weights (what ``train_scorer`` fits) to ``path`` (safetensors) and their manifest
        ``path.with_suffix('.json')``."""
        if self.hidden_weight is not None:
            raise ValueError("our weights file holds a linear map; a KVzap MLP stays in its own folder")
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"weight": self.weight.contiguous(), "bias": self.bias.contiguous()}, str(path))
        manifest_path(path).write_text(json.dumps(self.manifest, indent=1) + "\n")

    @classmethod
    def load(cls, path: Union[str, Path]) -> "LearnedWeights":
        """Our safetensors file (with its manifest beside it) or a KVzap checkpoint folder."""
        path = Path(path).resolve()
        try:
            return _load(path, path.stat().st_mtime_ns)
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as error:  # TypeError: a malformed config.json
            raise ConfigError(
                f"learned weights {path} cannot be read ({error}); expected a safetensors file with 'weight' "
                "[layers, KV heads, hidden size] and 'bias' [layers, KV heads] and its manifest beside it (.json), "
                f"or a KVzap checkpoint folder (config.json with model_type {KVZAP_MODEL_TYPE!r}, {KVZAP_WEIGHTS_FILE})"
            ) from None


def manifest_path(weights_path: Path) -> Path:
    return weights_path.with_suffix(".json")


@functools.lru_cache(maxsize=8)
def _load(path: Path, mtime_ns: int) -> LearnedWeights:
    if path.is_dir():
        checkpoint = read_kvzap_checkpoint(path)
        manifest = {"format": "kvzap", "source": str(path), "config": checkpoint.config}
        return LearnedWeights(checkpoint.weight, checkpoint.bias, manifest, checkpoint.hidden_weight,
                              checkpoint.hidden_bias)  # fmt: skip
    tensors = load_file(str(path))
    manifest = json.loads(manifest_path(path).read_text())
    weight, bias = tensors["weight"].float(), tensors["bias"].float()
    if weight.dim() != 3 or bias.shape != weight.shape[:2]:
        raise ValueError(f"weight {tuple(weight.shape)} and bias {tuple(bias.shape)} do not match")
    return LearnedWeights(weight, bias, manifest)


def ways_to_get_weights(model_dir: Path) -> str:
    """The two ways to get learned weights for the model in ``model_dir``, for an error line."""
    return (
        f"train them with `{TRAIN_COMMAND} --model {model_dir} --out DIR` and pass --kv-evict-learned-weights "
        "DIR/<name>.safetensors, or pass the folder of a KVzap scorer published for this model "
        "(nvidia/KVzap-mlp-<model> or nvidia/KVzap-linear-<model>, downloaded) as --kv-evict-learned-weights FOLDER"
    )


def bundled_weights_for(model_dir: Path) -> Path:
    """The bundled weights whose manifest carries ``model_dir``'s fingerprint."""
    fingerprint = model_fingerprint(Path(model_dir))
    for manifest_file in sorted(BUNDLED_WEIGHTS_DIR.glob("*.json")):
        if json.loads(manifest_file.read_text()).get("fingerprint") == fingerprint:
            return manifest_file.with_suffix(".safetensors")
    raise ConfigError(
        f"score 'learned' has no bundled weights for the model in {model_dir} (fingerprint {fingerprint[:12]}); "
        f"{ways_to_get_weights(model_dir)}"
    )


def learned_weights_for(model_dir: Path, explicit: Optional[Union[str, Path]]) -> tuple[Path, LearnedWeights]:
    """The weights a learned scorer uses on the model in ``model_dir``: ``explicit`` if given, else the
    bundled ones found by fingerprint; checked against the model's shape (``ConfigError`` otherwise)."""
    model_dir = Path(model_dir)
    path = Path(explicit) if explicit is not None else bundled_weights_for(model_dir)
    weights = LearnedWeights.load(path)
    weights.check_fits(ModelShape.of(model_dir), model_dir, path)
    return path, weights


def resolve_learned_weights(score_knobs: Settings, model_dir: Path) -> Optional[Path]:
    """For the launcher, before the model loads: the weights file the learned score will use on the
    model in ``model_dir`` (pass it on as ``learned_weights``), or ``None`` when ``score_knobs`` are
    another score's (the score is not learned). Raises ``ConfigError`` (one line) when there are none
    or they do not fit the model."""
    if not isinstance(score_knobs, LearnedKnobs):
        return None
    return learned_weights_for(model_dir, score_knobs.learned_weights)[0]


# --------------------------------------------------------------------------------------------------
# The scorer
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LearnedKnobs(Settings):
    """The learned score's own knob."""

    learned_weights: Optional[str] = setting(
        None,
        help="the learned score's regressor weights: a .safetensors file with its .json manifest beside it (what "
        "train_scorer writes), or a KVzap checkpoint folder as NVIDIA publishes it (nvidia/KVzap-mlp-<model>, "
        "nvidia/KVzap-linear-<model>); unset: the weights bundled for the served model, found by its fingerprint",
        valid=(lambda path: path is None or Path(path).exists(), "learned weights {value!r} does not exist"),
    )


class LearnedScorer(RowScorer):
    """Predicted log KVzip scores of the candidates, per KV head, then the common pooling (no GQA
    step: the map predicts per KV head). Unbound (``weights`` None) until ``for_model``."""

    request = StatsRequest(hidden_states=True)
    log_scores: ClassVar[bool] = True
    knobs_type = LearnedKnobs

    def __init__(self, reduction: Reduction, weights: Optional[LearnedWeights] = None, source: Optional[Path] = None):
        super().__init__(reduction)
        self.weights = weights
        self.source = source

    @classmethod
    def of(cls, common: CommonSettings, knobs: LearnedKnobs, reduction: Reduction) -> "LearnedScorer":
        if knobs.learned_weights is None:
            return cls(reduction)
        source = Path(knobs.learned_weights)
        return cls(reduction, LearnedWeights.load(source), source)

    def for_model(self, model_dir: Path) -> "LearnedScorer":
        path, weights = learned_weights_for(model_dir, self.source)
        return self if weights is self.weights else LearnedScorer(self.reduction, weights, path)

    def for_heads(self, heads: tuple[int, ...]) -> "LearnedScorer":
        """The map of ``heads`` only (a padded head, -1, gets zero weights: its scores are never used)."""
        rows = torch.tensor([max(head, 0) for head in heads])
        real = torch.tensor([head >= 0 for head in heads], dtype=self.weights.weight.dtype)
        return LearnedScorer(self.reduction, self.weights.for_heads(rows, real), self.source)

    def for_layers(self, layers: tuple[int, ...]) -> "LearnedScorer":
        """The maps of ``layers`` only (unbound: nothing to select until ``for_model``)."""
        return self if self.weights is None else LearnedScorer(self.reduction, self.weights.for_layers(layers), self.source)

    def row_scores(self, stats: WindowStats, rows: slice, layer: int) -> torch.Tensor:
        if self.weights is None:
            raise RuntimeError("the learned scorer has no weights: engines bind it with policy.for_model(model_dir)")
        hidden = stats.hidden_states[rows.start - stats.hidden_start : rows.stop - stats.hidden_start]
        return self.weights.scores(layer, hidden).contiguous()  # [H_kv, n]
