"""Full cache: the identity policy (the baseline every quality number is compared against)."""

from __future__ import annotations

from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies.base import Policy, PolicyDefaults, SegmentCompressor, SegmentSpec, register_policy
from sgl_kvevict.scoring.window import StatsRequest, WindowStats


class _KeepAll(SegmentCompressor):
    needs_stats = False

    def observe(self, layer: int, stats: WindowStats) -> None:
        pass

    def plan(self) -> CompressionPlan:
        spec = self.spec
        return CompressionPlan.keep_all(spec.start, spec.end, spec.num_layers, spec.num_kv_heads)


@register_policy("full")
class FullPolicy(Policy):
    defaults = PolicyDefaults(takes_budget=False)

    def stats_request(self) -> StatsRequest:
        return StatsRequest()

    def start(self, spec: SegmentSpec) -> SegmentCompressor:
        return _KeepAll(spec)
