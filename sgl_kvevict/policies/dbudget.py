"""DBudgetKV (Ni et al. 2025): no budget; each layer evicts its oldest non-sink tokens until the
norm of the last query's attention row would drop by more than ``t`` (1%).

Per layer the kept set is ``sinks ∪ [start_l, end)``: StreamingLLM with a window chosen per layer
and input. Sinks are the common ``sink_tokens`` (the paper's m = 4), kept by every policy; they,
the observation window and any prefix before the segment are never evicted, see
docs/methods/dbudgetkv.md#never-evicted-sinks-window-and-prefix. Layers ``dbudget_frozen_layers`` (0 and 1) are never pruned. All KV
heads of a layer keep the same positions (one stopping index per layer, heads combined "joint").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sgl_kvevict.budget.dbudget import evicted_prefix_length, head_attention_mass
from sgl_kvevict.settings import CommonSettings, ConfigError, Settings, int_at_least, layer_indices, setting
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies.base import Policy, PolicyDefaults, SegmentCompressor, SegmentSpec, register_policy
from sgl_kvevict.policies.layout import SegmentLayout
from sgl_kvevict.scoring.window import StatsRequest, WindowStats


@dataclass(frozen=True)
class DBudgetKnobs(Settings):
    dbudget_threshold: float = setting(
        0.01,
        help="DBudgetKV t: stop keeping tokens once the attention-output norm drops by less than this fraction",
        valid=(
            lambda threshold: isinstance(threshold, (int, float)) and 0.0 < threshold < 1.0,
            "dbudget threshold {value!r} must be in (0, 1) (0.01 = stop at a 1% norm drop)",
        ),
    )
    dbudget_query_rows: int = setting(
        1,
        help="DBudgetKV k: last query rows that measure the norm drop; at most the window",
        valid=(int_at_least(1), "dbudget query rows {value!r} must be an integer >= 1"),
    )
    dbudget_frozen_layers: tuple[int, ...] = layer_indices(
        (0, 1), help="DBudgetKV: comma-separated layer indices never pruned", label="dbudget frozen layers"
    )


class _NormDropCompressor(SegmentCompressor):
    def __init__(self, layout: SegmentLayout, knobs: DBudgetKnobs):
        super().__init__(layout.spec)
        self.layout = layout
        self.threshold = knobs.dbudget_threshold
        self.frozen_layers = frozenset(knobs.dbudget_frozen_layers)
        self.needs_stats = layout.compresses
        # Evictable positions (the candidates), least important (oldest) first.
        self.eviction_order = torch.arange(layout.candidate_start, layout.window_start)
        self.mass_per_layer: dict[int, torch.Tensor] = {}  # [H_kv, L] per pruned layer

    def observe(self, layer: int, stats: WindowStats) -> None:
        if self.layout.compresses and layer not in self.frozen_layers:
            self.mass_per_layer[layer] = head_attention_mass(stats.tail_attn, self.spec.num_kv_heads).cpu()

    def plan(self) -> CompressionPlan:
        if not self.layout.compresses:
            return self.layout.keep_all()
        return self._plan(self._masses(), self.spec.num_kv_heads)

    def shared_state(self) -> Optional[torch.Tensor]:
        return torch.stack(self._masses()) if self.layout.compresses else None

    def plan_shared(self, state: torch.Tensor) -> CompressionPlan:
        return self._plan(list(state), state.shape[1])

    def _masses(self) -> list[torch.Tensor]:
        """``[H_kv, L]`` per layer (zeros for a frozen layer, which is never pruned)."""
        missing = sorted(set(range(self.spec.num_layers)) - self.frozen_layers - set(self.mass_per_layer))
        if missing:
            raise RuntimeError(f"plan() before observe() of layers {missing}")
        shape = next(iter(self.mass_per_layer.values())).shape if self.mass_per_layer else (self.spec.num_kv_heads, 0)
        return [self.mass_per_layer.get(layer, torch.zeros(shape)) for layer in range(self.spec.num_layers)]

    def _plan(self, masses: list[torch.Tensor], num_kv_heads: int) -> CompressionPlan:
        """One stopping index per layer from its mass summed over every KV head (``masses`` ``[H_kv, L]``)."""
        layout, layers = self.layout, []
        for layer, mass in enumerate(masses):
            evicted = 0
            if layer not in self.frozen_layers:
                evicted = evicted_prefix_length(mass.sum(0), self.eviction_order, self.threshold)
            kept = torch.arange(evicted, layout.num_candidates)
            layers.append(layout.layer_plan([kept] * num_kv_heads))
        return layout.plan(layers)


@register_policy("dbudget")
class DBudgetKVPolicy(Policy):
    defaults = PolicyDefaults(window=1, pooling="none", takes_budget=False)
    knobs_type = DBudgetKnobs
    knobs: DBudgetKnobs

    @classmethod
    def validate_settings(cls, common: CommonSettings, knobs: DBudgetKnobs) -> None:
        if knobs.dbudget_query_rows > common.window:
            raise ConfigError(
                f"dbudget query rows ({knobs.dbudget_query_rows}) must not exceed the window ({common.window}): "
                "the rows are the window's last queries"
            )

    def stats_request(self) -> StatsRequest:
        return StatsRequest(tail_rows=self.knobs.dbudget_query_rows)

    def start(self, spec: SegmentSpec) -> SegmentCompressor:
        return _NormDropCompressor(SegmentLayout.of(spec, self.common), self.knobs)
