"""Global top-k (KVzip's own allocation, Kim et al. 2025): one top-k over every (layer, KV head,
candidate) of the segment, no floor, so layers and heads keep whatever share of the budget their
scores earn.

Meant for question-agnostic scores, which are comparable across layers: ``kvzip`` (the default:
max attention of one reconstruction pass, a probability in every layer) and ``learned`` (its
predicted log, calibrated by the same regression targets). Window scores are accepted too.
"""

from __future__ import annotations

import torch

from sgl_kvevict.budget.heads import adaptive_head_counts
from sgl_kvevict.budget.layers import global_top_k_layer_budgets
from sgl_kvevict.policies.base import PolicyDefaults, register_policy
from sgl_kvevict.policies.layout import SegmentLayout
from sgl_kvevict.policies.scored import ScoredPolicy
from sgl_kvevict.scoring import QUESTION_AGNOSTIC_SCORES, WINDOW_SCORES


@register_policy("topk")
class GlobalTopKPolicy(ScoredPolicy):
    defaults = PolicyDefaults(window=32, pooling="max", gqa="max", scores=(*QUESTION_AGNOSTIC_SCORES, *WINDOW_SCORES))

    def layer_budgets(self, layout: SegmentLayout, layer_scores: list[torch.Tensor]) -> list[int]:
        spec = layout.spec
        total = spec.num_layers * spec.num_kv_heads * layout.selected_per_head
        return global_top_k_layer_budgets(layer_scores, total).tolist()

    def head_counts(self, sorted_scores: torch.Tensor, layer_budget: int) -> torch.Tensor:
        return adaptive_head_counts(sorted_scores, layer_budget, alpha=0.0)
