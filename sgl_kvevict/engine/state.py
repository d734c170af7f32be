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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.engine.arena import Arena
from sgl_kvevict.engine.segments import CompressedSegment, PathView
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies.base import SegmentCompressor, SegmentSpec

# Debug switch: a directory where every applied plan is saved as ``<rid>.pt`` (parity tests).
PLAN_DUMP_ENV = "KVEVICT_PLAN_DUMP_DIR"


@dataclass
class RequestState:
    """compressor: the policy's compressor of the segment scored in the last forward, until the
    tree's checkpoint turns it into a plan. view_node/view: the request's ``PathView`` and the
    ``last_node`` it was built for (``engine.batch.path_view``). prefill_counted: the reuse of this
    request's matched prefix was counted."""

    compressor: Optional[SegmentCompressor] = None
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


@dataclass
class EngineStats:
    """Counters kept incrementally by the scheduler thread; ``snapshot`` may run on any thread."""

    compressed_nodes: int = 0
    compressed_tokens: int = 0
    kept_cells: int = 0
    requests_compressed: int = 0
    reuse_hits: int = 0
    reused_tokens: int = 0
    requests_left_dense: int = 0
    compressed_nodes_evicted: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def node_added(self, segment: CompressedSegment) -> None:
        with self.lock:
            self.compressed_nodes += 1
            self.compressed_tokens += segment.length
            self.kept_cells += segment.num_cells
            self.requests_compressed += 1

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

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "lock"}


class EngineState:
    """The policy, the arena, the request index and the stats of one scheduler process."""

    def __init__(self, eviction: EvictionConfig, shape: ModelShape, arena: Arena, allocator):
        self.eviction = eviction
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

    def start_segment(self, req, start: int, end: int) -> Optional[SegmentCompressor]:
        """A compressor for the request's own span ``[start, end)`` (its prompt ends at ``end``),
        kept on the request for the tree's checkpoint; None when the span is too short to compress."""
        if end - start <= self.eviction.window:
            return None
        shape = self.shape
        compressor = self.policy.start(SegmentSpec(start, end, shape.num_layers, shape.num_kv_heads, shape.num_q_heads))
        request_state(req).compressor = compressor
        return compressor

    # ---- reporting -----------------------------------------------------------------------------

    def dump_plan(self, rid: str, plan: CompressionPlan) -> None:
        if self.plan_dump_dir is None:
            return
        self.plan_dump_dir.mkdir(parents=True, exist_ok=True)
        layers = [(layer.kept_positions, layer.head_indptr) for layer in plan.layers]
        payload = {"segment_start": plan.segment_start, "segment_end": plan.segment_end, "layers": layers}
        torch.save(payload, self.plan_dump_dir / f"{rid}.pt")

    def stats_snapshot(self) -> dict:
        """Thread-safe: counters are copied under their lock; the two pool reads are single loads."""
        budget = self.eviction.budget
        return {
            "policy": self.eviction.policy,
            "budget": None if budget is None else str(budget),
            "window": self.eviction.window,
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
