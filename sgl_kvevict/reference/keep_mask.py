"""Head-wise eviction as a keep mask over a dense cache.

The reference engine never moves KV entries: the HF cache stays dense (index = absolute position)
and eviction is a bool mask ``[num_layers, H_kv, positions]``. Attention turns the mask into
``-inf`` logits for evicted keys, so they get exactly zero softmax weight: the output is the softmax
over the kept keys only, which is what a cache that physically dropped them computes (the tests check
this against a per-head gathered cache). Pure torch: no transformers import here.
"""

from __future__ import annotations

import torch

from sgl_kvevict.plan import CompressionPlan


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

    @torch.inference_mode()
    def restore(self, positions: torch.Tensor) -> None:
        """Make ``positions`` (int64 ``[n]``, already reserved) visible again in every layer and KV head:
        the probes' oracle for "what if every plan had kept them". (The mask is made in the engine's
        inference mode, so it is updated in it.)"""
        self._keep[:, :, positions] = True

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
