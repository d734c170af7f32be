"""Per-process engine state shared by the compressed radix cache and the attention backend, and the
request lifecycle between them.

The factory builds one ``EngineState`` in the scheduler process and hands it to both the tree and the
attention backend (``attach_engine``); a backend without one runs exactly as stock.

Request lifecycle (one prefill of a request whose prompt ends in this forward):

1. **match** — ``CompressedRadixCache.match_prefix`` sees the ``Req`` (SGLang passes it) and indexes it
   by rid (``EngineState.track``): the backend only sees rids. The index is weak, so it never keeps a
   finished request alive.
2. **submit** — ``ForwardPlan.build`` (the backend's ``init_forward_metadata``) calls
   ``EngineState.submit``: one compressor per span the scope compresses (``Scope.compressible_spans``),
   parked on the request as its ``PendingCompression``; the scoring jobs of the forward feed them
   per layer (``compressor.observe``).
3. **take** — the tree's ``checkpoint`` after the forward takes the pending compressors
   (``EngineState.take_pending``); a later checkpoint of the same request finds none.
4. **checkpoint** — the tree turns each plan into a compressed node (or leaves the span dense) and
   inserts the rest densely.

Per-request state lives on the ``Req`` object (``RequestState`` as attribute ``kvevict``), never on
``req.kv`` (``slots=True``).
"""

from __future__ import annotations

import logging
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
from sgl_kvevict.engine.eviction import EvictionOrder
from sgl_kvevict.engine.segments import CompressedSegment, PathView
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies.base import Policy, SegmentCompressor, SegmentSpec
from sgl_kvevict.scope import BlockScope, Scope
from sgl_kvevict.scoring.window import StatsRequest
from sgl_kvevict.settings import ConfigError

logger = logging.getLogger(__name__)

# Debug switch: a directory where every applied plan is saved as ``<rid>.pt`` (parity tests).
PLAN_DUMP_ENV = "KVEVICT_PLAN_DUMP_DIR"
# A request's ``extra_key`` that starts with this names its own eviction options (``per_request``).
REQUEST_OPTIONS_PREFIX = "kvevict:"


@dataclass(frozen=True)
class EvictionSetup:
    """One eviction configuration ready to serve: the config, its policy and the statistics it needs."""

    config: EvictionConfig
    policy: Policy
    stats_request: StatsRequest

    @classmethod
    def of(cls, config: EvictionConfig, model_dir: Optional[Path] = None) -> "EvictionSetup":
        """``model_dir``: the served model, for policies bound to it (a learned scorer's weights)."""
        policy = build_policy(config)
        if model_dir is not None:
            policy = policy.for_model(model_dir)
        return cls(config, policy, policy.stats_request())


@dataclass
class RequestState:
    """setup: the eviction configuration serving the request (``EngineState.setup_for``; None: it stays
    dense). pending: the compressors of the spans scored in the last forward (position order), until the
    tree's checkpoint takes them. view, view_node, view_generation: the request's ``PathView`` and the
    ``last_node`` and arena generation it was built for (``engine.batch.path_view``). reuse_counted:
    the use of the matched prefix was counted."""

    setup: Optional[EvictionSetup] = None
    pending: list[SegmentCompressor] = field(default_factory=list)
    view: Optional[PathView] = None
    view_node: Any = None
    view_generation: int = -1
    reuse_counted: bool = False


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
    """Histogram bucket of a node that served ``requests`` distinct requests: 1, 2, 3-4, 5-8, ..."""
    if requests <= 2:
        return str(requests)
    upper = 1 << (requests - 1).bit_length()
    return f"{upper // 2 + 1}-{upper}"


