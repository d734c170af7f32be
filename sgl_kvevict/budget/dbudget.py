"""DBudgetKV's stopping rule: evict by position until the attention norm would drop by more than t.

The importance ranking is positional (docs/methods/dbudgetkv.md#position-ranking): the first ``m`` tokens (sinks) rank
highest, the others by recency. Eviction takes the least important first, so the evicted tokens
of a layer are always the oldest non-sink candidates, and the kept set is ``sinks ∪ [stop, end)``.

The rule (docs/methods/dbudgetkv.md#the-stopping-rule-in-closed-form): with ``a`` the reduced attention row of the last query rows, evict the
longest ranked prefix whose removal keeps ``||a_kept|| >= (1 - t) ||a||``. Squaring both sides,
that is ``sum_{evicted} a^2 <= (1 - (1 - t)^2) sum a^2``: one cumulative sum, no square roots.
"""

from __future__ import annotations

import torch


def reduced_attention_mass(tail_attn: torch.Tensor) -> torch.Tensor:
    """fp32 ``[L]``: ``sum_h s[h, p]^2``, the squared entries of the layer's reduced attention ``A'``.

    ``s[h, p]`` is the mean attention of the last ``k`` queries on ``p`` over the rows that may see
    it (Eq. 1, with the sum over the last k rows, the paper's "i = k" being a typo, see
    docs/methods/dbudgetkv.md#last-k-rows-and-causal-counts; the count of
    rows that see ``p`` is causal, not ``!= 0``, so underflow does not change it). Heads are
    combined as the Frobenius norm of the ``H x L`` matrix ("joint", docs/methods/dbudgetkv.md#heads-combined-jointly): one
    stopping index per layer, as in Algorithm 1.

    tail_attn: ``[H_q, k, L]`` attention of the last ``k`` queries (positions ``L - k .. L - 1``).
    """
    return head_attention_mass(tail_attn, 1)[0]


def head_attention_mass(tail_attn: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """fp32 ``[H_kv, L]``: ``reduced_attention_mass``'s sum taken over each KV head's query group only
    (their sum over KV heads is the layer's mass). Ranks that hold different KV heads each compute
    their heads' part; summed in head order, the result does not depend on how heads are spread."""
    num_rows, context = tail_attn.shape[1], tail_attn.shape[2]
    positions = torch.arange(context, device=tail_attn.device)
    rows_seeing = num_rows - (positions - (context - num_rows)).clamp(min=0)  # query rows at or after p
    mean_attention = tail_attn.sum(1) / rows_seeing
    return mean_attention.square().view(num_kv_heads, -1, context).sum(1)


def evicted_prefix_length(mass: torch.Tensor, eviction_order: torch.Tensor, threshold: float) -> int:
    """How many of ``eviction_order`` (least important first) to evict: the largest ``I`` with
    ``sum(mass[eviction_order[:I]]) <= (2t - t^2) * sum(mass)``.

    mass: ``[L]`` squared reduced attention (``reduced_attention_mass``) over all visible positions.
    eviction_order: int64 ``[n]`` the evictable positions, least important first. Positions outside
        it (sinks, window, a prefix before the segment) are never evicted, which keeps the sinks and the last
        token whatever the rule says (docs/methods/dbudgetkv.md#never-evicted-sinks-window-and-prefix).
    """
    allowed = (1.0 - (1.0 - threshold) ** 2) * mass.sum()
    evicted_mass = torch.cumsum(mass[eviction_order], 0)
    return int((evicted_mass <= allowed).sum())
