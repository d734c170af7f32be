"""Scorer: one layer's ``WindowStats`` -> fp32 candidate scores ``[H_kv, n_candidates]`` (higher = keep).

A scorer is the single "score hook" of a score-based policy (kvpress's press style): swapping
SnapKV's attention sum for an OBCache, KVzip or learned score is swapping the scorer, nothing else.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from sgl_kvevict.settings import CommonSettings, Settings
from sgl_kvevict.scoring.reduce import pool_positions, reduce_gqa
from sgl_kvevict.scoring.window import StatsRequest, WindowStats


@dataclass(frozen=True)
class Reduction:
    """How per-query-head scores become per-KV-head scores: GQA reduction and positional pooling."""

    gqa: str = "mean"
    pooling: str = "max"
    kernel: int = 7

    @classmethod
    def of(cls, common: CommonSettings) -> "Reduction":
        return cls(gqa=common.gqa, pooling=common.pooling, kernel=common.pooling_kernel)

    def pool(self, scores: torch.Tensor) -> torch.Tensor:
        return pool_positions(scores, self.pooling, self.kernel)


class Scorer(abc.ABC):
    """Turns one layer's statistics into candidate scores; ``request`` says which statistics it reads."""

    request: StatsRequest
    # True when the scores are logs of a non-negative score (a learned regressor's output): an
    # allocator that needs a distribution over them (LAVa's entropy) exponentiates them first.
    log_scores: ClassVar[bool] = False
    # The score's own knobs (a frozen ``Settings`` dataclass, like a policy's ``knobs_type``).
    knobs_type: ClassVar[type[Settings]] = Settings

    def __init__(self, reduction: Reduction):
        self.reduction = reduction

    @classmethod
    def of(cls, common: CommonSettings, knobs: Settings, reduction: Reduction) -> "Scorer":
        """The scorer ``common.score`` names (``scoring.SCORE_KINDS``); ``knobs``: its ``knobs_type``."""
        return cls(reduction)

    def for_model(self, model_dir: Path) -> "Scorer":
        """This scorer with the data it needs from the served model (``model_dir``: its HF folder)
        loaded and checked; ``self`` for scorers that need none."""
        return self

    def for_heads(self, heads: tuple[int, ...]) -> "Scorer":
        """This scorer on a rank holding the model's KV heads ``heads`` (-1: a padded head), scoring only
        those; ``self`` for scorers of window statistics, which a rank computes for its heads alone."""
        return self

    def for_layers(self, layers: tuple[int, ...]) -> "Scorer":
        """This scorer called with the model's layers ``layers`` renumbered ``0..`` (``Policy.for_layers``);
        ``self`` for scorers that read nothing per layer but the statistics."""
        return self

    @abc.abstractmethod
    def __call__(self, stats: WindowStats, candidates: slice, num_kv_heads: int, layer: int) -> torch.Tensor:
        """fp32 ``[H_kv, n_candidates]`` for the ``candidates`` positions (a slice of absolute positions,
        which are also the columns of ``stats``) of layer ``layer``."""


class RowScorer(Scorer):
    """A score of each candidate from that candidate's own data (its hidden states), then pooled. An
    engine that prefills a segment in several forwards (chunked prefill) may hand its rows over in
    pieces: ``row_scores`` scores one piece, and the pooling runs once the rows are all there."""

    @abc.abstractmethod
    def row_scores(self, stats: WindowStats, rows: slice, layer: int) -> torch.Tensor:
        """fp32 ``[H_kv, n]`` before pooling, for the positions ``rows`` (inside the piece ``stats`` holds)."""

    def __call__(self, stats: WindowStats, candidates: slice, num_kv_heads: int, layer: int) -> torch.Tensor:
        return self.reduction.pool(self.row_scores(stats, candidates, layer))


class QueryHeadScorer(Scorer):
    """A score defined per query head, reduced to KV heads, then pooled (the Ada-KV code's order:
    window-mean -> GQA -> pool; OBCache's "aggregate over the group first, then max-pool once")."""

    @abc.abstractmethod
    def query_head_scores(self, stats: WindowStats, candidates: slice) -> torch.Tensor:
        """fp32 ``[H_q, n_candidates]``."""

    def __call__(self, stats: WindowStats, candidates: slice, num_kv_heads: int, layer: int) -> torch.Tensor:
        per_query_head = self.query_head_scores(stats, candidates)
        return self.reduction.pool(reduce_gqa(per_query_head, num_kv_heads, self.reduction.gqa))
