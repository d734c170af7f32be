"""LAVa (Shen et al. 2025): value-norm-scaled window attention, a layer-wise top-k over KV heads,
and layer budgets proportional to the entropy of each layer's scores.

* Score: ``LavaScorer`` (GQA max, max-pool 7).
* Heads: the layer's budget goes to its best entries across heads with the same alpha floor as
  Ada-KV (the LAVa code's ``floor_alpha = 0.2``, absent from the paper; ``alpha = 0`` is the paper's
  pure layer-wise top-k). The floor is ``alpha`` of the layer's own per-head average, the code's
  intended variant (LAVa digest §8 item 7; its typo uses the configured budget instead).
* Layers: ``B_l = e_l / sum(e) * total`` over every layer at once, after the last layer. The paper
  re-splits the budget after each prefilled layer and shrinks lower layers (a cascade); budgets
  only shrink and selections are nested, so the final cache is this one-shot one (digest §2.5;
  tested in ``test_policies.py``).
"""

from __future__ import annotations

import torch

from sgl_kvevict.budget.layers import entropy_layer_budgets, score_entropy
from sgl_kvevict.policies.adakv import AdaptiveHeads
from sgl_kvevict.policies.base import PolicyDefaults, register_policy
from sgl_kvevict.policies.layout import SegmentLayout
from sgl_kvevict.policies.scored import ScoredPolicy
from sgl_kvevict.scoring import LavaScorer, Reduction, Scorer


@register_policy("lava")
class LavaPolicy(AdaptiveHeads, ScoredPolicy):
    defaults = PolicyDefaults(window=32, pooling="max", gqa="max")

    def build_scorer(self) -> Scorer:
        return LavaScorer(Reduction.from_config(self.config))

    def layer_budgets(self, layout: SegmentLayout, layer_scores: list[torch.Tensor]) -> list[int]:
        spec = layout.spec
        total = spec.num_layers * spec.num_kv_heads * layout.selected_per_head
        entropies = [score_entropy(scores) for scores in layer_scores]
        return entropy_layer_budgets(entropies, total, spec.num_kv_heads * layout.num_candidates).tolist()
