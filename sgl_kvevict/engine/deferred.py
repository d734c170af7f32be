"""Compress under pressure: a scored segment stays dense in the tree, its plan kept beside its node.

``--kv-evict-when prefill`` (``PREFILL``) stores each scored segment compressed at the checkpoint after
its prefill, whether the KV pool needs the room or not. ``--kv-evict-when pressure`` (``PRESSURE``) scores
it the same way, during the same forward, but the tree inserts it dense and keeps the plan on the node
(``DeferredPlan``); only when SGLang asks the tree for slots (``CompressedRadixCache.evict``) are the
coldest unlocked dense nodes with a plan compressed, in the eviction order, before anything is evicted.
So a request reads exactly what stock would have given it until stock would have lost the prefix, and
then reads a compressed copy instead of recomputing it.

A plan is kept, not scores: it is what the policy chose with the statistics of the prefill (budgets,
layer and head allocation included), and it is smaller than ``[layers, KV heads, tokens]`` scores at any
budget under a half. Plans live on the host, beside SGLang's pool (``deferred_plan_bytes`` in the stats).

Pure torch: no SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.sharding import RankCounts

PREFILL = "prefill"
PRESSURE = "pressure"
COMPRESS_WHEN = (PREFILL, PRESSURE)


@dataclass(frozen=True)
class DeferredPlan:
    """What a dense node becomes under pressure: ``plan`` (its positions ``[start, end)``), with each rank's
    entries (``rank_counts``); ``match_may_end``: whether a match may end at the compressed node (False for
    the head of a split node, as for a split compressed node: its entries were chosen for the tokens after
    it)."""

    plan: CompressionPlan
    rank_counts: RankCounts
    match_may_end: bool = True

    @property
    def start(self) -> int:
        return self.plan.segment_start

    @property
    def end(self) -> int:
        return self.plan.segment_end

    def split(self, at: int) -> tuple["DeferredPlan", "DeferredPlan"]:
        """The plans of ``[start, at)`` (a head: a match may not end at it) and ``[at, end)``."""
        head = DeferredPlan(self.plan.restricted(self.start, at), self.rank_counts.restricted(self.start, at), False)
        tail = DeferredPlan(self.plan.restricted(at, self.end), self.rank_counts.restricted(at, self.end), self.match_may_end)
        return head, tail

    def evicts_anything(self) -> bool:
        return not self.rank_counts.keeps_everything()

    @property
    def nbytes(self) -> int:
        tensors = [self.rank_counts.cumulative]
        for layer in self.plan.layers:
            tensors += [layer.kept_positions, layer.head_indptr]
        return sum(tensor.nbytes for tensor in tensors)
