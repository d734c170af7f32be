"""StreamingLLM (Xiao et al. 2024): attention sinks plus the most recent tokens, no scores.

Per (layer, KV head): the sink positions ``[0, streaming_sinks)`` that fall inside the segment, then
the most recent tokens up to the per-head budget (at least the window). Sinks are absolute
positions: a later segment of the same sequence has none (the first segment kept them).
"""

from __future__ import annotations

import torch

from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies.base import Policy, PolicyDefaults, SegmentCompressor, SegmentSpec, register_policy
from sgl_kvevict.policies.layout import SegmentLayout
from sgl_kvevict.scoring.window import StatsRequest, WindowStats


class _SinksAndRecent(SegmentCompressor):
    needs_stats = False

    def __init__(self, layout: SegmentLayout, num_sinks: int):
        super().__init__(layout.spec)
        self.layout = layout
        self.num_sinks = num_sinks

    def observe(self, layer: int, stats: WindowStats) -> None:
        pass

    def plan(self) -> CompressionPlan:
        layout = self.layout
        if not layout.compresses:
            return layout.keep_all()
        sinks_in_segment = max(min(self.num_sinks, layout.window_start) - layout.spec.start, 0)
        num_sinks = min(sinks_in_segment, layout.selected_per_head)
        num_recent = layout.selected_per_head - num_sinks
        recent = torch.arange(layout.num_candidates - num_recent, layout.num_candidates)
        kept = torch.cat([torch.arange(num_sinks), recent])
        layer = layout.layer_plan([kept] * layout.spec.num_kv_heads)
        return layout.plan([layer] * layout.spec.num_layers)


@register_policy("streaming")
class StreamingPolicy(Policy):
    defaults = PolicyDefaults(pooling="none")

    def stats_request(self) -> StatsRequest:
        return StatsRequest()

    def start(self, spec: SegmentSpec) -> SegmentCompressor:
        return _SinksAndRecent(SegmentLayout.of(spec, self.config), self.config.streaming_sinks)
