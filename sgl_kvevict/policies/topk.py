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
Two knobs shape where the budget may go, both counted in it: ``whole_layers`` keeps the listed layers
whole (the rest share what remains), and ``layer_floor`` gives every other layer that fraction of its
even share (its own best entries) before the one top-k shares out the rest; 1 is an even budget per
layer. They exist to measure where a long document's answers live (docs/methods/kvzip.md): on
SmolLM2 a five-digit code read back from a 2K document needed layers 0-6 whole and about a fifth of
the rest; a floor did not help.
With a score threshold (``score_threshold``) the top-k keeps exactly the entries scoring at least the
threshold, so it compares raw scores whatever ``layer_scale`` says, with neither knob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sgl_kvevict.budget.heads import adaptive_head_counts
from sgl_kvevict.budget.layers import global_top_k_layer_budgets, standardised_per_layer
from sgl_kvevict.policies.base import PolicyDefaults, register_policy
from sgl_kvevict.policies.layout import SegmentLayout
from sgl_kvevict.policies.scored import ScoredPolicy
from sgl_kvevict.scoring import QUESTION_AGNOSTIC_SCORES, WINDOW_SCORES
from sgl_kvevict.settings import Settings, layer_indices, setting

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
    layer_floor: float = setting(
        0.0,
        help="topk: fraction of the even per-layer share (budget x KV heads) every layer keeps of its own "
        "best entries before the one top-k over every layer shares out the rest: 0 is KVzip's top-k, 1 "
        "an even budget per layer (Ada-KV's split over heads inside it); with --kv-evict-score-threshold "
        "no floor",
        valid=(
            lambda floor: isinstance(floor, (int, float)) and 0.0 <= floor <= 1.0,
            "layer floor {value!r} must be in [0, 1] (the guaranteed share of the even per-layer budget)",
        ),
    )
    whole_layers: tuple[int, ...] = layer_indices(
        (),
        help="topk: comma-separated layer indices kept whole (every entry), counted in the budget: the other "
        "layers share what remains by the one top-k (layers past the model's last are ignored; a budget "
        "smaller than they hold goes to them in the listed order); with --kv-evict-score-threshold none",
        label="whole layers",
    )


@register_policy("topk")
class GlobalTopKPolicy(ScoredPolicy):
    defaults = PolicyDefaults(window=32, pooling="max", gqa="max", scores=(*QUESTION_AGNOSTIC_SCORES, *WINDOW_SCORES))
    knobs_type = TopKKnobs
    knobs: TopKKnobs

    def layer_budgets(self, layout: SegmentLayout, layer_scores: list[torch.Tensor]) -> list[int]:
        spec = layout.spec
        total = spec.num_layers * spec.num_kv_heads * layout.selected_per_head
        if self.common.score_threshold is not None:  # keeps exactly what scores above it
            return global_top_k_layer_budgets(layer_scores, total).tolist()
        whole = [layer for layer in dict.fromkeys(self.knobs.whole_layers) if layer < spec.num_layers]
        budgets = [0] * spec.num_layers
        for layer in whole:
            budgets[layer] = min(layer_scores[layer].numel(), total)
            total -= budgets[layer]
        shared = [layer for layer in range(spec.num_layers) if layer not in whole]
        if not shared:
            return budgets
        scores = [layer_scores[layer] for layer in shared]
        if self.knobs.layer_scale == "standardised":
            scores = standardised_per_layer(scores)
        floor = min(math.floor(self.knobs.layer_floor * spec.num_kv_heads * layout.selected_per_head), total // len(shared))
        for layer, budget in zip(shared, global_top_k_layer_budgets(scores, total, floor).tolist()):
            budgets[layer] = budget
        return budgets

    def head_counts(self, sorted_scores: torch.Tensor, layer_budget: int) -> torch.Tensor:
        return adaptive_head_counts(sorted_scores, layer_budget, alpha=0.0)
