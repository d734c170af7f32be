"""SnapKV (Li et al. 2024): the window's mean attention, max-pooled, top-k per KV head, same budget
in every layer and head. GQA by the group mean (the Ada-KV code's GQA support)."""

from __future__ import annotations

from sgl_kvevict.policies.base import PolicyDefaults, register_policy
from sgl_kvevict.policies.scored import ScoredPolicy
from sgl_kvevict.scoring import SCORES


@register_policy("snapkv")
class SnapKVPolicy(ScoredPolicy):
    defaults = PolicyDefaults(window=32, pooling="max", gqa="mean", scores=SCORES)