@dataclass
class EngineStats:
    """Counters kept incrementally by the scheduler thread; ``snapshot`` may run on any thread.

    Levels: ``compressed_nodes``, ``compressed_tokens`` (logical tokens they cover), ``kept_cells``.
    Running totals: ``requests_compressed``; ``reuse_hits`` (requests whose match reused compressed
    nodes made by other requests) and ``reused_tokens``; ``shared_node_hits`` ((request, node) pairs of
    such reuse); ``compressed_nodes_created`` (a split's head counts as a new node);
    ``compression_races_lost`` (spans a request scored but found compressed by a concurrent request
    at its checkpoint: its plan is dropped before any cell is taken); ``reconstructions_skipped``
(requests left dense because running requests held every slot a KVzip pass needed); evictions by kind
    (``dense_nodes_evicted``, ``dense_slots_evicted``, ``compressed_nodes_evicted``,
    ``compressed_cells_evicted``; ``/flush_cache`` not counted). ``served_histogram`` maps "distinct
    requests a node served" to the number of nodes, over every node created since start.
    """

    compressed_nodes: int = 0
    compressed_tokens: int = 0
    kept_cells: int = 0
    requests_compressed: int = 0
    reuse_hits: int = 0
    reused_tokens: int = 0
    shared_node_hits: int = 0
    compressed_nodes_created: int = 0
    compression_races_lost: int = 0
    reconstructions_skipped: int = 0
    request_option_errors: int = 0
    dense_nodes_evicted: int = 0
    dense_slots_evicted: int = 0
    compressed_nodes_evicted: int = 0
    compressed_cells_evicted: int = 0
    served_histogram: Counter = field(default_factory=Counter, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def node_added(self, segment: CompressedSegment) -> None:
        """A compressed node was created; it has served its creator."""
        with self.lock:
            self.compressed_nodes += 1
            self.compressed_tokens += segment.length
            self.kept_cells += segment.num_cells
            self.compressed_nodes_created += 1
            self.served_histogram[1] += 1

    def node_split(self, served: int) -> None:
        """A compressed node that had served ``served`` requests was split: its head is a new node with
        the same history; cells and tokens are only partitioned."""
        with self.lock:
            self.compressed_nodes += 1
            self.compressed_nodes_created += 1
            self.served_histogram[served] += 1

    def node_served(self, served_before: int) -> None:
        """One more distinct request used a node that had served ``served_before`` requests."""
        with self.lock:
            self.served_histogram[served_before] -= 1
            self.served_histogram[served_before + 1] += 1

    def compressed_node_evicted(self, segment: CompressedSegment) -> None:
        with self.lock:
            self.compressed_nodes -= 1
            self.compressed_tokens -= segment.length
            self.kept_cells -= segment.num_cells
            self.compressed_nodes_evicted += 1
            self.compressed_cells_evicted += segment.num_cells

    def dense_node_evicted(self, slots: int) -> None:
        with self.lock:
            self.dense_nodes_evicted += 1
            self.dense_slots_evicted += slots

    def tree_cleared(self) -> None:
        with self.lock:
            self.compressed_nodes = self.compressed_tokens = self.kept_cells = 0

    def count(self, name: str, amount: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + amount)

    def snapshot(self) -> dict:
        """The counters, plus ``requests_served_per_node`` (power-of-two buckets of ``served_histogram``)
        with its max and mean."""
        with self.lock:
            counters = {name: getattr(self, name) for name in self.__dataclass_fields__ if name not in _NOT_COUNTERS}
            histogram = {served: nodes for served, nodes in self.served_histogram.items() if nodes}
        buckets: dict[str, int] = {}
        for served in sorted(histogram):
            buckets[served_bucket(served)] = buckets.get(served_bucket(served), 0) + histogram[served]
        nodes = sum(histogram.values())
        return {
            **counters,
            "requests_served_per_node": buckets,
            "requests_served_per_node_max": max(histogram, default=0),
            "requests_served_per_node_mean": sum(s * n for s, n in histogram.items()) / nodes if nodes else 0.0,
        }


_NOT_COUNTERS = ("served_histogram", "lock")


class EngineState:
    """The eviction setups, the arena, the eviction order, the request index and the stats of one scheduler.

    per_request: requests may bring their own eviction options in SGLang's ``extra_key`` request field,
    ``"kvevict:policy=snapkv,budget=0.5"`` (the ``--kv-evict-*`` option names): A/B experiments and the
    parity tests serve several policies from one server. SGLang keeps requests with different extra keys
    in separate subtrees, so a node compressed by one setup is never reused by another.
    """

    def __init__(
        self,
        eviction: EvictionConfig,
        shape: ModelShape,
        arena: Arena,
        allocator,
        scope: Scope,
        per_request: bool = False,
        model_dir: Optional[Path] = None,
    ):
        self.eviction = eviction
        self.scope = scope
        self.model_dir = model_dir
        self.default_setup = EvictionSetup.of(eviction, model_dir)
        self.per_request = per_request
        # Set by the factory when a setup needs them (engine.hidden_states, engine.reconstruction); the
        # pass in flight is what ForwardPlan.build plans instead of a scheduled batch.
        self.hidden_states = None
        self.reconstructor = None
        self.reconstruction = None
        self._request_setups: dict[str, Optional[EvictionSetup]] = {}
        self.shape = shape
        self.arena = arena
        self.order = EvictionOrder()
        self.stats = EngineStats()
        self._allocator = allocator
        self.kv_slots_total = allocator.size
        self.requests: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
        # The last forward's CellBatch and the views it was built from (engine.batch.ForwardPlan).
        self.cell_batch_cache: tuple[tuple, Any] = ((), None)
        dump_dir = os.environ.get(PLAN_DUMP_ENV)
        self.plan_dump_dir = Path(dump_dir) if dump_dir else None

    # ---- the request lifecycle (module docstring) ----------------------------------------------

    def track(self, req) -> None:
        """1. match: index the request by rid for the backend."""
        self.requests[req.rid] = req

    def setup_for(self, req) -> Optional[EvictionSetup]:
        """The request's eviction setup: the server's, or with ``per_request`` its ``extra_key``'s (None when
        those options are invalid: the request stays dense and ``request_option_errors`` counts it)."""
        key = req.extra_key
        if not (self.per_request and key and key.startswith(REQUEST_OPTIONS_PREFIX)):
            return self.default_setup
        if key not in self._request_setups:
            self._request_setups[key] = self._parse_request_options(key[len(REQUEST_OPTIONS_PREFIX) :])
        return self._request_setups[key]

    def _parse_request_options(self, text: str) -> Optional[EvictionSetup]:
        try:
            options = dict(item.split("=", 1) for item in text.split(",") if item)
            return EvictionSetup.of(EvictionConfig.from_strings(options), self.model_dir)
        except (ConfigError, ValueError) as error:
            logger.warning("sgl-kvevict: request eviction options %r refused (%s); the request stays dense", text, error)
            self.stats.count("request_option_errors")
            return None

    def submit(self, req, start: int, end: int) -> list[SegmentCompressor]:
        """2. submit: compressors for the spans compressed when the request's own prompt tokens
        ``[start, end)`` are prefilled, pending on the request until its checkpoint."""
        state = request_state(req)
        state.setup = setup = self.setup_for(req)
        if setup is None:
            return []
        shape = self.shape
        state.pending = [
            setup.policy.start(SegmentSpec(a, b, shape.num_layers, shape.num_kv_heads, shape.num_q_heads))
            for a, b in self.scope.compressible_spans(start, end, setup.config.window)
        ]
        return state.pending

    def take_pending(self, req) -> list[SegmentCompressor]:
        """3. take: the compressors the last forward fed, once."""
        state = request_state(req)
        pending, state.pending = state.pending, []
        return pending

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
        """Thread-safe: counters are copied under their lock; the pool and arena reads are single loads."""
        budget, arena = self.eviction.budget, self.arena
        return {
            "policy": self.eviction.policy,
            "budget": None if budget is None else str(budget),
            "score": self.eviction.score,
            "window": self.eviction.window,
            "scope": self.scope.name,
            "block_size": getattr(self.scope, "block_size", None),
            **self.stats.snapshot(),
            "kv_slots_total": self.kv_slots_total,
            "kv_slots_free": int(self._allocator.available_size()),
            "arena_cells_per_slot": arena.cells_per_slot,
            "arena_slots_borrowed": arena.slots_borrowed,
            "arena_cells_used": arena.cells_used,
            "arena_cells_free": arena.cells_free,
            "arena_cells_moved": arena.cells_moved,
            "arena_slots_returned_by_moves": arena.slots_given_back_by_moves,
        }
