"""A debug listener of the coordinator: every plan handed to the tree saved as a file (parity tests).

With ``KVEVICT_PLAN_DUMP_DIR=<dir>`` set in a server's environment, the adapter's factory gives the
coordinator a ``PlanDump`` of that directory; without it the coordinator has no listener.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.sharding import HeadShard

PLAN_DUMP_ENV = "KVEVICT_PLAN_DUMP_DIR"


class PlanDump:
    """Saves ``<rid>.pt`` (request scope) or ``<rid>.block<k>.pt`` (block ``k`` in block scope) in
    ``directory``; under tensor parallelism every rank saves its heads' (``heads``: their global ids) as
    ``<name>.rank<r>.pt``."""

    def __init__(self, directory: Path, shard: HeadShard):
        self.directory = directory
        self.shard = shard

    @classmethod
    def from_env(cls, shard: HeadShard) -> Optional["PlanDump"]:
        directory = os.environ.get(PLAN_DUMP_ENV)
        return cls(Path(directory), shard) if directory else None

    def __call__(self, rid: str, plan: CompressionPlan, block: Optional[int]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        layers = [(layer.kept_positions, layer.head_indptr) for layer in plan.layers]
        shard = self.shard
        payload = {
            "segment_start": plan.segment_start, "segment_end": plan.segment_end, "layers": layers,
            "heads": shard.local_heads,
        }  # fmt: skip
        name = rid if block is None else f"{rid}.block{block}"
        if shard.tp_size > 1:
            name += f".rank{shard.rank}"
        torch.save(payload, self.directory / f"{name}.pt")
