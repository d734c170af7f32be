"""Fit the learned scorer (``scoring.learned``) for a local HF model, from real text, with KVzip's
scores from this reference engine as targets.

    python -m sgl_kvevict.reference.train_scorer --model MODEL_DIR --corpus DOCS --out DIR [--device cuda]

Pipeline:

0. Before the model loads: the documents are split and measured, the longest is checked to leave
   room for KVzip's passes before the model's context length, and the run's time and peak memory are
   estimated (``training_cost.py``) and printed; ``--estimate-only`` stops there.
1. Documents: the corpus (``corpus.py``: the Python documentation topics by default, or the user's own
   text files, ``--corpus PATH``) packed into documents of half to all of ``--document-tokens``
   tokens, shuffled by ``--seed`` and split by document into train, validation
   (``--validation-fraction``) and test (``--test-documents``).
2. Per document: the chat-template user turn holding it (the context of a context-only prompt) is
   prefilled with a policy that only records, per layer, the attention inputs (features, captured by
   a pre-hook on each attention module) and ``log max(KVzip score, floor)`` (targets: the max
   attention over the reconstruction pass of ``scoring.kvzip``, GQA max) of every position after the
   sinks. KVzip+'s output-norm weighting is not used: the scorer predicts the very score ``kvzip``
   ranks by, so the two are interchangeable in every policy.
3. Per layer, ridge regression in closed form (``ridge.py``) on standardised features; the penalty
   minimises the validation error, then the fit is redone on train + validation.
4. Test documents: R^2 per layer, Spearman's rank correlation of the predictions with KVzip's score
   per (layer, KV head), and how much of KVzip's own selection at 25% (one global top-k over layers,
   heads and positions, and per (layer, head)) the predictions select.

Writes ``<model folder name>.safetensors`` and its ``.json`` manifest, which holds the report of the
fit (``fit``: those test metrics) and the estimate next to the real time, into ``--out`` (default the
package's bundled weights, where the scorer finds them by the model's fingerprint). The reference
engine runs on ``--device`` (the CPU by default; ``cuda`` has not been run by this project).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from transformers import AutoTokenizer

from sgl_kvevict.models import ModelError, resolve_model
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies.base import Policy, SegmentCompressor, SegmentSpec
from sgl_kvevict.reference.corpus import check_source, describe_source, documents, source_texts
from sgl_kvevict.reference.engine import ReferenceEngine
from sgl_kvevict.reference.ridge import RegressionStatistics
from sgl_kvevict.reference.schedule import Segment
from sgl_kvevict.reference.training_cost import ModelSize, TrainingCost
from sgl_kvevict.scoring import KVzipScorer, Reduction
from sgl_kvevict.scoring.kvzip import MIN_CHUNK_TOKENS, NoRoomForPasses, ReconstructionPrompt
from sgl_kvevict.scoring.learned import BUNDLED_WEIGHTS_DIR, LearnedWeights, ModelShape, model_fingerprint
from sgl_kvevict.scoring.window import RECONSTRUCTION_QUERIES, StatsRequest, WindowStats
from sgl_kvevict.settings import ConfigError

# Attention below this is "never needed": the log of a zero would be -inf, which no regression fits.
TARGET_FLOOR = 1e-6
# Penalties tried on the standardised features (the correlation matrix has trace d).
RIDGES = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
# The kept fraction at which the ranking metric compares the predictions with KVzip's selection.
KEEP_FRACTION = 0.25
KVZIP_TARGET = KVzipScorer(Reduction(gqa="max", pooling="none"))


@dataclass(frozen=True)
class TrainingConfig:
    model: str
    out: Path
    sources: tuple[str, ...] = ("pydoc",)
    document_tokens: int = 1000
    max_documents: Optional[int] = None
    test_documents: int = 12
    validation_fraction: float = 0.15
    seed: int = 0
    sink_tokens: int = 4
    device: str = "cpu"
    threads: int = 1

    def __post_init__(self):
        for source in self.sources:
            try:
                check_source(source)
            except ValueError as error:
                raise ConfigError(str(error)) from None
        if self.document_tokens < 16 or self.test_documents < 1 or not 0.0 < self.validation_fraction < 1.0:
            raise ConfigError("document tokens must be >= 16, test documents >= 1, validation fraction in (0, 1)")


# --------------------------------------------------------------------------------------------------
# Features and targets of one document
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RecorderConfig:
    """The one common setting the reference engine reads from a policy (``policy.common.window``)."""

    window: int = 1


class KVzipTargetRecorder(Policy):
    """Keeps everything; records per layer the attention inputs ``[n, d_model]`` and log KVzip scores
    ``[n, H_kv]`` of the segment's positions from ``sink_tokens`` on."""

    def __init__(self, sink_tokens: int):
        super().__init__(_RecorderConfig())
        self.sink_tokens = sink_tokens
        self.last: Optional[_Recording] = None

    def stats_request(self) -> StatsRequest:
        return StatsRequest(attn_max=True, hidden_states=True, queries=RECONSTRUCTION_QUERIES)

    def start(self, spec: SegmentSpec) -> SegmentCompressor:
        self.last = _Recording(spec, slice(max(spec.start, self.sink_tokens), spec.end))
        return self.last


