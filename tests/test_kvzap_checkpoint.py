"""KVzap scorer folders as NVIDIA publishes them load as learned weights and score as kvpress computes:
``KVzapModel.module_list[layer]`` (Linear, or Linear-GELU-Linear) applied to the layer's attention
inputs, one score per KV head. The formula below is written from kvpress's module definition, in
float64, independently of the scorer."""

from __future__ import annotations

import math

import pytest
import torch

from conftest_policies import kvzap_folder
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.policies import SegmentSpec
from sgl_kvevict.scoring import Reduction
from sgl_kvevict.scoring.learned import LearnedScorer, LearnedWeights, ModelShape, resolve_learned_weights
from sgl_kvevict.scoring.window import WindowStats
from sgl_kvevict.settings import ConfigError

LAYERS, INPUT_DIM, KV_HEADS = 3, 24, 4


def kvpress_scores(
    tensors: dict[str, torch.Tensor], layer: int, hidden: torch.Tensor, mlp: bool, prefix: str = "module_list"
) -> torch.Tensor:
    """``[H_kv, n]``: kvpress's ``module(hidden_states).transpose(1, 2)`` for one sequence, in float64."""
    x = hidden.double()
    parameter = lambda name: tensors[f"{prefix}.{layer}{name}"].double()  # noqa: E731
    if not mlp:
        return (x @ parameter(".weight").t() + parameter(".bias")).t()
    z = x @ parameter(".0.weight").t() + parameter(".0.bias")
    gelu = 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))  # nn.GELU(): the exact, erf form
    return (gelu @ parameter(".2.weight").t() + parameter(".2.bias")).t()


# kvpress's stored code names the per-layer modules module_list; later public copies name them layers.
@pytest.mark.parametrize("prefix", ["module_list", "layers"])
@pytest.mark.parametrize("hidden_dim, dtype", [(None, torch.float32), (16, torch.float32), (16, torch.bfloat16)])
def test_a_kvzap_folder_scores_as_kvpress_computes(tmp_path, hidden_dim, dtype, prefix):
    folder, tensors = kvzap_folder(tmp_path, LAYERS, INPUT_DIM, KV_HEADS, hidden_dim, dtype, prefix=prefix)
    weights = LearnedWeights.load(folder)
    assert weights.shape == ModelShape(num_layers=LAYERS, hidden_size=INPUT_DIM, num_kv_heads=KV_HEADS)
    assert weights.manifest["format"] == "kvzap" and weights.manifest["config"]["hidden_dim"] == hidden_dim
    hidden = torch.randn(40, INPUT_DIM, generator=torch.Generator().manual_seed(1))
    stats = WindowStats(window=1, hidden_states=hidden, hidden_start=10)  # positions 10..49
    scorer = LearnedScorer(Reduction(pooling="none"), weights)
    for layer in range(LAYERS):
        scores = scorer(stats, slice(14, 50), num_kv_heads=KV_HEADS, layer=layer)
        expected = kvpress_scores(tensors, layer, hidden[4:], mlp=hidden_dim is not None, prefix=prefix)
        assert scores.dtype == torch.float32
        torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-4)


