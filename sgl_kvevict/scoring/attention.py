"""Attention-based scores: the mean attention of the window (SnapKV, H2O, Ada-KV) and the last
query's attention (TOVA).

Softmax runs over every key the query sees (prefix, segment, causal window) and the window columns
are then dropped without renormalising, as the SnapKV and Ada-KV code do (docs/methods/adakv.md#softmax-over-every-visible-key):
a head that attends mostly to its window has little mass to place elsewhere, so it gets less budget.
"""

from __future__ import annotations

import torch

from sgl_kvevict.scoring.base import QueryHeadScorer
from sgl_kvevict.scoring.window import StatsRequest, WindowStats


class WindowAttentionScorer(QueryHeadScorer):
    """``s[h, p] = (1/w) sum_i A[h, i, p]`` over the ``w`` window queries (mean; ranks as SnapKV's sum)."""

    request = StatsRequest(attn_sum=True)

    def query_head_scores(self, stats: WindowStats, candidates: slice) -> torch.Tensor:
        return stats.attn_sum[:, candidates] / stats.window


class LastQueryScorer(QueryHeadScorer):
    """``s[h, p] = A[h, last, p]``: TOVA's attention of the most recent query."""

    request = StatsRequest(tail_rows=1)

    def query_head_scores(self, stats: WindowStats, candidates: slice) -> torch.Tensor:
        return stats.tail_attn[:, -1, candidates]
