"""Head-wise eviction as a keep mask over a dense cache, and window statistics over what is kept.

The reference engine never moves KV entries: the HF cache stays dense (index = absolute position)
and eviction is a bool mask ``[num_layers, H_kv, positions]``. Attention turns the mask into
``-inf`` logits for evicted keys, so they get exactly zero softmax weight: the output is the softmax
over the kept keys only, which is what a cache that physically dropped them computes (the tests check
this against a per-head gathered cache). Pure torch: no transformers import here.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.scoring.window import StatsRequest, WindowStats, window_stats


class HeadwiseKeepMask:
    """Which (layer, KV head, position) entries of one sequence attention may still see.

    Positions not covered by a plan are kept. The mask grows with the sequence (amortised doubling).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, capacity: int = 1024):
        self._keep = torch.ones(num_layers, num_kv_heads, max(capacity, 1), dtype=torch.bool)
        self._layers_with_evictions: set[int] = set()

    @property
    def num_kv_heads(self) -> int:
        return self._keep.shape[1]

    def reserve(self, length: int) -> None:
        """Make room for positions ``[0, length)``."""
        capacity = self._keep.shape[2]
        if length > capacity:
            grown = torch.ones(*self._keep.shape[:2], max(length, 2 * capacity), dtype=torch.bool)
            grown[:, :, :capacity] = self._keep
            self._keep = grown

    def apply(self, plan: CompressionPlan) -> None:
        """Evict every entry of the plan's segment that the plan does not keep."""
        self.reserve(plan.segment_end)
        for layer in range(plan.num_layers):
            segment_keep = plan.keep_mask(layer)
            self._keep[layer, :, plan.segment_start : plan.segment_end] = segment_keep
            if not bool(segment_keep.all()):
                self._layers_with_evictions.add(layer)

    def has_evictions(self, layer: int) -> bool:
        return layer in self._layers_with_evictions

    def kept(self, layer: int, length: int) -> torch.Tensor:
        """bool ``[H_kv, length]``: kept entries of positions ``[0, length)`` in ``layer``."""
        return self._keep[layer, :, :length]

    def attention_mask(
        self, layer: int, visible: torch.Tensor | None, query_length: int, key_length: int, num_q_heads: int
    ) -> torch.Tensor | None:
        """The mask for one attention call of ``query_length`` new tokens over ``key_length`` cached ones.

        visible: the model's own bool mask ``[1, 1, q, k]`` (True = may attend) or ``None`` for plain
            causal attention. Returned unchanged when nothing of ``layer`` is evicted, so an uncompressed
            sequence runs the model's exact attention path.
        Returns bool ``[1, H_q, q, k]`` otherwise.
        """
        if not self.has_evictions(layer):
            return visible
        if visible is None:
            query_positions = torch.arange(key_length - query_length, key_length).view(query_length, 1)
            visible = (torch.arange(key_length).view(1, key_length) <= query_positions).view(1, 1, query_length, key_length)
        elif visible.dtype != torch.bool:
            raise TypeError(f"expected the model's boolean attention mask, got {visible.dtype}")
        group = num_q_heads // self.num_kv_heads
        kept = self.kept(layer, key_length).repeat_interleave(group, 0)  # [H_q, k]
        return visible & kept.view(1, num_q_heads, 1, key_length).to(visible.device)


def window_stats_over_kept(
    q_window: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
    scaling: float,
    request: StatsRequest,
) -> WindowStats:
    """``window_stats`` when some earlier entries are already evicted, per KV head.

    q_window: ``[H_q, w, D]``; keys, values: ``[H_kv, L, D]``; kept: bool ``[H_kv, L]`` (the window
    ``[L - w, L)`` must be kept). The softmax of each head runs over its kept keys only, as in an engine
    that reuses a compressed prefix; evicted columns of every statistic are 0 (they get no attention).
    """
    num_q_heads, window, _ = q_window.shape
    num_kv_heads, length, _ = keys.shape
    if bool(kept.all()):
        return window_stats(q_window, keys, values, scaling, request)
    if not bool(kept[:, length - window :].all()):
        raise ValueError("the observation window of a segment cannot contain evicted entries")
    group = num_q_heads // num_kv_heads
    # Gathering keeps the window as the last `w` keys of each head, so window_stats' causal mask, which
    # counts from the end, stays right in the gathered index space.
    per_head = []
    for head in range(num_kv_heads):
        positions = kept[head].nonzero().squeeze(1)
        per_head.append(
            (
                positions,
                window_stats(
                    q_window[head * group : (head + 1) * group],
                    keys[head : head + 1, positions],
                    values[head : head + 1, positions],
                    scaling,
                    request,
                ),
            )
        )
    scattered: dict[str, torch.Tensor] = {}
    for field in fields(WindowStats):
        if field.name == "window" or getattr(per_head[0][1], field.name) is None:
            continue
        columns = []
        for positions, stats in per_head:
            head_stat = getattr(stats, field.name)
            full = head_stat.new_zeros(*head_stat.shape[:-1], length)
            full[..., positions] = head_stat
            columns.append(full)
        scattered[field.name] = torch.cat(columns)
    return WindowStats(window=window, **scattered)
