"""LAVa (Shen et al. 2025): value-norm-scaled window attention, a layer-wise top-k over KV heads,
and layer budgets proportional to the entropy of each layer's scores.

* Score: ``LavaScorer`` (GQA max, max-pool 7), or a question-agnostic score (``kvzip``,
  ``learned``) in its place, for prefixes reused by later questions. LAVa's value-norm factor makes
  window attention comparable across heads; KVzip scores are already attention probabilities of
  one reconstruction, and learned scores predict their logs, so neither is rescaled.
* Heads: the layer's budget goes to its best entries across heads with the same alpha floor as
  Ada-KV (the LAVa code's ``floor_alpha = 0.2``, absent from the paper; ``alpha = 0`` is the paper's
  pure layer-wise top-k). The floor is ``alpha`` of the layer's own per-head average, the code's
  intended variant (docs/methods/lava.md#head-floor-from-the-layer-budget; its typo uses the configured budget instead).
* Layers: ``B_l = e_l / sum(e) * total`` over every layer at once, after the last layer. The paper
  re-splits the budget after each prefilled layer and shrinks lower layers (a cascade); budgets
  only shrink and selections are nested, so the final cache is this one-shot one (docs/methods/lava.md#one-shot-equals-the-cascade;
  tested in ``test_policies.py``). ``e_l`` is the entropy of the layer's scores normalised to a
  distribution; log scores (learned) are exponentiated first (a softmax), so both question-agnostic
  scores give the entropy of the same quantity, the KVzip score (``score_entropy``).
"""

from __future__ import annotations

import torch

from sgl_kvevict.budget.layers import entropy_layer_budgets, score_entropy
from sgl_kvevict.policies.adakv import AdaptiveHeads, HeadFloorKnobs
from sgl_kvevict.policies.base import PolicyDefaults, register_policy
from sgl_kvevict.policies.layout import SegmentLayout
from sgl_kvevict.policies.scored import ScoredPolicy
from sgl_kvevict.scoring import QUESTION_AGNOSTIC_SCORES, LavaScorer, Reduction, Scorer, scorer_for


@register_policy("lava")
class LavaPolicy(AdaptiveHeads, ScoredPolicy):
    defaults = PolicyDefaults(window=32, pooling="max", gqa="max", scores=("attn", *QUESTION_AGNOSTIC_SCORES))
    knobs_type = HeadFloorKnobs

    def build_scorer(self) -> Scorer:
        if self.common.score == "attn":
            return LavaScorer(Reduction.of(self.common))
        return scorer_for(self.common, self.score_knobs)

    def layer_budgets(self, layout: SegmentLayout, layer_scores: list[torch.Tensor]) -> list[int]:
        spec = layout.spec
        total = spec.num_layers * spec.num_kv_heads * layout.selected_per_head
        entropies = [score_entropy(scores, self.scorer.log_scores) for scores in layer_scores]
        return entropy_layer_budgets(entropies, total, spec.num_kv_heads * layout.num_candidates).tolist()
