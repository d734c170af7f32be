"""Ada-KV (Feng et al. 2025): the layer's budget goes to its best entries across all KV heads
(Algorithm 1), with a uniform floor of ``alpha`` of the per-head share (the safeguard).

``alpha`` is declared once here (``HeadFloorKnobs``) and taken by every policy whose knobs include
it: ada-snapkv, ada-pyramidkv (with PyramidKV's ``pyramid_beta``) and LAVa.

Ada-SnapKV uses SnapKV's layer budgets, Ada-PyramidKV PyramidKV's; scores are SnapKV's (GQA mean,
max-pool 7), an OBCache score or a question-agnostic one (KVzip, learned). See ``adaptive_head_counts`` for the exact-total safeguard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvevict.budget.heads import adaptive_head_counts
from sgl_kvevict.policies.base import PolicyDefaults, register_policy
from sgl_kvevict.policies.pyramidkv import PyramidKnobs, PyramidKVPolicy
from sgl_kvevict.policies.scored import ScoredPolicy
from sgl_kvevict.scoring import SCORES
from sgl_kvevict.settings import Settings, setting


@dataclass(frozen=True)
class HeadFloorKnobs(Settings):
    alpha: float = setting(
        0.2,
        help="Ada-KV safeguard and LAVa head floor: fraction of the uniform per-head share every KV head is "
        "guaranteed (the code's meaning; the Ada-KV paper prints it swapped)",
        valid=(
            lambda alpha: isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0,
            "alpha {value!r} must be in [0, 1] (the guaranteed uniform share per head)",
        ),
    )


@dataclass(frozen=True)
class AdaPyramidKVKnobs(PyramidKnobs, HeadFloorKnobs):
    """Ada-KV's floor over PyramidKV's layer budgets: both knobs, each declared by its own method."""


class AdaptiveHeads:
    """Mixin: Ada-KV's head split in place of the uniform one."""

    knobs: HeadFloorKnobs

    def head_counts(self, sorted_scores: torch.Tensor, layer_budget: int) -> torch.Tensor:
        return adaptive_head_counts(sorted_scores, layer_budget, self.knobs.alpha)


@register_policy("ada-snapkv")
class AdaSnapKVPolicy(AdaptiveHeads, ScoredPolicy):
    defaults = PolicyDefaults(window=32, pooling="max", gqa="mean", scores=SCORES)
    knobs_type = HeadFloorKnobs


@register_policy("ada-pyramidkv")
class AdaPyramidKVPolicy(AdaptiveHeads, PyramidKVPolicy):
    defaults = PolicyDefaults(window=32, pooling="max", gqa="mean", scores=SCORES)
    knobs_type = AdaPyramidKVKnobs
