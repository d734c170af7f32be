"""StreamingLLM (Xiao et al. 2024): attention sinks plus the most recent tokens, no scores.

Per (layer, KV head): the sink positions (``sink_tokens``, kept by every policy; a later segment of
the same sequence has none, the first one kept them), the window, and the most recent candidates up
to the per-head budget.
"""

from __future__ import annotations

import torch

from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies.base import Policy, PolicyDefaults, SegmentCompressor, SegmentSpec, register_policy
from sgl_kvevict.policies.layout import SegmentLayout
from sgl_kvevict.scoring.window import StatsRequest, WindowStats


class _SinksAndRecent(SegmentCompressor):
    needs_stats = False

    def __init__(self, layout: SegmentLayout):
        super().__init__(layout.spec)
        self.layout = layout

    def observe(self, layer: int, stats: WindowStats) -> None:
        pass

    def plan(self) -> CompressionPlan:
        layout = self.layout
        if not layout.compresses:
            return layout.keep_all()
        recent = torch.arange(layout.num_candidates - layout.selected_per_head, layout.num_candidates)
        layer = layout.layer_plan([recent] * layout.spec.num_kv_heads)
        return layout.plan([layer] * layout.spec.num_layers)


@register_policy("streaming")
class StreamingPolicy(Policy):
    defaults = PolicyDefaults(pooling="none")

    def stats_request(self) -> StatsRequest:
        return StatsRequest()

    def start(self, spec: SegmentSpec) -> SegmentCompressor:
        return _SinksAndRecent(SegmentLayout.of(spec, self.common))
