"""Helpers shared by the policy-library tests (config, scoring, budget, policies).

Random inputs are small and seeded; attention is made peaky (queries scaled up) so that scores
differ enough for rankings to be meaningful.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies import SegmentSpec
from sgl_kvevict.scoring import StatsRequest, WindowStats, window_stats
from sgl_kvevict.scoring.learned import LearnedWeights

HEAD_DIM = 8
HIDDEN_SIZE = 12  # d_model of the random attention inputs learned scorers read
SCALING = HEAD_DIM**-0.5
ALL_STATS = StatsRequest(attn_sum=True, tail_rows=3, obc_value=True, obc_key=True, obc_joint=True, value_l1=True)


def random_window_inputs(
    num_q_heads: int, num_kv_heads: int, context: int, window: int, seed: int, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_window ``[H_q, w, D]``, keys ``[H_kv, L, D]``, values ``[H_kv, L, D]``)."""
    generator = torch.Generator().manual_seed(seed)
    q_window = 2.5 * torch.randn(num_q_heads, window, HEAD_DIM, generator=generator, dtype=dtype)
    keys = torch.randn(num_kv_heads, context, HEAD_DIM, generator=generator, dtype=dtype)
    values = torch.randn(num_kv_heads, context, HEAD_DIM, generator=generator, dtype=dtype)
    return q_window, keys, values


def random_stats(spec: SegmentSpec, window: int, request: StatsRequest, seed: int) -> list[WindowStats]:
    """One ``WindowStats`` per layer of ``spec`` (context = ``spec.end``), from random q/k/v, plus
    random attention inputs of positions ``[0, end)`` when the request reads hidden states."""
    stats = []
    for layer in range(spec.num_layers):
        q_window, keys, values = random_window_inputs(
            spec.num_q_heads, spec.num_kv_heads, spec.end, window, seed=seed * 1000 + layer
        )
        layer_stats = window_stats(q_window, keys, values, SCALING, request)
        if request.hidden_states:
            hidden = torch.randn(spec.end, HIDDEN_SIZE, generator=torch.Generator().manual_seed(seed * 1000 + layer))
            layer_stats = dataclasses.replace(layer_stats, hidden_states=hidden, hidden_start=0)
        stats.append(layer_stats)
    return stats


def learned_weights_file(directory: Path, num_layers: int, num_kv_heads: int, seed: int = 0) -> Path:
    """Random learned-scorer weights for a model of that shape, saved with a manifest."""
    generator = torch.Generator().manual_seed(seed)
    weights = LearnedWeights(
        torch.randn(num_layers, num_kv_heads, HIDDEN_SIZE, generator=generator),
        torch.randn(num_layers, num_kv_heads, generator=generator),
        {"fingerprint": "random test weights"},
    )
    path = directory / f"learned-{num_layers}x{num_kv_heads}-{seed}.safetensors"
    weights.save(path)
    return path


def kvzap_folder(
    directory: Path, num_layers: int, input_dim: int, output_dim: int, hidden_dim: Optional[int],
    dtype: torch.dtype = torch.float32, seed: int = 0, prefix: str = "module_list",
) -> tuple[Path, dict[str, torch.Tensor]]:
    """A random KVzap scorer in the layout kvpress saves (``KVzapModel.save_pretrained``; hub
    nvidia/KVzap-linear-<model>, nvidia/KVzap-mlp-<model>): config.json with model_type "kvzap" and
    ``module_list.<layer>`` parameters (``prefix`` "layers": later public copies' name), ``.weight``/``.bias``
    of one Linear, or ``.0.*``/``.2.*`` of Linear-GELU-Linear. Returns the folder and its tensors by name."""
    generator = torch.Generator().manual_seed(seed)
    linears = [("", input_dim, output_dim)] if hidden_dim is None else [(".0", input_dim, hidden_dim), (".2", hidden_dim, output_dim)]
    tensors = {}
    for layer in range(num_layers):
        for index, fan_in, fan_out in linears:
            tensors[f"{prefix}.{layer}{index}.weight"] = torch.randn(fan_out, fan_in, generator=generator).to(dtype)
            tensors[f"{prefix}.{layer}{index}.bias"] = torch.randn(fan_out, generator=generator).to(dtype)
    folder = directory / f"KVzap-{'linear' if hidden_dim is None else 'mlp'}-{seed}"
    folder.mkdir(parents=True)
    config = {"architectures": ["KVzapModel"], "model_type": "kvzap", "input_dim": input_dim, "output_dim": output_dim,
              "hidden_dim": hidden_dim, "n_modules": num_layers, "dtype": str(dtype).removeprefix("torch."),
              "transformers_version": "4.57.1"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, tensors


def tiny_training(model_dir: Path, out: Path, **options):
    """The learned scorer's training on a tiny model: 24 short documents, 4 held out (about a second)."""
    from sgl_kvevict.reference.train_scorer import TrainingConfig

    return TrainingConfig(model=str(model_dir), out=out, document_tokens=48, max_documents=24, test_documents=4,
                          **options)  # fmt: skip


def policy_config(policy: str, spec: SegmentSpec, weights_dir: Path, **options) -> EvictionConfig:
    """``EvictionConfig.for_policy``, with random learned weights of ``spec``'s shape for score learned."""
    if options.get("score") == "learned":
        options["learned_weights"] = str(learned_weights_file(weights_dir, spec.num_layers, spec.num_kv_heads))
    return EvictionConfig.for_policy(policy, **options)


def run_policy(config: EvictionConfig, spec: SegmentSpec, seed: int = 0) -> CompressionPlan:
    """Compress a random segment with ``config`` the way an engine does: observe every layer, then plan."""
    policy = build_policy(config)
    compressor = policy.start(spec)
    if compressor.needs_stats:
        window = min(config.window, spec.length)
        for layer, stats in enumerate(random_stats(spec, window, policy.stats_request(), seed)):
            compressor.observe(layer, stats)
    return compressor.plan()
