"""SegmentLayout: where a segment's sinks, candidates and window lie, and what its budget allows.

Positions are absolute. A segment ``[start, end)`` is cut into

* sinks ``[start, candidate_start)``: the sequence's first ``sink_tokens`` positions that fall in
  the segment (only a segment starting before ``sink_tokens`` has any), always kept;
* candidates ``[candidate_start, window_start)``: what a policy selects from;
* the window ``[window_start, end)``: the last ``window`` tokens, always kept.

Sinks and window are part of every plan and count in the budget. ``WindowStats`` columns cover
``[0, end)`` (a prefix before ``start`` is visible to the softmax, but not evictable here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from sgl_kvevict.settings import CommonSettings
from sgl_kvevict.plan import CompressionPlan, LayerPlan
from sgl_kvevict.policies.base import SegmentSpec


@dataclass(frozen=True)
class SegmentLayout:
    """Geometry and budget of one segment under one policy's common settings.

    per_head_budget: average kept entries per (layer, KV head), sinks and window included; ``None``
        for policies that decide their budget themselves.
    compresses: False when the segment is kept whole: shorter than ``min_segment_length``, no
        candidates, a budget that leaves none to select (at most sinks + window) or that keeps them all.
    """

    spec: SegmentSpec
    candidate_start: int
    window_start: int
    per_head_budget: Optional[int]
    compresses: bool

    @classmethod
    def of(cls, spec: SegmentSpec, common: CommonSettings) -> "SegmentLayout":
        window_start = spec.end - min(common.window, spec.length)
        candidate_start = min(max(spec.start, common.sink_tokens), window_start)
        per_head = common.budget.per_head(spec.length) if common.budget is not None else None
        num_candidates = window_start - candidate_start
        if per_head is None:
            selects = num_candidates > 0
        else:
            selected = per_head - (spec.end - window_start) - (candidate_start - spec.start)
            selects = 0 < selected < num_candidates
        compresses = spec.length >= common.min_segment_length and selects
        return cls(spec, candidate_start, window_start, per_head, compresses)

    @property
    def window(self) -> int:
        return self.spec.end - self.window_start

    @property
    def num_sinks(self) -> int:
        return self.candidate_start - self.spec.start

    @property
    def num_candidates(self) -> int:
        return self.window_start - self.candidate_start

    @property
    def candidate_columns(self) -> slice:
        """The candidates' positions, which are also their columns in a ``WindowStats`` tensor."""
        return slice(self.candidate_start, self.window_start)

    @property
    def selected_per_head(self) -> int:
        """Average candidates kept per (layer, KV head): the per-head budget minus sinks and window."""
        return self.per_head_budget - self.window - self.num_sinks

    def with_selected(self, selected_per_head: int) -> "SegmentLayout":
        """The same geometry with ``selected_per_head`` candidates kept per (layer, KV head) on average
        (a score threshold decides it per segment, under the budget)."""
        return dataclasses.replace(self, per_head_budget=selected_per_head + self.window + self.num_sinks)

    def always_kept(self) -> torch.Tensor:
        """int64 ``[sinks + window]``: the positions every (layer, KV head) keeps."""
        sinks = torch.arange(self.spec.start, self.candidate_start, dtype=torch.int64)
        return torch.cat([sinks, torch.arange(self.window_start, self.spec.end, dtype=torch.int64)])

    def keep_all(self) -> CompressionPlan:
        spec = self.spec
        return CompressionPlan.keep_all(spec.start, spec.end, spec.num_layers, spec.num_kv_heads)

    def layer_plan(self, kept_candidates: list[torch.Tensor]) -> LayerPlan:
        """Per KV head, the kept candidate offsets (0 = ``candidate_start``) plus sinks and window."""
        always = self.always_kept()
        return LayerPlan.from_heads(
            [torch.cat([offsets.cpu() + self.candidate_start, always]) for offsets in kept_candidates]
        )

    def plan(self, layers: list[LayerPlan]) -> CompressionPlan:
        return CompressionPlan(self.spec.start, self.spec.end, tuple(layers))
