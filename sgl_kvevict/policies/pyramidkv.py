"""PyramidKV (Cai et al. 2024): SnapKV scores with layer budgets decreasing linearly with depth
(``pyramid_beta`` sets the last layer to 1/beta of the average), uniform over heads; or a
question-agnostic score (KVzip, learned) with the same schedule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvevict.budget.layers import pyramid_head_budgets
from sgl_kvevict.policies.base import PolicyDefaults, register_policy
from sgl_kvevict.policies.layout import SegmentLayout
from sgl_kvevict.policies.scored import ScoredPolicy
from sgl_kvevict.scoring import QUESTION_AGNOSTIC_SCORES
from sgl_kvevict.settings import Settings, int_at_least, setting


@dataclass(frozen=True)
class PyramidKnobs(Settings):
    pyramid_beta: int = setting(
        20,
        help="PyramidKV: ratio between the average and the last layer's budget",
        valid=(int_at_least(1), "pyramid beta {value!r} must be an integer >= 1"),
    )


@register_policy("pyramidkv")
class PyramidKVPolicy(ScoredPolicy):
    defaults = PolicyDefaults(window=32, pooling="max", gqa="mean", scores=("attn", *QUESTION_AGNOSTIC_SCORES))
    knobs_type = PyramidKnobs
    knobs: PyramidKnobs

    def layer_budgets(self, layout: SegmentLayout, layer_scores: list[torch.Tensor]) -> list[int]:
        per_head = pyramid_head_budgets(
            layout.selected_per_head, layout.spec.num_layers, layout.num_candidates, self.knobs.pyramid_beta
        )
        return (per_head * layout.spec.num_kv_heads).tolist()

    def plans_each_head_alone(self) -> bool:
        return type(self).head_counts is ScoredPolicy.head_counts  # the pyramid reads no scores

