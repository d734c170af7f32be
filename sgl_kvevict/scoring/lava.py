"""LAVa score (Definition 1, Eq. 5): window attention scaled by the head's largest value norm.

``s[g, p] = GQA_max_{h in g} pool(mean_i A[h, i, p]) * Vbar[g]`` with
``Vbar[g] = max_{p in candidates} ||v_p||_1``, one scalar per KV head. The scalar makes scores
comparable across the heads of a layer (the bound of Theorem 1 sums ``A * Vbar`` over heads), which
is what justifies LAVa's layer-wise top-k.

Order (docs/methods/lava.md#order-of-pooling-value-scaling-and-gqa): pooling per query head first, then scaling, then GQA. With
max-pooling and GQA max (the defaults) every order gives the same result; with other choices this
is the code's order. ``Vbar`` is taken over the candidates only, as the code does (it excludes the
window; here it also excludes a prefix before the segment, which is not evictable either).
"""

from __future__ import annotations

import torch

from sgl_kvevict.scoring.base import Scorer
from sgl_kvevict.scoring.reduce import reduce_gqa
from sgl_kvevict.scoring.window import StatsRequest, WindowStats


class LavaScorer(Scorer):
    request = StatsRequest(attn_sum=True, value_l1=True)

    def __call__(self, stats: WindowStats, candidates: slice, num_kv_heads: int, layer: int) -> torch.Tensor:
        mean_attention = self.reduction.pool(stats.attn_sum[:, candidates] / stats.window)  # [H_q, n]
        max_value_norm = stats.value_l1[:, candidates].amax(-1)  # [H_kv]
        group = mean_attention.shape[0] // num_kv_heads
        scaled = mean_attention * max_value_norm.repeat_interleave(group).unsqueeze(-1)
        return reduce_gqa(scaled, num_kv_heads, self.reduction.gqa)
