"""How a layer's candidate budget splits over its KV heads, and which candidates each head keeps.

Every head keeps a prefix of its own candidates ranked by score, so a split is just per-head counts.
Ranking is a stable descending sort: equal scores keep the earlier position first, which makes
plans deterministic.
"""

from __future__ import annotations

import math

import torch


def rank_candidates(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[H, n]`` scores -> (scores sorted descending ``[H, n]``, candidate offsets in that order ``[H, n]``)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True)


def kept_offsets(ranked_offsets: torch.Tensor, counts: torch.Tensor) -> list[torch.Tensor]:
    """Per head, its ``counts[h]`` best candidate offsets (from ``rank_candidates``)."""
    return [ranked_offsets[head, :count] for head, count in enumerate(counts.tolist())]


def uniform_head_counts(layer_budget: int, num_heads: int) -> torch.Tensor:
    """int64 ``[H]``: ``layer_budget`` split evenly; the remainder of the division goes to the lowest heads."""
    counts = torch.full((num_heads,), layer_budget // num_heads, dtype=torch.int64)
    counts[: layer_budget % num_heads] += 1
    return counts


def adaptive_head_counts(sorted_scores: torch.Tensor, layer_budget: int, alpha: float) -> torch.Tensor:
    """int64 ``[H]``: Ada-KV's allocation with safeguard, exact-total variant (docs/methods/adakv.md#exact-total-safeguard).

    Every head first gets its own top ``floor(alpha * layer_budget / H)`` candidates (the uniform
    floor: alpha is the guaranteed fraction of the uniform share); the rest of the layer budget goes
    to the best remaining candidates of the whole layer (Algorithm 1's global top-k). The total is
    exactly ``layer_budget``, and with ``alpha = 0`` this is Algorithm 1 itself: the split retaining
    the most score mass of all splits of the same total (Theorem 3.3).

    The authors' code instead computes ``B_i = round((1 - alpha) f_i + floor(alpha * base))`` from the
    global counts ``f_i``, whose total drifts by rounding; both give each head an alpha floor and
    the rest adaptively, and this one also keeps the chosen set a global top-k above the floor.

    sorted_scores: ``[H, n]`` each head's candidate scores in descending order (``rank_candidates``).
    layer_budget: candidates kept in the layer, ``<= H * n``.
    """
    num_heads = sorted_scores.shape[0]
    floor = math.floor(alpha * layer_budget / num_heads)
    # Rank-major flattening, stably sorted: equal scores go to the better rank, then the lower head,
    # so a tie spreads over heads instead of filling head 0, and each head still keeps a prefix of
    # its own ranking.
    remaining = sorted_scores[:, floor:].t().reshape(-1)
    winners = torch.sort(remaining, descending=True, stable=True).indices[: layer_budget - floor * num_heads]
    return torch.bincount(winners % num_heads, minlength=num_heads).cpu() + floor
