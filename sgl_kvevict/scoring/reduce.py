"""Reductions shared by the scorers: GQA (query heads -> KV heads) and pooling along positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reduce_gqa(scores: torch.Tensor, num_kv_heads: int, how: str) -> torch.Tensor:
    """``[H_q, n]`` -> ``[H_kv, n]`` over each KV head's group of ``H_q / H_kv`` consecutive query heads.

    how: ``mean`` (SnapKV, Ada-KV), ``max`` (LAVa: keep an entry if one head of the group needs it),
        ``sum`` (OBCache Eq. 33-35: the group's summed output error).
    """
    grouped = scores.view(num_kv_heads, -1, scores.shape[-1])
    if how == "mean":
        return grouped.mean(1)
    if how == "max":
        return grouped.amax(1)
    return grouped.sum(1)


def pool_positions(scores: torch.Tensor, how: str, kernel: int) -> torch.Tensor:
    """Smooth ``[H, n]`` scores along positions with a centred window of odd ``kernel`` (stride 1).

    SnapKV's max-pooling keeps the neighbours of a high-scoring token, so kept segments stay
    contiguous enough to carry meaning. ``how`` is ``max``, ``avg`` or ``none``.
    """
    if how == "none" or kernel == 1:
        return scores
    pool = F.max_pool1d if how == "max" else F.avg_pool1d
    return pool(scores.unsqueeze(0), kernel_size=kernel, stride=1, padding=kernel // 2).squeeze(0)
