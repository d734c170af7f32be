"""Ada-KV (Feng et al. 2025): the layer's budget goes to its best entries across all KV heads
(Algorithm 1), with a uniform floor of ``alpha`` of the per-head share (the safeguard).

Ada-SnapKV uses SnapKV's layer budgets, Ada-PyramidKV PyramidKV's; scores are SnapKV's (GQA mean,
max-pool 7), an OBCache score or a question-agnostic one (KVzip, learned). See ``adaptive_head_counts`` for the exact-total safeguard.
"""

from __future__ import annotations

import torch

from sgl_kvevict.budget.heads import adaptive_head_counts
from sgl_kvevict.policies.base import PolicyDefaults, register_policy
from sgl_kvevict.policies.pyramidkv import PyramidKVPolicy
from sgl_kvevict.policies.scored import ScoredPolicy
from sgl_kvevict.scoring import SCORES


class AdaptiveHeads:
    """Mixin: Ada-KV's head split in place of the uniform one."""

    def head_counts(self, sorted_scores: torch.Tensor, layer_budget: int) -> torch.Tensor:
        return adaptive_head_counts(sorted_scores, layer_budget, self.config.alpha)


@register_policy("ada-snapkv")
class AdaSnapKVPolicy(AdaptiveHeads, ScoredPolicy):
    defaults = PolicyDefaults(window=32, pooling="max", gqa="mean", scores=SCORES)


@register_policy("ada-pyramidkv")
class AdaPyramidKVPolicy(AdaptiveHeads, PyramidKVPolicy):
    defaults = PolicyDefaults(window=32, pooling="max", gqa="mean", scores=SCORES)
