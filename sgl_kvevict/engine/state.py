"""Per-process engine state shared by the compressed radix cache and the attention backend.

SGLang builds the attention backend before the tree, in the same (scheduler) process and thread;
neither can reach the other through SGLang's objects. The tree's factory builds an ``EngineState``
and installs it here; the backend reads it at each forward (``current()``), so a server whose tree
is not ours runs the backend exactly as stock.

Per-request state lives on the ``Req`` object (``RequestState`` as attribute ``kvevict``), never on
``req.kv`` (``slots=True``). The backend only sees request ids, so requests are also indexed by
``rid`` in a weak dictionary filled when the tree matches them (every request is matched before its
first forward); it never keeps a finished request alive.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.engine.arena import Arena
from sgl_kvevict.engine.segments import CompressedSegment, PathView
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies.base import SegmentCompressor, SegmentSpec
from sgl_kvevict.scope import BlockScope, Scope

# Debug switch: a directory where every applied plan is saved as ``<rid>.pt`` (parity tests).
PLAN_DUMP_ENV = "KVEVICT_PLAN_DUMP_DIR"


@dataclass
class RequestState:
    """compressors: the policy's compressors of the spans scored in the last forward (position
    order), until the tree's checkpoint turns them into plans. view_node/view: the request's
    ``PathView`` and the ``last_node`` it was built for (``engine.batch.path_view``).
    prefill_counted: the reuse of this request's matched prefix was counted."""

    compressors: list[SegmentCompressor] = field(default_factory=list)
    view_node: Any = None
    view: Optional[PathView] = None
    prefill_counted: bool = False


def request_state(req) -> RequestState:
    state = getattr(req, "kvevict", None)
    if state is None:
        state = req.kvevict = RequestState()
    return state


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_q_heads: int
    num_kv_heads: int


def served_bucket(requests: int) -> str:
    """Histogram bucket of a block that served ``requests`` distinct requests: 1, 2, 3-4, 5-8, ..."""
    if requests <= 2:
        return str(requests)
    upper = 1 << (requests - 1).bit_length()
    return f"{upper // 2 + 1}-{upper}"


