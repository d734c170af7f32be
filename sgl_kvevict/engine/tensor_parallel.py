"""The exchanges between tensor-parallel ranks that keep their compression identical to one rank's.

Every rank's scheduler runs the same steps on the same requests (SGLang broadcasts them from rank 0),
so every rank reaches a segment's plan at the same point; the plan is made there with two all-gathers
on SGLang's TP group (its CPU group, gloo, so no device stream is involved: a tensor on the GPU, the
scores, is copied to the host for the exchange and the gathered ones back, ``process_group_gather``):

1. the shared state of policies that weigh heads against each other (``sharding.plan_on_rank``):
   ``[L, H_local, n]`` fp32 scores (``[L, H_local, context]`` for DBudgetKV), nothing for the others;
2. every rank's kept entries per position of the segment (int32 ``[length]``), from which each rank's
   tree reserves the same cells for it (``sharding.RankCounts``).

``bytes_sent`` counts what this rank contributed to those gathers (an all-gather of ``b`` bytes per rank
moves ``b * (R - 1)`` into every rank). With one rank nothing is exchanged and the plan is the policy's.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from sgl_kvevict.engine.host_copies import to_device
from sgl_kvevict.policies.base import SegmentCompressor
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.sharding import HeadShard, RankCounts, plan_on_rank, position_counts


Gather = Callable[[torch.Tensor], list[torch.Tensor]]


def process_group_gather(process_group, tp_size: int) -> Gather:
    """An all-gather over ``process_group`` (SGLang's TP CPU group, gloo): every rank's tensor, in rank
    order, on the tensor's device. Gloo exchanges host memory, so the tensor is copied to the host first
    (a device-to-host copy, which waits for the forward that computed it: the plan needs it anyway) and
    the gathered ones back (``host_copies.to_device``: pinned, non-blocking)."""

    def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
        device = tensor.device
        sent = tensor.to("cpu").contiguous()
        gathered = [torch.empty_like(sent) for _ in range(tp_size)]
        torch.distributed.all_gather(gathered, sent, group=process_group)
        return [to_device(part, device) for part in gathered]

    return gather


class RankGroup:
    """This rank's place among the TP ranks: its heads (``shard``) and how it exchanges with the others
    (``gather``: every rank's tensor of one shape and dtype, in rank order; None with one rank).
    ``num_layers``: the model's."""

    def __init__(self, shard: HeadShard, num_layers: int, gather: Optional[Gather] = None):
        if shard.tp_size > 1 and gather is None:
            raise ValueError("several ranks need a gather to exchange with")
        self.shard = shard
        self.num_layers = num_layers
        self._gather = gather or (lambda tensor: [tensor])
        self.bytes_sent = 0
        self.exchanges = 0

    @classmethod
    def single(cls, num_kv_heads: int, num_layers: int) -> "RankGroup":
        return cls(HeadShard.of(num_kv_heads, 1, 0), num_layers)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.shard.tp_size > 1:
            self.bytes_sent += tensor.numel() * tensor.element_size()
            self.exchanges += 1
        return self._gather(tensor)

    def plan(self, compressor: SegmentCompressor) -> tuple[CompressionPlan, RankCounts]:
        """This rank's plan of its heads and every rank's entries of the segment."""
        plan = plan_on_rank(compressor, self.shard, self.all_gather)
        per_position = position_counts(plan).to(torch.int32)
        counts = torch.stack(self.all_gather(per_position))
        return plan, RankCounts.of_positions(plan.segment_start, counts, self.num_layers * self.shard.num_heads)
