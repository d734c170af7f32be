"""The engine's counters, kept incrementally on the scheduler thread and read from any thread.

The factory's stats snapshot adds the pool and arena levels and the configuration to them; the
HTTP process serves it as ``GET /kvevict/stats`` (``engine.stats_channel``) and, under SGLang's
``--enable-metrics``, as ``kvevict_*`` Prometheus series (``engine.metrics``).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from sgl_kvevict.engine.segments import CompressedSegment


def served_bucket(requests: int) -> str:
    """Histogram bucket of a node that served ``requests`` distinct requests: 1, 2, 3-4, 5-8, ..."""
    if requests <= 2:
        return str(requests)
    upper = 1 << (requests - 1).bit_length()
    return f"{upper // 2 + 1}-{upper}"


@dataclass
class EngineStats:
    """Counters kept incrementally by the scheduler thread; ``snapshot`` may run on any thread.

    Levels: ``compressed_nodes``, ``compressed_tokens`` (logical tokens they cover), ``kept_cells`` (cells
    they hold on each rank: the same on every tensor-parallel rank, which reserve alike), ``kept_entries``
    ((layer, KV head, token) entries they keep, over every rank; ``kept_cells`` without TP); in the
    snapshot, ``kept_share_by_layer`` (per model layer, the entries the nodes keep over those their tokens
    hold dense, this rank's KV heads) and, on a model with local layers (``global_layers`` set),
    ``kept_share_global_layers`` and ``kept_share_all_layers`` (a policy's budget is a share of the
    former; local layers keep their window whatever the budget).
    Running totals: ``requests_compressed``; ``reuse_hits`` (requests whose match reused compressed
    nodes made by other requests) and ``reused_tokens``; ``shared_node_hits`` ((request, node) pairs of
    such reuse); ``compressed_nodes_created`` (a split's head counts as a new node);
    ``compression_races_lost`` (segments a request scored but found compressed by a concurrent request
    at its checkpoint: its plan is dropped before any cell is taken); ``chunked_prefills`` (requests
    whose prompt took more than one forward); ``chunked_prefills_aborted`` (requests released after
    some but not all of their prompt's forwards: a client abort between chunks);
    ``reconstructions_skipped`` (segments left dense because running requests held every slot a KVzip
    pass needed, or because the segment ends too close to the context length for its passes); ``overlap_waits`` (under the overlap schedule, batches formed only after the previous
    batch's results were processed, because its checkpoints stored compressed segments or KVzip work was
    queued), split by why in ``overlap_waits_prefill`` (a request-scope prompt's segment),
    ``overlap_waits_block`` (a block-scope block) and ``overlap_waits_kvzip``; ``splits_without_room``
    (segments left dense because the compressed node they hang inside could not be split: under tensor
    parallelism a split may reserve more cells, and SGLang had no slot for them); ``graph_decodes`` (decode
    batches with compressed requests replayed in a CUDA graph, the ``segments`` graph) and
    ``decode_graph_fallbacks`` (such batches run eagerly because their cells exceed that graph's
    buffers, ``engine.decode_graph``); evictions by kind
    (``dense_nodes_evicted``, ``dense_slots_evicted``, ``compressed_nodes_evicted``,
    ``compressed_cells_evicted``; ``/flush_cache`` not counted). Under ``--kv-evict-when pressure``
    (``engine.deferred``): levels ``deferred_nodes`` (dense nodes holding a plan) and ``deferred_plan_bytes``
    (the host memory those plans take); totals ``nodes_compressed_under_pressure`` and
    ``slots_freed_under_pressure`` (slots those compressions gave back to SGLang), and
    ``compressed_at_checkpoint_under_pressure`` (segments stored compressed at their checkpoint: in the
    checkpoints after SGLang asked for room the pool did not have free, or diverging inside a compressed
    node), ``prompts_admitted_compressed`` (prompts SGLang admitted by their compressed footprint while the
    pool was full: from the first one it could not take dense on), ``pressure_from_waiting_queue`` (times the
    waiting requests' new tokens exceeded the pool's free room and put the tree under pressure before any
    of them was admitted). ``served_histogram`` maps "distinct
    requests a node served" to the number of nodes, over every node created since start.
    """

    compressed_nodes: int = 0
    compressed_tokens: int = 0
    kept_cells: int = 0
    kept_entries: int = 0
    requests_compressed: int = 0
    reuse_hits: int = 0
    reused_tokens: int = 0
    shared_node_hits: int = 0
    compressed_nodes_created: int = 0
    compression_races_lost: int = 0
    chunked_prefills: int = 0
    chunked_prefills_aborted: int = 0
    reconstructions_skipped: int = 0
    splits_without_room: int = 0
    overlap_waits: int = 0
    overlap_waits_prefill: int = 0
    overlap_waits_block: int = 0
    overlap_waits_kvzip: int = 0
    graph_decodes: int = 0
    decode_graph_fallbacks: int = 0
    dense_nodes_evicted: int = 0
    dense_slots_evicted: int = 0
    compressed_nodes_evicted: int = 0
    compressed_cells_evicted: int = 0
    deferred_nodes: int = 0
    deferred_plan_bytes: int = 0
    nodes_compressed_under_pressure: int = 0
    slots_freed_under_pressure: int = 0
    compressed_at_checkpoint_under_pressure: int = 0
    prompts_admitted_compressed: int = 0
    pressure_from_waiting_queue: int = 0
    served_histogram: Counter = field(default_factory=Counter, repr=False)
    # The model's global layers where it has local ones (``local_layers``), for the shares of the snapshot.
    global_layers: tuple[int, ...] = field(default=(), repr=False)
    # Per model layer (this rank's KV heads): entries the compressed nodes keep, and (layer, head, token) slots
    # their tokens hold dense (the same for every layer).
    _kept_by_layer: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64), repr=False)
    _dense_per_layer: int = field(default=0, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _count_entries(self, counts: torch.Tensor, dense: int, sign: int = 1) -> None:
        """``counts`` int64 ``[L, H_kv]``: entries per (layer, KV head) added (``sign`` 1) or removed (-1), with
        ``dense`` (layer, head, token) slots per layer. Called under the lock."""
        per_layer = counts.sum(1)
        if len(self._kept_by_layer) != len(per_layer):
            self._kept_by_layer = torch.zeros_like(per_layer)
        self._kept_by_layer += sign * per_layer
        self._dense_per_layer += sign * dense

    def node_added(self, segment: CompressedSegment) -> None:
        """A compressed node was created; it has served its creator."""
        with self.lock:
            self.compressed_nodes += 1
            self.compressed_tokens += segment.length
            self.kept_cells += segment.num_cells
            self.kept_entries += int(segment.rank_counts.per_rank().sum())
            self._count_entries(segment.counts, segment.length * segment.counts.shape[1])
            self.compressed_nodes_created += 1
            self.served_histogram[1] += 1

    def node_split(self, served: int, extra_cells: int, added: Optional[CompressedSegment] = None) -> None:
        """A compressed node that had served ``served`` requests was split: its head is a new node with
        the same history; tokens are only partitioned, cells too but for ``extra_cells`` more reserved
        (tensor parallelism: ``segments.Split``) and the entries of ``added`` the head gained (local layers'
        window before the split), each in a cell of its own."""
        with self.lock:
            if added is not None:
                self.kept_cells += added.num_entries
                self.kept_entries += added.num_entries
                self._count_entries(added.counts, 0)
            self.kept_cells += extra_cells
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
            self.kept_entries -= int(segment.rank_counts.per_rank().sum())
            self._count_entries(segment.counts, segment.length * segment.counts.shape[1], sign=-1)
            self.compressed_nodes_evicted += 1
            self.compressed_cells_evicted += segment.num_cells

    def dense_node_evicted(self, slots: int) -> None:
        with self.lock:
            self.dense_nodes_evicted += 1
            self.dense_slots_evicted += slots

    def plan_deferred(self, nbytes: int) -> None:
        with self.lock:
            self.deferred_nodes += 1
            self.deferred_plan_bytes += nbytes

    def deferred_plan_dropped(self, nbytes: int) -> None:
        """A dense node's plan was used, split into its parts' plans, or evicted with it."""
        with self.lock:
            self.deferred_nodes -= 1
            self.deferred_plan_bytes -= nbytes

    def compressed_under_pressure(self, slots_freed: int) -> None:
        with self.lock:
            self.nodes_compressed_under_pressure += 1
            self.slots_freed_under_pressure += slots_freed

    def tree_cleared(self) -> None:
        with self.lock:
            self.compressed_nodes = self.compressed_tokens = self.kept_cells = self.kept_entries = 0
            self.deferred_nodes = self.deferred_plan_bytes = 0
            self._kept_by_layer, self._dense_per_layer = torch.zeros(0, dtype=torch.int64), 0

    def overlap_wait(self, reason: str) -> None:
        """The overlap schedule waited for a batch's results, for ``reason`` (``coordinator.SETTLED_FOR_*``)."""
        with self.lock:
            self.overlap_waits += 1
            name = f"overlap_waits_{reason}"
            setattr(self, name, getattr(self, name) + 1)

    def count(self, name: str, amount: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + amount)

    def snapshot(self) -> dict:
        """The counters, plus ``requests_served_per_node`` (power-of-two buckets of ``served_histogram``)
        with its max and mean."""
        with self.lock:
            counters = {name: getattr(self, name) for name in self.__dataclass_fields__ if name not in _NOT_COUNTERS}
            histogram = {served: nodes for served, nodes in self.served_histogram.items() if nodes}
            kept_by_layer, dense = self._kept_by_layer.tolist(), self._dense_per_layer
        buckets: dict[str, int] = {}
        for served in sorted(histogram):
            buckets[served_bucket(served)] = buckets.get(served_bucket(served), 0) + histogram[served]
        nodes = sum(histogram.values())
        return {
            **counters,
            "requests_served_per_node": buckets,
            "requests_served_per_node_max": max(histogram, default=0),
            "requests_served_per_node_mean": sum(s * n for s, n in histogram.items()) / nodes if nodes else 0.0,
            **self._shares(kept_by_layer, dense),
        }

    def _shares(self, kept_by_layer: list[int], dense: int) -> dict:
        """The snapshot's kept shares (empty before any node: nothing to divide)."""
        if not dense:
            return {}
        shares = {"kept_share_by_layer": [round(kept / dense, 4) for kept in kept_by_layer]}
        if self.global_layers:
            global_kept = sum(kept_by_layer[layer] for layer in self.global_layers)
            shares["kept_share_global_layers"] = round(global_kept / (dense * len(self.global_layers)), 4)
            shares["kept_share_all_layers"] = round(sum(kept_by_layer) / (dense * len(kept_by_layer)), 4)
        return shares


_NOT_COUNTERS = ("served_histogram", "lock", "global_layers", "_kept_by_layer", "_dense_per_layer")


