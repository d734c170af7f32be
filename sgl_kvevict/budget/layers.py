"""How a segment's candidate budget splits over layers: PyramidKV's fixed schedule and LAVa's
entropy-proportional dynamic budgets. Both keep the request total exact (``apportion``)."""

from __future__ import annotations

import torch

from sgl_kvevict.budget.apportion import apportion


def pyramid_head_budgets(selected_per_head: int, num_layers: int, num_candidates: int, beta: int) -> torch.Tensor:
    """int64 ``[L]``: candidates kept per KV head in each layer, decreasing linearly with depth.

    The Ada-KV code's PyramidKV schedule (Ada-KV digest §2.4) with ``base = selected_per_head``:
    the last layer gets ``base // beta``, the first ``2 base - base // beta`` (clamped to the
    candidates, the slope adjusting so the mean stays ``base``). The code's integer ``steps`` makes
    the layers sum to more than ``L * base``; here the linear schedule is apportioned exactly, so
    the layers sum to ``L * base``.
    """
    last = selected_per_head // beta
    first = 2 * selected_per_head - last
    if first > num_candidates:
        first, last = num_candidates, 2 * selected_per_head - num_candidates
    depth = torch.arange(num_layers, dtype=torch.float64) / max(num_layers - 1, 1)
    schedule = first - (first - last) * depth
    caps = torch.full((num_layers,), num_candidates, dtype=torch.int64)
    return apportion(num_layers * selected_per_head, schedule, caps)


def score_entropy(scores: torch.Tensor) -> float:
    """LAVa's layer uncertainty (Eq. 6-7): entropy of the layer's scores normalised to a distribution.

    The paper divides by ``H N`` and the code by ``log(H_kv (N - w))``: both are the same constant
    for every layer of a segment, so budgets proportional to it are unchanged; it is left out.
    """
    probabilities = scores.flatten().double()
    probabilities = probabilities / (probabilities.sum() + 1e-16)
    return float(-(probabilities * torch.log(probabilities + 1e-16)).sum())


def entropy_layer_budgets(entropies: list[float], total: int, candidates_per_layer: int) -> torch.Tensor:
    """int64 ``[L]``: candidates kept per layer (summed over heads), ``B_l = e_l / sum(e) * total``
    (LAVa Algorithm 2 line 10), exact and capped at ``candidates_per_layer``.

    The code truncates and leaves a layer whose share exceeds its candidates uncompressed without
    passing the surplus on (LAVa digest §2.2, §8 item 8); here the surplus goes to the other layers
    so the request keeps exactly its budget.
    """
    caps = torch.full((len(entropies),), candidates_per_layer, dtype=torch.int64)
    return apportion(total, torch.tensor(entropies, dtype=torch.float64), caps)
