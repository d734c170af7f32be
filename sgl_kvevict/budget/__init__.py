"""Budget allocation: how many entries each layer and KV head keeps, and which.

* ``heads``: uniform split, Ada-KV's global top-k with alpha floor; per-head ranking.
* ``layers``: PyramidKV schedule, LAVa entropy-proportional layer budgets, KVzip's global top-k, per-layer
  standardised scores for it.
* ``apportion``: the exact integer split both layer allocators use.
* ``dbudget``: DBudgetKV's norm-drop stopping rule (no budget).
"""

from sgl_kvevict.budget.apportion import apportion
from sgl_kvevict.budget.dbudget import evicted_prefix_length, reduced_attention_mass
from sgl_kvevict.budget.heads import adaptive_head_counts, kept_offsets, rank_candidates, uniform_head_counts
from sgl_kvevict.budget.layers import (
    entropy_layer_budgets,
    global_top_k_layer_budgets,
    pyramid_head_budgets,
    score_entropy,
    standardised_per_layer,
)

__all__ = [
    "adaptive_head_counts",
    "apportion",
    "entropy_layer_budgets",
    "evicted_prefix_length",
    "global_top_k_layer_budgets",
    "kept_offsets",
    "pyramid_head_budgets",
    "rank_candidates",
    "reduced_attention_mass",
    "score_entropy",
    "standardised_per_layer",
    "uniform_head_counts",
]
