"""Scorer: one layer's ``WindowStats`` -> fp32 candidate scores ``[H_kv, n_candidates]`` (higher = keep).

A scorer is the single "score hook" of a score-based policy (kvpress's press style): swapping
SnapKV's attention sum for an OBCache score is swapping the scorer, nothing else.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl_kvevict.scoring.reduce import pool_positions, reduce_gqa
from sgl_kvevict.scoring.window import StatsRequest, WindowStats

if TYPE_CHECKING:
    from sgl_kvevict.config import EvictionConfig


@dataclass(frozen=True)
class Reduction:
    """How per-query-head scores become per-KV-head scores: GQA reduction and positional pooling."""

    gqa: str = "mean"
    pooling: str = "max"
    kernel: int = 7

    @classmethod
    def from_config(cls, config: "EvictionConfig") -> "Reduction":
        return cls(gqa=config.gqa, pooling=config.pooling, kernel=config.pooling_kernel)

    def pool(self, scores: torch.Tensor) -> torch.Tensor:
        return pool_positions(scores, self.pooling, self.kernel)


class Scorer(abc.ABC):
    """Turns one layer's statistics into candidate scores; ``request`` says which statistics it reads."""

    request: StatsRequest

    def __init__(self, reduction: Reduction):
        self.reduction = reduction

    @abc.abstractmethod
    def __call__(self, stats: WindowStats, candidates: slice, num_kv_heads: int) -> torch.Tensor:
        """fp32 ``[H_kv, n_candidates]`` for the ``candidates`` columns of ``stats``."""


class QueryHeadScorer(Scorer):
    """A score defined per query head, reduced to KV heads, then pooled (the Ada-KV code's order:
    window-mean -> GQA -> pool; OBCache's "aggregate over the group first, then max-pool once")."""

    @abc.abstractmethod
    def query_head_scores(self, stats: WindowStats, candidates: slice) -> torch.Tensor:
        """fp32 ``[H_q, n_candidates]``."""

    def __call__(self, stats: WindowStats, candidates: slice, num_kv_heads: int) -> torch.Tensor:
        per_query_head = self.query_head_scores(stats, candidates)
        return self.reduction.pool(reduce_gqa(per_query_head, num_kv_heads, self.reduction.gqa))
