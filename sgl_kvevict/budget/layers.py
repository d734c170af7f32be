"""How a segment's candidate budget splits over layers: PyramidKV's fixed schedule, LAVa's
entropy-proportional dynamic budgets and KVzip's global top-k (of raw or per-layer standardised
scores). All keep the request total exact."""

from __future__ import annotations

import torch

from sgl_kvevict.budget.apportion import apportion


def pyramid_head_budgets(selected_per_head: int, num_layers: int, num_candidates: int, beta: int) -> torch.Tensor:
    """int64 ``[L]``: candidates kept per KV head in each layer, decreasing linearly with depth.

    The Ada-KV code's PyramidKV schedule (docs/methods/baselines.md#pyramidkv-schedule) with ``base = selected_per_head``:
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


def score_entropy(scores: torch.Tensor, log_scores: bool = False) -> float:
    """LAVa's layer uncertainty (Eq. 6-7): entropy of the layer's scores normalised to a distribution.

    The paper divides by ``H N`` and the code by ``log(H_kv (N - w))``: both are the same constant
    for every layer of a segment, so budgets proportional to it are unchanged; it is left out.

    log_scores: the scores are logs of non-negative scores (a learned scorer's predictions of log
        KVzip scores): the distribution is then ``exp(scores)`` normalised, their softmax, so that
        either form of a score gives the entropy of the same distribution.
    """
    flat = scores.flatten().double()
    if log_scores:
        log_probabilities = torch.log_softmax(flat, dim=0)
        return float(-(log_probabilities.exp() * log_probabilities).sum())
    probabilities = flat / (flat.sum() + 1e-16)
    return float(-(probabilities * torch.log(probabilities + 1e-16)).sum())


def entropy_layer_budgets(entropies: list[float], total: int, candidates_per_layer: int) -> torch.Tensor:
    """int64 ``[L]``: candidates kept per layer (summed over heads), ``B_l = e_l / sum(e) * total``
    (LAVa Algorithm 2 line 10), exact and capped at ``candidates_per_layer``.

    The code truncates and leaves a layer whose share exceeds its candidates uncompressed without
    passing the surplus on (docs/methods/lava.md#a-full-layer-passes-its-surplus-on); here the surplus goes to the other layers
    so the request keeps exactly its budget.
    """
    caps = torch.full((len(entropies),), candidates_per_layer, dtype=torch.int64)
    return apportion(total, torch.tensor(entropies, dtype=torch.float64), caps)


def global_top_k_layer_budgets(layer_scores: list[torch.Tensor], total: int, floor: int = 0) -> torch.Tensor:
    """int64 ``[L]``: how many of the ``total`` best entries over every (layer, KV head, candidate) of a
    segment lie in each layer (KVzip's allocation: one top-k over all layers and heads), after every
    layer first keeps its own ``floor`` best entries.

    With ``floor = 0`` this is KVzip's top-k, no floor. A floor is the layer-level twin of Ada-KV's
    head safeguard (``adaptive_head_counts``): no layer's share can fall below it, whatever the scale
    of its scores, and the rest still goes where the scores are highest. Each layer then keeps its
    own top entries across heads (``adaptive_head_counts`` with ``alpha = 0``), which together are
    the floors plus the global top-k of what remains (equal scores at the threshold: the lower layer).

    layer_scores: ``[H_kv, n]`` per layer, comparable across layers.
    total: ``<= L * H_kv * n``; floor: ``<= min(total / L, H_kv * n)``.
    """
    # Each layer's entries best first: its floor is the first ``floor``, and the stable sort of the
    # rest keeps the lower layer first among equal scores, as the plain top-k of the unsorted scores.
    remaining = torch.cat([torch.sort(scores.flatten(), descending=True, stable=True).values[floor:] for scores in layer_scores])
    winners = torch.sort(remaining, descending=True, stable=True).indices[: total - floor * len(layer_scores)]
    return torch.bincount(winners // (layer_scores[0].numel() - floor), minlength=len(layer_scores)).cpu() + floor


def standardised_per_layer(layer_scores: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each layer's ``[H_kv, n]`` scores shifted and scaled to mean 0 and standard deviation 1 over the
    whole layer (every head and candidate; a layer of equal scores becomes all 0).

    A global top-k of these keeps, in every layer, the entries that stand out from that layer's own
    scores: a layer whose scores are low and flat (the broad attention of the first layers) is no
    longer starved by layers whose scores are high. One shift and scale per layer leaves the order
    inside the layer, so each layer's heads still split its budget by their raw scores.
    """
    scaled = []
    for scores in layer_scores:
        flat = scores.double()
        spread = flat.std(correction=0)
        scaled.append((flat - flat.mean()) / spread if spread > 0 else torch.zeros_like(flat))
    return scaled