def test_kvzaps_published_usage_a_score_threshold_keeps_what_its_scores_put_above_it(tmp_path):
    """topk with a KVzap MLP folder and ``score_threshold`` (kvpress's ThresholdPress): every candidate
    whose kvpress score is at least the threshold is kept (rounded down to a whole number per
    (layer, KV head)), under the budget's cap; nothing below it."""
    folder, tensors = kvzap_folder(tmp_path, LAYERS, INPUT_DIM, KV_HEADS, hidden_dim=16)
    spec = SegmentSpec(start=0, end=200, num_layers=LAYERS, num_kv_heads=KV_HEADS, num_q_heads=KV_HEADS)
    hidden = [torch.randn(200, INPUT_DIM, generator=torch.Generator().manual_seed(layer)) for layer in range(LAYERS)]
    candidates = slice(4, 200 - 8)  # after the 4 sinks, before the window of 8
    scores = [kvpress_scores(tensors, layer, hidden[layer][candidates], mlp=True) for layer in range(LAYERS)]
    threshold = float(torch.cat([s.flatten() for s in scores]).quantile(0.85))
    config = EvictionConfig.for_policy("topk", score="learned", learned_weights=str(folder), budget="0.5",
                                       window=8, score_threshold=threshold)  # fmt: skip
    compressor = build_policy(config).start(spec)
    for layer in range(LAYERS):
        compressor.observe(layer, WindowStats(window=8, hidden_states=hidden[layer], hidden_start=0))
    plan = compressor.plan()
    above = [(s >= threshold) for s in scores]
    per_head = sum(int(mask.sum()) for mask in above) // (LAYERS * KV_HEADS)
    assert plan.total_kept() == LAYERS * KV_HEADS * (per_head + 4 + 8)  # fewer than the budget's 100 per head
    for layer in range(LAYERS):
        kept = plan.keep_mask(layer)[:, candidates]
        assert not (kept & ~above[layer]).any()  # nothing below the threshold


def test_a_rank_scores_its_heads_of_an_mlp_as_the_whole_map_does(tmp_path):
    folder, _ = kvzap_folder(tmp_path, LAYERS, INPUT_DIM, KV_HEADS, hidden_dim=8)
    weights = LearnedWeights.load(folder)
    hidden = torch.randn(7, INPUT_DIM, generator=torch.Generator().manual_seed(2))
    heads = weights.for_heads(torch.tensor([2, 3, 0]), torch.tensor([1.0, 1.0, 0.0]))  # the last one padded
    whole, own = weights.scores(1, hidden), heads.scores(1, hidden)
    torch.testing.assert_close(own[:2], whole[2:4])
    assert torch.equal(own[2], torch.zeros(7))


def test_the_launcher_takes_a_kvzap_folder_that_fits_the_model_and_refuses_one_that_does_not(tiny_llama_dir, tmp_path):
    fits, _ = kvzap_folder(tmp_path / "fits", num_layers=2, input_dim=64, output_dim=2, hidden_dim=16)
    config = EvictionConfig.for_policy("topk", score="learned", learned_weights=str(fits))
    assert resolve_learned_weights(config.score_knobs, tiny_llama_dir) == fits
    wrong, _ = kvzap_folder(tmp_path / "wrong", num_layers=3, input_dim=64, output_dim=2, hidden_dim=16)
    config = EvictionConfig.for_policy("topk", score="learned", learned_weights=str(wrong))
    with pytest.raises(ConfigError) as error:
        resolve_learned_weights(config.score_knobs, tiny_llama_dir)
    message = str(error.value)
    assert "are for a model with 3 layers, hidden size 64, 2 KV heads" in message and "\n" not in message
    assert "train_scorer --model" in message and "nvidia/KVzap-mlp-<model>" in message


@pytest.mark.parametrize("damage", ["model type", "a missing layer", "a wrong shape", "both layouts", "neither layout"])
def test_a_folder_that_is_not_a_kvzap_checkpoint_is_refused_in_one_line(tmp_path, damage):
    import json

    from safetensors.torch import load_file, save_file

    folder, tensors = kvzap_folder(tmp_path, LAYERS, INPUT_DIM, KV_HEADS, hidden_dim=None)
    if damage == "model type":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    else:
        tensors = load_file(str(folder / "model.safetensors"))
        if damage == "a missing layer":
            del tensors["module_list.2.bias"]
        elif damage == "a wrong shape":
            tensors["module_list.1.weight"] = tensors["module_list.1.weight"][:, :-1].contiguous()
        elif damage == "both layouts":
            tensors["layers.0.weight"] = tensors["module_list.0.weight"].clone()
        else:
            tensors = {name.replace("module_list.", "blocks."): tensor for name, tensor in tensors.items()}
        save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match="cannot be read") as error:
        LearnedWeights.load(folder)
    assert "\n" not in str(error.value) and "KVzap checkpoint folder" in str(error.value)
