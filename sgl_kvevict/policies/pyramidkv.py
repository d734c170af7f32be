"""PyramidKV (Cai et al. 2024): SnapKV scores with layer budgets decreasing linearly with depth
(``pyramid_beta`` sets the last layer to 1/beta of the average), uniform over heads; or a
question-agnostic score (KVzip, learned) with the same schedule."""

from __future__ import annotations

import torch

from sgl_kvevict.budget.layers import pyramid_head_budgets
from sgl_kvevict.policies.base import PolicyDefaults, register_policy
from sgl_kvevict.policies.layout import SegmentLayout
from sgl_kvevict.policies.scored import ScoredPolicy
from sgl_kvevict.scoring import QUESTION_AGNOSTIC_SCORES


@register_policy("pyramidkv")
class PyramidKVPolicy(ScoredPolicy):
    defaults = PolicyDefaults(window=32, pooling="max", gqa="mean", scores=("attn", *QUESTION_AGNOSTIC_SCORES))

    def layer_budgets(self, layout: SegmentLayout, layer_scores: list[torch.Tensor]) -> list[int]:
        per_head = pyramid_head_budgets(
            layout.selected_per_head, layout.spec.num_layers, layout.num_candidates, self.config.pyramid_beta
        )
        return (per_head * layout.spec.num_kv_heads).tolist()
