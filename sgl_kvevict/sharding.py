"""Compression under tensor parallelism: each rank holds some KV heads, the decisions stay one rank's.

With ``--tp-size N`` every rank attends, scores and stores only its own KV heads. Two things must still
come out as on a single rank:

* **the kept positions**: a policy that splits a budget across heads (Ada-KV, LAVa, global top-k) or
  layers by scores needs every head's scores. A rank's compressor hands its per-(layer, KV head) state
  to the engine (``SegmentCompressor.shared_state``); the engine gathers it from every rank, ``merge``
  lays it out in global head order, every rank plans every head from it (``plan_shared``) and keeps its
  own heads (``local_plan``). Policies whose heads are planned alone (SnapKV, PyramidKV, H2O, TOVA,
  StreamingLLM, ...) exchange nothing.
* **the memory decisions**: SGLang's TP schedulers never talk about memory; each assumes the others
  hold exactly its own free-slot count. A rank keeps a different number of entries than another
  (its heads' budgets differ), so every rank *reserves* the same number of cells for a compressed segment:
  the largest any rank keeps (``RankCounts.reserved``). Reservations must also agree after a node is
  split at a position, so each segment remembers every rank's entries by position (``RankCounts``), and
  the part before and after a split reserves the largest of those counts on each side.

``HeadShard`` follows how SGLang 0.5.23 lays KV heads out on ranks: consecutive equal shares; on CPU,
when the ranks do not divide the heads, it pads the head count up to a multiple of the ranks with
zero-weight heads (``adjust_config_with_unaligned_cpu_tp``: a padded KV head has padded query heads,
so GQA groups never straddle ranks). A padded head keeps nothing.

Pure torch: the engine does the exchanges (``engine.tensor_parallel``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sgl_kvevict.plan import CompressionPlan, LayerPlan
from sgl_kvevict.policies.base import SegmentCompressor

PADDING = -1  # the global id of a padded head


@dataclass(frozen=True)
class HeadShard:
    """rank: this rank; heads_of_rank: per rank, the global KV head of each of its local heads
    (``PADDING`` for a padded one); num_heads: the model's KV heads."""

    rank: int
    heads_of_rank: tuple[tuple[int, ...], ...]
    num_heads: int

    @classmethod
    def of(cls, num_heads: int, tp_size: int, rank: int) -> "HeadShard":
        """SGLang's layout: ``ceil(num_heads / tp_size)`` heads per rank (padding past the last real head)."""
        per_rank = -(-num_heads // tp_size)
        heads = tuple(
            tuple(h if h < num_heads else PADDING for h in range(r * per_rank, (r + 1) * per_rank))
            for r in range(tp_size)
        )
        return cls(rank, heads, num_heads)

    @property
    def tp_size(self) -> int:
        return len(self.heads_of_rank)

    @property
    def local_heads(self) -> tuple[int, ...]:
        return self.heads_of_rank[self.rank]

    def merge(self, per_rank: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's shared state ``[L, H_local, m]`` (rank order) as ``[L, num_heads, m]`` in global
        head order, padding dropped."""
        flat = torch.cat(per_rank, dim=1)
        order = [h for heads in self.heads_of_rank for h in heads]
        return flat[:, [order.index(h) for h in range(self.num_heads)]]

    def local_plan(self, plan: CompressionPlan, *, of_every_head: bool) -> CompressionPlan:
        """This rank's heads of ``plan``: a plan of every head (``of_every_head``, from ``plan_shared``) or of
        this rank's heads with the padded ones planned as if real. Padded heads keep nothing."""
        empty = torch.zeros(0, dtype=torch.int64)

        def heads_of(layer: LayerPlan) -> list[torch.Tensor]:
            return [
                empty if head == PADDING else layer.head_positions(head if of_every_head else local)
                for local, head in enumerate(self.local_heads)
            ]

        layers = tuple(LayerPlan.from_heads(heads_of(layer)) for layer in plan.layers)
        return CompressionPlan(plan.segment_start, plan.segment_end, layers)


@dataclass(frozen=True)
class RankCounts:
    """The entries every rank keeps of the segment ``[start, start + length)``, by position: ``cumulative``
    int64 ``[R, length + 1]``, ``cumulative[r, i]`` = rank ``r``'s entries at positions before
    ``start + i`` (all layers and heads). ``entries_per_position``: what the ranks together hold of one
    position uncompressed (layers x the model's KV heads)."""

    start: int
    cumulative: torch.Tensor
    entries_per_position: int

    @classmethod
    def of_positions(cls, start: int, per_rank: torch.Tensor, entries_per_position: int) -> "RankCounts":
        """per_rank: int ``[R, length]``, each rank's entries at each position of the segment."""
        cumulative = torch.nn.functional.pad(torch.cumsum(per_rank.to(torch.int64), 1), (1, 0))
        return cls(start, cumulative, entries_per_position)

    @classmethod
    def of_plan(cls, plan: CompressionPlan) -> "RankCounts":
        """The counts of one rank holding every KV head of ``plan``."""
        per_head = plan.num_layers * plan.layers[0].num_kv_heads
        return cls.of_positions(plan.segment_start, position_counts(plan)[None], per_head)

    @property
    def length(self) -> int:
        return self.cumulative.shape[1] - 1

    def restricted(self, start: int, end: int) -> "RankCounts":
        """The counts of ``[start, end)`` (inside the segment)."""
        window = self.cumulative[:, start - self.start : end - self.start + 1]
        return RankCounts(start, window - window[:, :1], self.entries_per_position)

    def plus(self, other: "RankCounts") -> "RankCounts":
        """The counts of both sets of entries of the same segment, on the same ranks. ``other`` may be of one
        rank (``of_plan``) where ``self`` is of several: entries every rank holds alike, as many in each (a
        split head's local-layer window, ``local_layers.window_before``: the same positions in every KV head
        of every rank)."""
        assert self.start == other.start and self.length == other.length, (self.start, other.start)
        assert other.cumulative.shape[0] in (1, self.cumulative.shape[0]), "counts of other ranks"
        return RankCounts(self.start, self.cumulative + other.cumulative, self.entries_per_position)

    def keeps_everything(self) -> bool:
        """Whether the ranks together keep every entry of the segment (nothing to compress)."""
        return int(self.per_rank().sum()) == self.length * self.entries_per_position

    def per_rank(self) -> torch.Tensor:
        """int64 ``[R]``: each rank's entries in the segment."""
        return self.cumulative[:, -1]

    def reserved(self) -> int:
        """The cells every rank reserves for the segment: the most entries any rank keeps of it."""
        return int(self.per_rank().max())


def position_counts(plan: CompressionPlan) -> torch.Tensor:
    """int64 ``[length]``: the entries ``plan`` keeps at each position of its segment, over layers and heads."""
    positions = torch.cat([layer.kept_positions for layer in plan.layers]) - plan.segment_start
    return torch.bincount(positions, minlength=plan.segment_length)


def plan_on_rank(
    compressor: SegmentCompressor, shard: HeadShard, gather: Callable[[torch.Tensor], list[torch.Tensor]]
) -> CompressionPlan:
    """This rank's plan of its heads, as a single rank would plan them. ``gather`` exchanges a tensor with
    every rank (an all-gather: every rank's, in rank order); it is called only when the policy weighs
    heads against each other, and then by every rank, since they all run the same policy."""
    state = compressor.shared_state()
    if state is None:
        return shard.local_plan(compressor.plan(), of_every_head=False)
    return shard.local_plan(compressor.plan_shared(shard.merge(gather(state))), of_every_head=True)
