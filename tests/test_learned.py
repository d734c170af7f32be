"""The learned scorer end to end: weights found by fingerprint and checked against the model, one
clear line per mistake, and the training pipeline on the tiny model (seconds)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest_policies import learned_weights_file, tiny_training
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.reference import Mode, ReferenceEngine
from sgl_kvevict.reference.ridge import RegressionStatistics
from sgl_kvevict.reference.train_scorer import main, top_overlap, train
from sgl_kvevict.scoring import learned
from sgl_kvevict.scoring.learned import (
    LearnedScorer,
    LearnedWeights,
    ModelShape,
    model_fingerprint,
    resolve_learned_weights,
)
from sgl_kvevict.settings import ConfigError


@pytest.fixture(scope="module")
def trained(tiny_llama_dir, tmp_path_factory):
    """Weights trained on the tiny model from 24 short pydoc documents (4 held out), about a second."""
    out = tmp_path_factory.mktemp("weights")
    config = tiny_training(tiny_llama_dir, out)
    lines: list[str] = []
    path = train(config, "test command", log=lines.append)
    return path, lines


def test_training_writes_weights_of_the_models_shape_and_a_manifest(trained, tiny_llama_dir):
    path, lines = trained
    weights = LearnedWeights.load(path)
    assert weights.shape == ModelShape(num_layers=2, hidden_size=64, num_kv_heads=2)
    manifest = json.loads(path.with_suffix(".json").read_text())
    assert manifest["fingerprint"] == model_fingerprint(tiny_llama_dir)
    assert manifest["corpus"]["documents"] == {"test": 4, "validation": 3, "train": 17}
    assert all(name.startswith("pydoc:") for name in manifest["corpus"]["test_documents"])
    fit = manifest["fit"]
    assert len(fit["test_r2_per_layer"]) == 2 and len(fit["ridge_per_layer"]) == 2
    assert 0.0 <= fit["test_top25_overlap_global"] <= 1.0 and manifest["command"] == "test command"
    assert lines[-1].startswith(f"[train_scorer] wrote {path}")


def test_trained_scores_rank_better_than_chance_on_held_out_documents(trained):
    """Even the random tiny model's KVzip ranking is partly predictable from its hidden states (its
    R^2 is not: the held-out documents' mean log score differs from the training documents')."""
    fit = json.loads(trained[0].with_suffix(".json").read_text())["fit"]
    assert fit["test_top25_overlap_global"] > fit["random_top25_overlap"] + 0.05


def test_the_bundled_weights_are_found_by_fingerprint(trained, tiny_llama_dir, monkeypatch, tmp_path):
    path, _ = trained
    monkeypatch.setattr(learned, "BUNDLED_WEIGHTS_DIR", path.parent)
    config = EvictionConfig.for_policy("topk", score="learned")
    assert resolve_learned_weights(config.score_knobs, tiny_llama_dir) == path
    assert resolve_learned_weights(EvictionConfig.for_policy("topk").score_knobs, tiny_llama_dir) is None  # kvzip: none needed
    bound = build_policy(config).for_model(tiny_llama_dir)
    assert isinstance(bound.scorer, LearnedScorer) and bound.scorer.weights is LearnedWeights.load(path)
    # Another model (same shapes, other weights) has no weights: one line naming both ways to get them.
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    (other / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(ConfigError) as error:
        resolve_learned_weights(config.score_knobs, other)
    message = str(error.value)
    assert "no bundled weights" in message and "python -m sgl_kvevict.reference.train_scorer --model" in message
    assert "folder of a KVzap scorer published for this model" in message
    assert "\n" not in message


def test_weights_for_another_shape_are_refused_in_one_line(tiny_llama_dir, tmp_path):
    wrong = learned_weights_file(tmp_path, num_layers=3, num_kv_heads=2)
    config = EvictionConfig.for_policy("lava", score="learned", learned_weights=str(wrong))
    with pytest.raises(ConfigError) as error:
        resolve_learned_weights(config.score_knobs, tiny_llama_dir)
    message = str(error.value)
    assert "are for a model with 3 layers, hidden size 12, 2 KV heads" in message
    assert "has 2 layers, hidden size 64, 2 KV heads" in message and "\n" not in message
    with pytest.raises(ConfigError, match="are for a model with 3 layers"):
        build_policy(config).for_model(tiny_llama_dir)


def test_unreadable_weights_are_refused_in_one_line(tmp_path):
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="cannot be read") as error:
        build_policy(EvictionConfig.for_policy("topk", score="learned", learned_weights=str(broken)))
    assert "\n" not in str(error.value)


def test_the_fingerprint_follows_the_weights_and_the_architecture(tiny_llama_dir, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", "model.safetensors"):
        (copy / name).write_bytes((tiny_llama_dir / name).read_bytes())
    assert model_fingerprint(copy) == model_fingerprint(tiny_llama_dir)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "config.json").write_bytes((copy / "config.json").read_bytes())
    (changed / "model.safetensors").write_bytes(bytes(data))
    assert model_fingerprint(changed) != model_fingerprint(copy)


def test_the_reference_engine_compresses_with_trained_weights(trained, tiny_llama_dir):
    engine = ReferenceEngine(tiny_llama_dir)
    prompt = engine.chat_prompt("the cache key value token layer head budget window " * 12, "what is here?")
    for policy_name in ("topk", "lava", "ada-snapkv"):
        config = EvictionConfig.for_policy(policy_name, score="learned", learned_weights=str(trained[0]), budget="0.3", window=8)
        result = engine.generate(prompt, build_policy(config), Mode.CONTEXT_ONLY, max_new_tokens=2)
        assert result.kept_fraction() == pytest.approx(0.3, abs=0.01), policy_name


def test_a_corpus_too_small_is_one_clear_line(tiny_llama_dir, tmp_path, capsys):
    argv = ["--model", str(tiny_llama_dir), "--out", str(tmp_path), "--document-tokens", "48", "--max-documents", "3",
            "--test-documents", "2"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("train_scorer: the corpus (pydoc) has 3 documents") and "\n" not in err
    assert not list(tmp_path.iterdir())


# ---- the regression and the metric ------------------------------------------------------------------


def test_ridge_from_sufficient_statistics_equals_a_direct_solve():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=generator, dtype=torch.float64) * torch.tensor([1.0, 10.0, 0.1, 3.0, 1.0], dtype=torch.float64)
    y = x @ torch.randn(5, 2, generator=generator, dtype=torch.float64) + 0.3 * torch.randn(200, 2, generator=generator, dtype=torch.float64)
    stats = RegressionStatistics.empty(5, 2)
    stats.add(x[:120], y[:120])
    stats.add(x[120:], y[120:])
    ridge = 0.1
    (weight, bias), = stats.fit([ridge])
    # Direct: standardise, solve (Xs^T Xs / n + ridge I) w = Xs^T yc / n, map back.
    mean, std = x.mean(0), x.std(0, unbiased=False)
    xs, yc = (x - mean) / std, y - y.mean(0)
    direct = torch.linalg.solve(xs.t() @ xs / 200 + ridge * torch.eye(5, dtype=torch.float64), xs.t() @ yc / 200)
    torch.testing.assert_close(weight, (direct / std.unsqueeze(1)).t())
    torch.testing.assert_close(bias, y.mean(0) - weight @ mean)
    residual = y - x @ weight.t() - bias
    torch.testing.assert_close(stats.squared_error(weight, bias), residual.square().sum(0))
    torch.testing.assert_close(stats.total_squares(), (y - y.mean(0)).square().sum(0))


def test_top_overlap_counts_shared_members_of_the_top_fraction():
    true = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])
    assert top_overlap(true, true, 0.25) == 1.0
    assert top_overlap(true, -true, 0.25) == 0.0
    assert top_overlap(true, torch.tensor([[4.0, 0.0, 2.0, 1.0, 3.0, -1.0, -2.0, -3.0]]), 0.25) == 0.5


@pytest.mark.smollm2
def test_the_bundled_smollm2_weights_are_found_and_fit(smollm2_dir):
    """The committed weights belong to the bundled model (fingerprint) and rank like KVzip on
    held-out documents better than chance (their manifest's own measurement)."""
    path = resolve_learned_weights(EvictionConfig.for_policy("topk", score="learned").score_knobs, smollm2_dir)
    assert path.parent == learned.BUNDLED_WEIGHTS_DIR
    manifest = LearnedWeights.load(path).manifest
    assert manifest["fingerprint"] == model_fingerprint(smollm2_dir)
    assert manifest["shape"] == {"num_layers": 30, "hidden_size": 576, "num_kv_heads": 3}
    assert manifest["fit"]["test_top25_overlap_global"] > manifest["fit"]["random_top25_overlap"]


def test_spearman_ranks_ties_by_their_mean_rank():
    from sgl_kvevict.reference.train_scorer import spearman

    true = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 2.0, 5.0], [3.0, 3.0, 3.0, 3.0]])
    predicted = torch.tensor([[1.0, 3.0, 2.0, 4.0], [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    # Row 0: 1 - 6 sum(d^2) / (n (n^2 - 1)) = 1 - 6 * 2 / 60. Row 1: ranks (1.5, 1.5, 3, 4) against (1, 2, 3, 4),
    # centred (-1, -1, 0.5, 1.5) and (-1.5, -0.5, 0.5, 1.5): 4.5 / sqrt(4.5 * 5). Row 2: constant, 0.
    expected = torch.tensor([0.8, 4.5 / math.sqrt(4.5 * 5), 0.0], dtype=torch.float64)
    torch.testing.assert_close(spearman(true, predicted), expected)


def test_the_users_own_documents_train_the_scorer_and_the_fit_is_reported_beside_the_weights(tiny_llama_dir, tmp_path):
    from pydoc_data.topics import topics

    from sgl_kvevict.reference.corpus import source_texts

    corpus = tmp_path / "my-documents"
    (corpus / "notes").mkdir(parents=True)
    names = sorted(topics)[:12]
    for index, name in enumerate(names):
        (corpus / ("notes" if index % 2 else ".") / f"{name}.txt").write_text(topics[name])
    (corpus / "image.bin").write_bytes(bytes(range(256)) * 4)  # not text: skipped
    (corpus / ".hidden.txt").write_text("skipped")
    assert {name for name, _ in source_texts(str(corpus))} == {
        f"file:{'notes/' if index % 2 else ''}{name}.txt" for index, name in enumerate(names)
    }
    config = tiny_training(tiny_llama_dir, tmp_path / "out", sources=(str(corpus),))
    lines: list[str] = []
    path = train(config, "test command", log=lines.append)
    manifest = json.loads(path.with_suffix(".json").read_text())
    assert manifest["corpus"]["sources"] == [f"the text files under {corpus}"]
    assert all(name.startswith("file:") for name in manifest["corpus"]["test_documents"])
    fit = manifest["fit"]
    assert len(fit["test_spearman_per_layer"]) == 2 and -1.0 <= fit["test_spearman_mean"] <= 1.0
    assert fit["test_spearman_mean"] > 0.1  # the predictions rank like KVzip's score on held-out documents
    assert manifest["estimate"]["seconds"] >= 0 and manifest["estimate"]["device_bytes"] > 0
    assert lines[1].startswith("[train_scorer] estimate: about ") and "GiB of RAM" in lines[1]
    assert f"held-out Spearman with KVzip's score {fit['test_spearman_mean']}" in lines[-1]


def test_the_estimate_comes_before_the_model_loads_and_long_documents_are_one_line(tiny_llama_dir, tmp_path, capsys):
    base = ["--model", str(tiny_llama_dir), "--out", str(tmp_path), "--max-documents", "24", "--test-documents", "4"]
    assert main([*base, "--document-tokens", "48", "--estimate-only"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"train_scorer: {tiny_llama_dir.name}, 4 test, 3 validation, 17 train documents: about ")
    assert "GiB of RAM" in out and "\n" not in out and not list(tmp_path.iterdir())
    assert main([*base, "--document-tokens", "48", "--estimate-only", "--device", "cuda"]) == 0
    assert "not measured" in capsys.readouterr().out
    # The tiny model's context is 4096 positions: documents of up to 4090 tokens leave none for KVzip's passes.
    (tmp_path / "long.txt").write_text("the cache key value token layer\n" * 4000)
    assert main(["--model", str(tiny_llama_dir), "--out", str(tmp_path / "out"), "--corpus", str(tmp_path / "long.txt"),
                 "--document-tokens", "4090", "--test-documents", "1"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "leaves no room for KVzip's reconstruction passes" in err and "\n" not in err


def test_the_cost_model_counts_the_models_parameters_and_grows_with_the_documents(tiny_llama_dir):
    from safetensors.torch import load_file

    from sgl_kvevict.reference.training_cost import ModelSize, TrainingCost

    size = ModelSize.of(tiny_llama_dir)
    assert size.parameters == sum(tensor.numel() for tensor in load_file(str(tiny_llama_dir / "model.safetensors")).values())
    assert (size.shape, size.num_q_heads, size.head_dim) == (ModelShape(2, 64, 2), 4, 16)
    short, long = (TrainingCost.estimate(size, [n] * 10, "cpu") for n in (500, 2000))
    assert 4 < long.seconds / short.seconds < 16  # between linear and quadratic in the document length
    assert long.device_bytes > short.device_bytes
    assert TrainingCost.estimate(size, [500] * 10, "cpu", threads=4).seconds == pytest.approx(short.seconds / 4)
