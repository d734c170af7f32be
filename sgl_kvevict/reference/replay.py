"""Replaying the selection a request reads from the radix tree, in the reference engine.

A request that diverges inside a compressed node does not read one policy's plan: the shared head
keeps the selection of the request that stored it (the stored plan ``restricted`` to the head), and
the request's own part keeps its own (its plan ``restricted`` to the rest), the rule the SGLang tree
applies when it splits the node (docs/design.md#scopes-and-the-split-rule). The
reference engine replays such a composed selection with ``ReplayedPlans``: a policy whose compressor
for a segment returns the plan given for exactly that segment, scoring nothing.
"""

from __future__ import annotations

import copy
from typing import Iterable

from sgl_kvevict.config import EvictionConfig
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies.base import Policy, SegmentCompressor, SegmentSpec
from sgl_kvevict.scoring.window import StatsRequest


class _Replayed(SegmentCompressor):
    needs_stats = False

    def __init__(self, spec: SegmentSpec, plan: CompressionPlan):
        super().__init__(spec)
        self._plan = plan

    def observe(self, layer, stats) -> None:
        raise AssertionError("a replayed plan observes nothing")

    def plan(self) -> CompressionPlan:
        return self._plan


class ReplayedPlans(Policy):
    """Compress each segment ``[start, end)`` to the given plan of that segment.

    config: the configuration whose window the plans were made with (the reference keeps it dense
    exactly as for the policy that made them).
    """

    name = "replayed"

    def __init__(self, config: EvictionConfig, plans: Iterable[CompressionPlan]):
        super().__init__(config.common)
        self.plans = {(plan.segment_start, plan.segment_end): plan for plan in plans}

    def stats_request(self) -> StatsRequest:
        return StatsRequest()

    def start(self, spec: SegmentSpec) -> SegmentCompressor:
        return _Replayed(spec, self.plans[(spec.start, spec.end)])

    def for_layers(self, layers: tuple[int, ...]) -> "ReplayedPlans":
        """The given plans' ``layers`` only (a model's global layers: ``local_layers.WindowedLocalLayers``
        adds the local layers' windows, as they were when the plans were made)."""
        replayed = copy.copy(self)
        replayed.plans = {
            key: CompressionPlan(plan.segment_start, plan.segment_end, tuple(plan.layers[layer] for layer in layers))
            for key, plan in self.plans.items()
        }
        return replayed