class _Recording(SegmentCompressor):
    def __init__(self, spec: SegmentSpec, positions: slice):
        super().__init__(spec)
        self.positions = positions
        self.features: dict[int, torch.Tensor] = {}
        self.targets: dict[int, torch.Tensor] = {}

    def observe(self, layer: int, stats: WindowStats) -> None:
        kvzip = KVZIP_TARGET(stats, self.positions, self.spec.num_kv_heads, layer)  # [H_kv, n]
        self.targets[layer] = kvzip.clamp(min=TARGET_FLOOR).log().t().cpu()  # the regression runs on the CPU
        rows = slice(self.positions.start - stats.hidden_start, self.positions.stop - stats.hidden_start)
        self.features[layer] = stats.hidden_states[rows].float().cpu()

    def plan(self) -> CompressionPlan:
        spec = self.spec
        return CompressionPlan.keep_all(spec.start, spec.end, spec.num_layers, spec.num_kv_heads)


def document_features(
    engine: ReferenceEngine, recorder: KVzipTargetRecorder, text: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, (features ``[n, d_model]``, targets ``[n, H_kv]``) of the user turn holding ``text``."""
    prompt = engine.chat_prompt(text, "")
    context = prompt.token_ids[: prompt.context_end]
    engine.extend(engine.new_sequence(), context, recorder, [Segment(0, len(context))])
    recording = recorder.last
    layers = range(engine.num_layers)
    return [recording.features[layer] for layer in layers], [recording.targets[layer] for layer in layers]


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


def spearman(true: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """float64 ``[rows]``: Spearman's rank correlation of each row of ``[rows, n]`` scores (tied values
    take their mean rank, as the targets' floor ties many)."""
    ranks = [_mean_ranks(scores) for scores in (true, predicted)]
    centred = [rank - rank.mean(-1, keepdim=True) for rank in ranks]
    norms = centred[0].norm(dim=-1) * centred[1].norm(dim=-1)
    return (centred[0] * centred[1]).sum(-1) / norms.clamp(min=1e-12)  # a constant row correlates 0


def _mean_ranks(scores: torch.Tensor) -> torch.Tensor:
    ranks = torch.empty(scores.shape, dtype=torch.float64)
    for row, values in enumerate(scores):
        _, inverse, counts = torch.unique(values, return_inverse=True, return_counts=True)
        last = counts.cumsum(0).double()  # the 1-based rank of each distinct value's last occurrence
        ranks[row] = (last - (counts - 1) / 2)[inverse]
    return ranks


def top_overlap(true: torch.Tensor, predicted: torch.Tensor, fraction: float) -> float:
    """Mean over rows of ``|top-k(true) ∩ top-k(predicted)| / k``, ``k = round(fraction * n)``, for
    ``[rows, n]`` scores (a random ranking scores ``fraction`` on average)."""
    k = max(round(fraction * true.shape[-1]), 1)
    true_top = torch.zeros_like(true, dtype=torch.bool).scatter_(-1, true.topk(k, dim=-1).indices, True)
    predicted_top = torch.zeros_like(true_top).scatter_(-1, predicted.topk(k, dim=-1).indices, True)
    return float((true_top & predicted_top).sum(-1).double().mean() / k)


@dataclass
class HeldOutMetrics:
    """Accumulated over the test documents."""

    statistics: list[RegressionStatistics]
    global_overlap: list[float]
    per_head_overlap: list[float]
    spearman_per_layer: list[list[float]]  # per layer, one mean over KV heads per document

    def add(self, features: list[torch.Tensor], targets: list[torch.Tensor], weights: LearnedWeights) -> None:
        predictions = [weights.scores(layer, x).t() for layer, x in enumerate(features)]
        for stats, x, y in zip(self.statistics, features, targets):
            stats.add(x, y)
        true = torch.stack(targets).transpose(1, 2)  # [L, H_kv, n]
        predicted = torch.stack(predictions).transpose(1, 2)
        self.global_overlap.append(top_overlap(true.reshape(1, -1), predicted.reshape(1, -1), KEEP_FRACTION))
        self.per_head_overlap.append(
            top_overlap(true.reshape(-1, true.shape[-1]), predicted.reshape(-1, true.shape[-1]), KEEP_FRACTION)
        )
        per_head = spearman(true.reshape(-1, true.shape[-1]), predicted.reshape(-1, true.shape[-1]))
        for layer, correlations in enumerate(per_head.view(true.shape[0], -1)):
            self.spearman_per_layer[layer].append(float(correlations.mean()))

    def summary(self, weights: LearnedWeights, ridges: list[float]) -> dict:
        r2 = self.r2_per_layer(weights)
        return {
            "method": "ridge per layer in closed form on standardised features; penalty by validation MSE "
            "from " + ", ".join(f"{r:g}" for r in RIDGES) + ", then refit on train + validation",
            "ridge_per_layer": ridges,
            "test_r2_mean": round(sum(r2) / len(r2), 4),
            "test_r2_per_layer": [round(value, 4) for value in r2],
            "test_spearman_mean": round(_mean([_mean(layer) for layer in self.spearman_per_layer]), 4),
            "test_spearman_per_layer": [round(_mean(layer), 4) for layer in self.spearman_per_layer],
            "test_top25_overlap_global": round(_mean(self.global_overlap), 4),
            "test_top25_overlap_per_head": round(_mean(self.per_head_overlap), 4),
            "random_top25_overlap": KEEP_FRACTION,
        }

    def r2_per_layer(self, weights: LearnedWeights) -> list[float]:
        r2 = []
        for layer, stats in enumerate(self.statistics):
            residual = stats.squared_error(weights.weight[layer], weights.bias[layer]).sum()
            r2.append(float(1 - residual / stats.total_squares().sum()))
        return r2


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def corpus_documents(config: TrainingConfig, tokenizer) -> list[tuple[str, str]]:
    """(name, text) documents of the configured sources, in a fixed order."""

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    texts = (pair for source in config.sources for pair in source_texts(source))
    return list(documents(texts, count_tokens, config.document_tokens, config.document_tokens // 2))


def split_documents(config: TrainingConfig, docs: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Shuffled by the seed, then cut into test, validation and train documents; ``ConfigError`` when
    the corpus cannot give each at least one document (two for train)."""
    if config.max_documents is not None:
        docs = docs[: config.max_documents]
    shuffled = docs[:]
    random.Random(config.seed).shuffle(shuffled)
    rest = len(shuffled) - config.test_documents
    validation = max(round(config.validation_fraction * rest), 1)
    if rest - validation < 2:
        raise ConfigError(
            f"the corpus ({'+'.join(config.sources)}) has {len(docs)} documents of {config.document_tokens // 2}-"
            f"{config.document_tokens} tokens; {config.test_documents} test + 1 validation + 2 train documents at "
            "least are needed: add a source (--corpus pydoc,readmes), shorten --document-tokens or lower "
            "--test-documents"
        )
    return {
        "test": shuffled[: config.test_documents],
        "validation": shuffled[config.test_documents : config.test_documents + validation],
        "train": shuffled[config.test_documents + validation :],
    }


class _DocumentRunner:
    """Runs documents through the engine, reporting progress."""

    def __init__(self, engine: ReferenceEngine, sink_tokens: int, total: int, log):
        self.engine = engine
        self.shape = ModelShape.of(engine.model_dir)
        self.recorder = KVzipTargetRecorder(sink_tokens)
        self.progress = _Progress(total, log)

    def empty_statistics(self) -> list[RegressionStatistics]:
        shape = self.shape
        return [RegressionStatistics.empty(shape.hidden_size, shape.num_kv_heads) for _ in range(shape.num_layers)]

    def features(self, docs: list[tuple[str, str]]) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        for name, text in docs:
            yield document_features(self.engine, self.recorder, text)
            self.progress.step(name)

    def statistics(self, docs: list[tuple[str, str]]) -> list[RegressionStatistics]:
        statistics = self.empty_statistics()
        for features, targets in self.features(docs):
            for layer_statistics, x, y in zip(statistics, features, targets):
                layer_statistics.add(x, y)
        return statistics

    def held_out_metrics(self, docs: list[tuple[str, str]], weights: LearnedWeights) -> "HeldOutMetrics":
        metrics = HeldOutMetrics(self.empty_statistics(), [], [], [[] for _ in range(self.shape.num_layers)])
        for features, targets in self.features(docs):
            metrics.add(features, targets, weights)
        return metrics


@dataclass(frozen=True)
class PlannedRun:
    """What a run will read, and its estimated cost, known before the model loads."""

    model_dir: Path
    splits: dict[str, list[tuple[str, str]]]
    cost: TrainingCost


def plan_run(config: TrainingConfig) -> PlannedRun:
    """Split the corpus, check the longest document leaves room for KVzip's passes, estimate the cost:
    a corpus too small or documents too long are one line, not a line after minutes."""
    model_dir = resolve_model(config.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    splits = split_documents(config, corpus_documents(config, tokenizer))
    # The longest segment: a document in the chat template's user turn (the rendered turn bounds its wrapping).
    turn = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True)
    wrapping = len(tokenizer.encode(turn, add_special_tokens=False))
    lengths = [len(tokenizer.encode(text, add_special_tokens=False)) + wrapping for docs in splits.values() for _, text in docs]
    context_length = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    prompt = ReconstructionPrompt.from_tokenizer(tokenizer)
    try:
        prompt.chunk_size_before(max(lengths), context_length)
    except NoRoomForPasses:
        raise ConfigError(
            f"--document-tokens {config.document_tokens}: the longest document, {max(lengths)} tokens in the chat "
            f"template, leaves no room for KVzip's reconstruction passes (at least {prompt.fixed_tokens + MIN_CHUNK_TOKENS} "
            f"positions) before the model's context length {context_length}; lower --document-tokens"
        ) from None
    return PlannedRun(model_dir, splits, TrainingCost.estimate(ModelSize.of(model_dir), lengths, config.device, config.threads))


def train(config: TrainingConfig, command: str, log=functools.partial(print, flush=True)) -> Path:
    """Run the pipeline; returns the path of the written weights."""
    started, cpu_started = time.perf_counter(), time.process_time()
    run = plan_run(config)
    model_dir, splits = run.model_dir, run.splits
    log(f"[train_scorer] {model_dir.name}: " + ", ".join(f"{len(d)} {name}" for name, d in splits.items()))
    log(f"[train_scorer] estimate: {run.cost.describe()}")
    # Targets of every layer: a weights file maps them all, though a server trimming local layers reads
    # only the global layers' maps.
    engine = ReferenceEngine(model_dir, device=config.device, trim_local_layers=False)
    runner = _DocumentRunner(engine, config.sink_tokens, sum(map(len, splits.values())), log)
    fitted = {name: runner.statistics(splits[name]) for name in ("train", "validation")}
    weights, ridges = fit_layers(fitted["train"], fitted["validation"])
    metrics = runner.held_out_metrics(splits["test"], weights)
    shape = runner.shape
    manifest = {
        "format": 1,
        "model": model_dir.name,
        "fingerprint": model_fingerprint(model_dir),
        "shape": {"num_layers": shape.num_layers, "hidden_size": shape.hidden_size, "num_kv_heads": shape.num_kv_heads},
        "features": "attention-input hidden states (after each layer's input layernorm), fp32 reference engine",
        "target": f"log(max(KVzip score, {TARGET_FLOOR:g})): max attention over the reconstruction queries "
        "(scoring.kvzip, chunks of 2048), GQA max; positions after the sink tokens",
        "corpus": {
            "sources": [describe_source(source) for source in config.sources],
            "documents": {name: len(d) for name, d in splits.items()},
            "tokens": {**{name: stats[0].count for name, stats in fitted.items()}, "test": metrics.statistics[0].count},
            "document_tokens": [config.document_tokens // 2, config.document_tokens],
            "test_documents": [name for name, _ in splits["test"]],
            "seed": config.seed,
        },
        "fit": metrics.summary(weights, ridges),
        "command": command,
        "device": config.device,
        "threads": config.threads,
        "estimate": {"seconds": round(run.cost.seconds), "device_bytes": run.cost.device_bytes,
                     "host_bytes": run.cost.host_bytes},  # fmt: skip
        "seconds": round(time.perf_counter() - started),
        "cpu_seconds": round(time.process_time() - cpu_started),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
    }
    path = config.out / f"{model_dir.name}.safetensors"
    LearnedWeights(weights.weight, weights.bias, manifest).save(path)
    fit = manifest["fit"]
    log(
        f"[train_scorer] wrote {path}: held-out Spearman with KVzip's score {fit['test_spearman_mean']}, R^2 "
        f"{fit['test_r2_mean']}, top-25% overlap with KVzip {fit['test_top25_overlap_global']} global, "
        f"{fit['test_top25_overlap_per_head']} per head (random 0.25), {manifest['seconds']} s "
        f"({manifest['cpu_seconds']} s of CPU; estimated {manifest['estimate']['seconds']} s)"
    )
    return path


def fit_layers(
    train_stats: list[RegressionStatistics], validation_stats: list[RegressionStatistics]
) -> tuple[LearnedWeights, list[float]]:
    """Per layer: the penalty with the lowest validation error, refitted on train + validation."""
    weights, biases, chosen = [], [], []
    for train_layer, validation_layer in zip(train_stats, validation_stats):
        errors = [float(validation_layer.squared_error(w, b).sum()) for w, b in train_layer.fit(RIDGES)]
        ridge = RIDGES[errors.index(min(errors))]
        weight, bias = (train_layer + validation_layer).fit([ridge])[0]
        weights.append(weight.float())
        biases.append(bias.float())
        chosen.append(ridge)
    return LearnedWeights(torch.stack(weights), torch.stack(biases), {}), chosen


class _Progress:
    def __init__(self, total: int, log):
        self.total, self.done, self.log, self.started = total, 0, log, time.perf_counter()

    def step(self, name: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.started
        eta = elapsed / self.done * (self.total - self.done)
        self.log(f"[train_scorer] {self.done}/{self.total} {name} ({elapsed:.0f} s, ETA {eta:.0f} s)")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[TrainingConfig, int]:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_kvevict.reference.train_scorer", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--model", required=True, help="'smollm2' or a local HF model folder")
    add("--out", type=Path, default=BUNDLED_WEIGHTS_DIR, help=f"output folder (default {BUNDLED_WEIGHTS_DIR})")
    add("--corpus", default="pydoc", help="comma-separated sources: pydoc, readmes, or a text file or a folder of "
        "them (your own documents; default pydoc)")
    add("--document-tokens", type=int, default=1000, help="documents of half this to this many tokens, up to what "
        "leaves room for KVzip's passes before the model's context length (default 1000)")
    add("--max-documents", type=int, help="use at most this many documents (default: all)")
    add("--test-documents", type=int, default=12, help="held-out documents for the metrics (default 12)")
    add("--validation-fraction", type=float, default=0.15, help="of the rest, to choose the penalty (default 0.15)")
    add("--seed", type=int, default=0, help="shuffles the documents before the split (default 0)")
    add("--sink-tokens", type=int, default=4, help="leading positions left out of the targets (always kept)")
    add("--threads", type=int, default=1, help="torch threads (default 1)")
    add("--device", default="cpu", help="where the reference engine runs: cpu, or cuda (not run by this project; "
        "default cpu)")
    add("--estimate-only", action="store_true", help="print the documents and the estimated time and memory, then exit")
    args = parser.parse_args(argv)
    config = TrainingConfig(
        model=args.model,
        out=args.out,
        sources=tuple(s.strip() for s in args.corpus.split(",") if s.strip()),
        document_tokens=args.document_tokens,
        max_documents=args.max_documents,
        test_documents=args.test_documents,
        validation_fraction=args.validation_fraction,
        seed=args.seed,
        sink_tokens=args.sink_tokens,
        device=args.device,
        threads=args.threads,
    )
    return config, args.estimate_only


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        config, estimate_only = parse_args(argv)
        torch.set_num_threads(config.threads)
        if estimate_only:
            run = plan_run(config)
            documents = ", ".join(f"{len(docs)} {name}" for name, docs in run.splits.items())
            print(f"train_scorer: {run.model_dir.name}, {documents} documents: {run.cost.describe()}")
            return 0
        train(config, "python -m sgl_kvevict.reference.train_scorer " + " ".join(shlex.quote(a) for a in argv))
    except (ConfigError, ModelError) as error:
        print(f"train_scorer: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
