"""KVzap scorer checkpoints as NVIDIA publishes them, read into the learned score's tensors.

kvpress (``kvpress/presses/kvzap/kvzap_press.py``, ``KVzapModel``) saves its scorers as transformers
PreTrainedModel folders, published as ``nvidia/KVzap-linear-<model>`` and ``nvidia/KVzap-mlp-<model>``:

* ``config.json``: ``model_type: "kvzap"``, ``input_dim`` (the served model's hidden size),
  ``output_dim`` (its KV heads), ``hidden_dim`` (null: one ``nn.Linear`` per layer; else
  ``nn.Sequential(Linear(input_dim, hidden_dim), GELU(), Linear(hidden_dim, output_dim))``) and
  ``n_modules`` (its layers);
* ``model.safetensors``: ``module_list.<layer>.weight`` and ``.bias`` (linear), or
  ``module_list.<layer>.0.*`` and ``module_list.<layer>.2.*`` (the MLP's two Linear layers; index 1 is
  the parameterless GELU). kvpress's stored code names the modules ``module_list``; later public copies
  name them ``layers`` (``layers.<layer>.weight`` ...): both are read (``KVZAP_MODULE_PREFIXES``).

kvpress applies module ``layer`` to the input of that layer's attention (its forward hook reads the
attention module's ``hidden_states``, after the input layernorm) and takes one score per KV head: the
learned score's contract (``scoring.learned``). KVzap's target is log KVzip+ (KVzip's attention
weighted by each value's output norm), the bundled weights' is log KVzip; both rank entries.

Read with json and safetensors only: no transformers, no kvpress.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file

KVZAP_MODEL_TYPE = "kvzap"
KVZAP_WEIGHTS_FILE = "model.safetensors"
# What the per-layer modules are called in the weights file: kvpress's KVzapModel, later public copies.
KVZAP_MODULE_PREFIXES = ("module_list", "layers")


@dataclass(frozen=True)
class KVzapCheckpoint:
    """fp32, stacked over layers: weight ``[L, H_kv, d_in]``, bias ``[L, H_kv]``; for an MLP also
    hidden_weight ``[L, hidden_dim, d_model]`` and hidden_bias ``[L, hidden_dim]`` (``d_in`` is then
    ``hidden_dim``, else ``d_model``). config: the folder's config.json."""

    weight: torch.Tensor
    bias: torch.Tensor
    hidden_weight: Optional[torch.Tensor]
    hidden_bias: Optional[torch.Tensor]
    config: dict[str, Any]


def module_prefix(tensors: dict[str, torch.Tensor]) -> str:
    """The name the weights file gives the per-layer modules (one of ``KVZAP_MODULE_PREFIXES``)."""
    found = sorted({name.split(".", 1)[0] for name in tensors} & set(KVZAP_MODULE_PREFIXES))
    if len(found) != 1:
        named = " or ".join(f"{p}.<layer>.*" for p in KVZAP_MODULE_PREFIXES)
        raise ValueError(f"{KVZAP_WEIGHTS_FILE} names its modules {found or 'otherwise'}: expected {named}")
    return found[0]


def read_kvzap_checkpoint(folder: Path) -> KVzapCheckpoint:
    """The checkpoint in ``folder``; ``ValueError`` (one line) when it is not one in the layout above."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != KVZAP_MODEL_TYPE:
        raise ValueError(f"its config.json has model_type {config.get('model_type')!r}, not {KVZAP_MODEL_TYPE!r}")
    tensors = load_file(str(folder / KVZAP_WEIGHTS_FILE))
    layers = range(int(config["n_modules"]))
    prefix = module_prefix(tensors)

    def stacked(suffix: str, rows: int, columns: Optional[int] = None) -> torch.Tensor:
        expected = (rows,) if columns is None else (rows, columns)
        missing = [f"{prefix}.{layer}{suffix}" for layer in layers if f"{prefix}.{layer}{suffix}" not in tensors]
        if missing:
            raise ValueError(f"{KVZAP_WEIGHTS_FILE} has no tensor {missing[0]}")
        per_layer = [tensors[f"{prefix}.{layer}{suffix}"].float() for layer in layers]
        for layer, tensor in zip(layers, per_layer):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{prefix}.{layer}{suffix} is {tuple(tensor.shape)}, config.json says {expected}")
        return torch.stack(per_layer)

    input_dim, output_dim, hidden_dim = config["input_dim"], config["output_dim"], config.get("hidden_dim")
    if hidden_dim is None:
        return KVzapCheckpoint(
            stacked(".weight", output_dim, input_dim), stacked(".bias", output_dim), None, None, config
        )
    return KVzapCheckpoint(
        stacked(".2.weight", output_dim, hidden_dim),
        stacked(".2.bias", output_dim),
        stacked(".0.weight", hidden_dim, input_dim),
        stacked(".0.bias", hidden_dim),
        config,
    )
