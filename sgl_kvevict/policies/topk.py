"""Global top-k (KVzip's allocation, Kim et al. 2025): one top-k over every (layer, KV head,
candidate) of the segment, no floor, so layers and heads keep whatever share of the budget their
scores earn.

Meant for question-agnostic scores: ``kvzip`` (the default: max attention of one reconstruction
pass, a probability in every layer) and ``learned`` (its predicted log). Window scores are accepted
too.

``layer_scale`` says what the one top-k compares. ``raw`` (the default) is KVzip's own: the scores as
they are. ``standardised`` first shifts and scales each layer's scores to mean 0 and standard
deviation 1 (``standardised_per_layer``), so an entry is kept for standing out in its own layer. With
raw learned scores SmolLM2's first layers, whose attention is broad and whose scores are low and flat,
keep 6-15% of their entries at a 25% budget, and answers that copy a five-digit code from a 2-4K
document fail; standardising keeps more of them there. Measured through the server it is a wash so
far (long documents +1 answer of 21 at 2K, equal at 4K and 7K; ~1.3K documents 11 vs 13 of 20:
docs/methods/kvzip.md), so the default stays KVzip's.
With a score threshold (``score_threshold``) the top-k keeps exactly the entries scoring at least the
threshold, so it compares raw scores whatever ``layer_scale`` says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvevict.budget.heads import adaptive_head_counts
from sgl_kvevict.budget.layers import global_top_k_layer_budgets, standardised_per_layer
from sgl_kvevict.policies.base import PolicyDefaults, register_policy
from sgl_kvevict.policies.layout import SegmentLayout
from sgl_kvevict.policies.scored import ScoredPolicy
from sgl_kvevict.scoring import QUESTION_AGNOSTIC_SCORES, WINDOW_SCORES
from sgl_kvevict.settings import Settings, setting

LAYER_SCALES = ("raw", "standardised")


@dataclass(frozen=True)
class TopKKnobs(Settings):
    layer_scale: str = setting(
        LAYER_SCALES[0],
        help="topk: what its one top-k over every layer compares: 'raw' (KVzip's own: the scores as they "
        "are, so layers with high scores take most of the budget) or 'standardised' (each layer's scores "
        "to mean 0, standard deviation 1 first, so every layer keeps what stands out in it); with "
        "--kv-evict-score-threshold always raw",
        valid=(lambda scale: scale in LAYER_SCALES, "layer scale {value!r} is not one of " + ", ".join(LAYER_SCALES)),
    )


@register_policy("topk")
class GlobalTopKPolicy(ScoredPolicy):
    defaults = PolicyDefaults(window=32, pooling="max", gqa="max", scores=(*QUESTION_AGNOSTIC_SCORES, *WINDOW_SCORES))
    knobs_type = TopKKnobs
    knobs: TopKKnobs

    def layer_budgets(self, layout: SegmentLayout, layer_scores: list[torch.Tensor]) -> list[int]:
        spec = layout.spec
        total = spec.num_layers * spec.num_kv_heads * layout.selected_per_head
        if self.knobs.layer_scale == "standardised" and self.common.score_threshold is None:
            layer_scores = standardised_per_layer(layer_scores)
        return global_top_k_layer_budgets(layer_scores, total).tolist()

    def head_counts(self, sorted_scores: torch.Tensor, layer_budget: int) -> torch.Tensor:
        return adaptive_head_counts(sorted_scores, layer_budget, alpha=0.0)
