"""SegmentLayout: where a segment's candidates and window lie, and what its budget allows.

Positions are absolute. Of a segment ``[start, end)`` the last ``window`` tokens are always kept;
the candidates for eviction are ``[start, window_start)``. ``WindowStats`` columns cover ``[0, end)``
(a prefix before ``start`` is visible to the softmax, but not evictable here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from sgl_kvevict.plan import CompressionPlan, LayerPlan
from sgl_kvevict.policies.base import SegmentSpec

if TYPE_CHECKING:
    from sgl_kvevict.config import EvictionConfig


@dataclass(frozen=True)
class SegmentLayout:
    """Geometry and budget of one segment under one config.

    per_head_budget: average kept entries per (layer, KV head), window included; ``None`` for
        policies that decide their budget themselves. A budget below the window keeps the window
        (window tokens are never evicted), so the kept fraction is then above the budget.
    compresses: False when the segment is kept whole: shorter than ``min_segment_length``, no
        candidates, or not longer than its per-head budget.
    """

    spec: SegmentSpec
    window_start: int
    per_head_budget: Optional[int]
    compresses: bool

    @classmethod
    def of(cls, spec: SegmentSpec, config: "EvictionConfig") -> "SegmentLayout":
        window = min(config.window, spec.length)
        window_start = spec.end - window
        per_head = config.budget.per_head(spec.length) if config.budget is not None else None
        num_candidates = window_start - spec.start
        fits_budget = per_head is not None and num_candidates <= max(per_head - window, 0)
        compresses = spec.length >= config.min_segment_length and num_candidates > 0 and not fits_budget
        return cls(spec, window_start, per_head, compresses)

    @property
    def window(self) -> int:
        return self.spec.end - self.window_start

    @property
    def num_candidates(self) -> int:
        return self.window_start - self.spec.start

    @property
    def candidate_columns(self) -> slice:
        """The candidate columns of a ``WindowStats`` tensor (whose columns are positions ``[0, end)``)."""
        return slice(self.spec.start, self.window_start)

    @property
    def selected_per_head(self) -> int:
        """Average candidates kept per (layer, KV head): the per-head budget minus the window."""
        return max(self.per_head_budget - self.window, 0)

    def window_positions(self) -> torch.Tensor:
        """int64 ``[window]``."""
        return torch.arange(self.window_start, self.spec.end, dtype=torch.int64)

    def keep_all(self) -> CompressionPlan:
        spec = self.spec
        return CompressionPlan.keep_all(spec.start, spec.end, spec.num_layers, spec.num_kv_heads)

    def layer_plan(self, kept_candidates: list[torch.Tensor]) -> LayerPlan:
        """Per KV head, the kept candidate offsets (0 = ``start``) plus the window, as a ``LayerPlan``."""
        window = self.window_positions()
        return LayerPlan.from_heads([torch.cat([offsets + self.spec.start, window]) for offsets in kept_candidates])

    def plan(self, layers: list[LayerPlan]) -> CompressionPlan:
        return CompressionPlan(self.spec.start, self.spec.end, tuple(layers))