@dataclass
class EngineStats:
    """Counters kept incrementally by the scheduler thread; ``snapshot`` may run on any thread.

    Sharing of compressed nodes (blocks, in block scope): ``shared_block_hits`` counts (request,
    node) pairs where a request's prefix match reused a node another request compressed;
    ``blocks_compressed`` counts nodes ever created (a block compressed twice would show as more
    nodes than distinct blocks; in request scope a split adds its head); ``block_races_lost`` counts spans a request scored but found already
    compressed by a concurrent request at its checkpoint (its plan is dropped before any cell is
    taken). ``served_histogram`` maps "distinct requests a node served" (its creator, every request
    that reused it, every race loser that adopted it, every request that hung its own node below a
    split head) to the number of nodes, over every node created
    since the server started (evicted and flushed ones keep their final count).
    """

    compressed_nodes: int = 0
    compressed_tokens: int = 0
    kept_cells: int = 0
    requests_compressed: int = 0
    reuse_hits: int = 0
    reused_tokens: int = 0
    requests_left_dense: int = 0
    compressed_nodes_evicted: int = 0
    shared_block_hits: int = 0
    blocks_compressed: int = 0
    block_races_lost: int = 0
    served_histogram: Counter = field(default_factory=Counter, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def node_added(self, segment: CompressedSegment) -> None:
        """A compressed node was created; it has served its creator."""
        with self.lock:
            self.compressed_nodes += 1
            self.compressed_tokens += segment.length
            self.kept_cells += segment.num_cells
            self.blocks_compressed += 1
            self.served_histogram[1] += 1

    def node_split(self, served: int) -> None:
        """A compressed node that had served ``served`` requests was split: its head is a new node with
        the same history; cells and tokens are only partitioned."""
        with self.lock:
            self.compressed_nodes += 1
            self.blocks_compressed += 1
            self.served_histogram[served] += 1

    def node_served(self, served_before: int) -> None:
        """One more distinct request used a node that had served ``served_before`` requests."""
        with self.lock:
            self.served_histogram[served_before] -= 1
            self.served_histogram[served_before + 1] += 1

    def node_removed(self, segment: CompressedSegment) -> None:
        with self.lock:
            self.compressed_nodes -= 1
            self.compressed_tokens -= segment.length
            self.kept_cells -= segment.num_cells
            self.compressed_nodes_evicted += 1

    def tree_cleared(self) -> None:
        with self.lock:
            self.compressed_nodes = self.compressed_tokens = self.kept_cells = 0

    def count(self, name: str, amount: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + amount)

    def snapshot(self) -> dict:
        """The counters, plus ``requests_served_per_block`` (power-of-two buckets of
        ``served_histogram``) with its max and mean."""
        with self.lock:
            counters = {name: getattr(self, name) for name in self.__dataclass_fields__ if name not in _NOT_COUNTERS}
            histogram = {served: nodes for served, nodes in self.served_histogram.items() if nodes}
        buckets: dict[str, int] = {}
        for served in sorted(histogram):
            buckets[served_bucket(served)] = buckets.get(served_bucket(served), 0) + histogram[served]
        nodes = sum(histogram.values())
        return {
            **counters,
            "requests_served_per_block": buckets,
            "requests_served_per_block_max": max(histogram, default=0),
            "requests_served_per_block_mean": sum(s * n for s, n in histogram.items()) / nodes if nodes else 0.0,
        }


_NOT_COUNTERS = ("served_histogram", "lock")


class EngineState:
    """The policy, the arena, the request index and the stats of one scheduler process."""

    def __init__(
        self, eviction: EvictionConfig, shape: ModelShape, arena: Arena, allocator, scope: Scope
    ):
        self.eviction = eviction
        self.scope = scope
        self.policy = build_policy(eviction)
        self.stats_request = self.policy.stats_request()
        self.shape = shape
        self.arena = arena
        self.stats = EngineStats()
        self._dense_allocator = allocator
        self.dense_slots_total = allocator.size
        self.requests: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
        dump_dir = os.environ.get(PLAN_DUMP_ENV)
        self.plan_dump_dir = Path(dump_dir) if dump_dir else None

    # ---- requests ------------------------------------------------------------------------------

    def track(self, req) -> None:
        self.requests[req.rid] = req

    def start_segments(self, req, start: int, end: int) -> list[SegmentCompressor]:
        """Compressors for the spans the request compresses when its own prompt tokens ``[start, end)``
        are prefilled (``Scope.compressible_spans``), kept on the request for the tree's checkpoint."""
        shape = self.shape
        compressors = [
            self.policy.start(SegmentSpec(a, b, shape.num_layers, shape.num_kv_heads, shape.num_q_heads))
            for a, b in self.scope.compressible_spans(start, end, self.eviction.window)
        ]
        request_state(req).compressors = compressors
        return compressors

    # ---- reporting -----------------------------------------------------------------------------

    def dump_plan(self, rid: str, plan: CompressionPlan) -> None:
        """Save ``<rid>.pt`` (request scope) or ``<rid>.block<k>.pt`` (block ``k`` in block scope)."""
        if self.plan_dump_dir is None:
            return
        self.plan_dump_dir.mkdir(parents=True, exist_ok=True)
        layers = [(layer.kept_positions, layer.head_indptr) for layer in plan.layers]
        payload = {"segment_start": plan.segment_start, "segment_end": plan.segment_end, "layers": layers}
        scope = self.scope
        name = f"{rid}.block{plan.segment_start // scope.block_size}" if isinstance(scope, BlockScope) else rid
        torch.save(payload, self.plan_dump_dir / f"{name}.pt")

    def stats_snapshot(self) -> dict:
        """Thread-safe: counters are copied under their lock; the two pool reads are single loads."""
        budget = self.eviction.budget
        return {
            "policy": self.eviction.policy,
            "budget": None if budget is None else str(budget),
            "window": self.eviction.window,
            "scope": self.scope.name,
            "block_size": getattr(self.scope, "block_size", None),
            **self.stats.snapshot(),
            "arena_cells_total": self.arena.cells_total,
            "arena_cells_used": self.arena.cells_used,
            "dense_slots_total": self.dense_slots_total,
            "dense_slots_free": int(self._dense_allocator.available_size()),
        }


_current: Optional[EngineState] = None


def install(state: EngineState) -> None:
    global _current
    _current = state


def current() -> Optional[EngineState]:
    return _current
