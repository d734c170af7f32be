"""CompressedRadixCache: SGLang's pure-Python ``RadixCache`` with compressed nodes in one KV pool.

After a request's prefill, the tree's ``checkpoint`` turns each segment the request's forward scored
(``Scope.compressible_segments``) into a *compressed node*: the plan's kept entries are copied into arena
cells (``engine.arena``: cells of slots borrowed from SGLang's own pool, so dense and compressed KV
share one memory), the segment's dense slots go back to SGLang, and the node hangs below the request's
path. In request scope the segment's last ``window`` tokens (and later the output) stay an ordinary dense
node inserted by the stock path; a block keeps its window. The request's ``req_to_token`` row then
holds dummy slot 0 over the compressed segment; attention reads those positions from the cells.

A compressed node keeps SGLang's logical bookkeeping intact: its key is the segment's tokens and its
``value`` is dummy slot 0 at every position (``len(value) == len(key)``, so prefix lengths, row
re-pointing and ``prefix_device_indices`` work unchanged). Its data is the ``CompressedSegment`` of its
``NodeRecord`` (``engine.records``).

**Shared prefixes** (``engine.tree_decisions``). A request's segment starts where its match ended, so the
first conversation's node also covers what later conversations share with it (a system prompt) and
they diverge inside it. At such a request's checkpoint the node is *split* at the divergence (its
cells partitioned by position, nothing copied) into a head and a tail; the request's own node, its
plan restricted to ``[divergence, end)``, hangs below the head, and its dense copy of the head's
positions is freed. Positions before the divergence are therefore reused from the first compressor's
selection (chosen with that conversation's observation window); a later request sharing only the
head finds it whole and hangs its own node there too. The same rule holds for blocks.

**Memory** (one pool). A compression never needs free memory: its cells come from holes in borrowed
slots, then from the segment's own dense slots (adopted before they are freed), then from SGLang's
allocator. ``evict`` (SGLang asks for ``n`` free slots) first gives back slots the arena can empty by
moving cells, then (``--kv-evict-when pressure``, ``engine.deferred``) compresses unlocked dense nodes
that hold a plan, then evicts leaves in one order for both kinds (``engine.eviction``: GreedyDual-Size-
Frequency) until enough slots can be given back. SGLang's ledger stays exact: ``evictable_size`` and
``protected_size`` count dense slots of the tree plus the arena's borrowed slots (the ones its locked
cells need at the least are protected), so ``available + evictable + protected + uncached == total``,
SGLang's strict idle check, holds at every step.

Invariants and the methods that keep them:

* **Slot 0 is never freed.** Stock code frees tree values only in ``evict`` (overridden: a compressed
  leaf frees its cells, not its value) and frees a request's row only from ``cache_protected_len`` on;
  compressed segments always lie below ``cache_protected_len`` because only ``_compress`` creates them and
  it moves ``cache_protected_len`` past them in the same step.
* **Compressed content is matched atomically.** A node's content was selected with the observation
  window that followed it, so a request diverging inside one must not reuse part of it: a match passes
  through compressed nodes only whole and ends only at the end of a dense node (or inside one) or of a
  compressed node whose record says ``match_may_end``. Every node has it True except the head of a
  split, so the original node stays all-or-nothing. The stock match and insert never split a
  compressed node (``_split_node`` asserts it); only ``_compress`` does, after locking it.
* **Locks.** A locked compressed node's cells cannot be evicted (they may be moved); ``inc_lock_ref``
  and ``dec_lock_ref`` count them for the arena and keep compressed nodes out of the dense counters.

**A store, driven by the coordinator** (``engine.coordinator``): the tree decides nothing about what to
compress. ``checkpoint`` asks the coordinator for the request's ready plans (``handover``), stores them
in position order, then inserts the rest of the request densely, never past a segment still in flight
(its tokens stay the request's own until their plan is stored). ``match_prefix`` and ``on_release``
tell the coordinator a request began and ended; what the coordinator and the attention backends read
of a request's compressed path is its ``PathView`` (``engine.paths``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from array import array
from typing import Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sgl_kvevict.engine.arena import Arena
from sgl_kvevict.engine.coordinator import CompressionCoordinator, ReadyPlan
from sgl_kvevict.engine.deferred import PREFILL, PRESSURE, DeferredPlan
from sgl_kvevict.engine.eviction import CompressedTreeOrder, GreedyDualSizeFrequency, NodeCost
from sgl_kvevict.engine.paths import compressed_nodes, is_compressed, match_may_end
from sgl_kvevict.engine.records import RECORD_ATTR, NodeRecord, node_record, request_record
from sgl_kvevict.engine.segments import CompressedSegment, SpareCells, Split
from sgl_kvevict.engine.stats import EngineStats
from sgl_kvevict.engine.tree_decisions import Outcome, Walk, atomic_prefix_length, cached_prefix_length, decide_compression
from sgl_kvevict.local_layers import LocalLayers
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.sharding import RankCounts

# Under pressure: once SGLang asks the tree for room that moves alone cannot give (the pool is full), the
# segments of this many checkpoints are compressed at once (as at prefill) before prompts stay dense again.
# While the pool stays full every new prompt would be compressed cold soon anyway, and compressed at once it
# also shrinks what its running request reads at every decode step and the room running requests lock
# (deferred, their dense prompts crowd the pool and SGLang evicts cached prompts instead: ``engine.deferred``).
PRESSURE_CHECKPOINTS = 64


class CompressedRadixCache(RadixCache):
    """params: SGLang's; coordinator: what to compress (it never calls the tree: a request's compressed
    path is read through ``engine.paths``); arena: the compressed cells; stats: the engine's counters;
    order: the eviction order; local_layers: the model's local attention layers (a split head gains their
    window before the split); compress_when: ``prefill`` stores a scored segment compressed at its
    checkpoint, ``pressure`` keeps it dense with its plan until ``evict`` needs the room
    (``engine.deferred``). Built by ``factory.build_engine``."""

    def __init__(
        self,
        params: CacheInitParams,
        coordinator: CompressionCoordinator,
        arena: Arena,
        stats: EngineStats,
        order: Optional[CompressedTreeOrder] = None,
        local_layers: Optional[LocalLayers] = None,
        compress_when: str = PREFILL,
    ):
        self.coordinator = coordinator
        self.defers = compress_when == PRESSURE
        self.arena = arena
        self.stats = stats
        self.local_layers = local_layers
        self.order = GreedyDualSizeFrequency() if order is None else order
        super().__init__(params)  # calls reset()
        self.eviction_strategy = self.order  # SGLang's slot for the eviction order
        self.kv_pool = params.token_to_kv_pool_allocator.get_kvcache()

    # ---- tree shape ----------------------------------------------------------------------------

    def reset(self):
        super().reset()
        setattr(self.root_node, RECORD_ATTR, NodeRecord())
        self._deferred: dict[int, TreeNode] = {}  # id -> a dense node with a plan (``engine.deferred``)
        # Checkpoints since SGLang last asked for room the pool did not have free: until PRESSURE_CHECKPOINTS
        # have passed without, checkpoints compress at once, as at prefill.
        self._checkpoints_since_pressure = PRESSURE_CHECKPOINTS
        self.arena.reset()
        self.order.reset()
        self.stats.tree_cleared()

    def _walk(self, key: RadixKey, node: Optional[TreeNode] = None, offset: int = 0) -> Walk:
        """Read-only match of ``key[offset:]`` below ``node`` (the root by default; ``offset`` is
        ``node``'s depth)."""
        node = self.root_node if node is None else node
        passed = []
        while offset < len(key):
            rest = key[offset:]
            child = node.children.get(rest.child_key(self.page_size))
            if child is None:
                break
            matched = child.key.match(rest, page_size=self.page_size)
            if matched < len(child.key):
                return Walk(tuple(passed), offset, child, matched)
            passed.append(child)
            node, offset = child, offset + matched
        return Walk(tuple(passed), offset)

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        if params.req is not None:
            self.coordinator.on_request_begin(params.req)
        return super().match_prefix(params)

    def _match_prefix_helper(self, node: TreeNode, key: RadixKey):
        limit = atomic_prefix_length(self._walk(key), len(key), is_compressed, match_may_end)
        if limit == 0:
            node.last_access_time = time.monotonic()
            return [], node
        return super()._match_prefix_helper(node, key[:limit])

    def _insert_helper(self, node: TreeNode, key: RadixKey, value, priority: int = 0, inserted_len: int = 0):
        limit = atomic_prefix_length(self._walk(key), len(key), is_compressed, match_may_end)
        prefix_len, last = super()._insert_helper(node, key[:limit], value[:limit], priority, inserted_len)
        if not hasattr(last, RECORD_ATTR):  # a node the stock insert just made
            setattr(last, RECORD_ATTR, NodeRecord())
            self.order.created(node_record(last), self._cost(last))
        return prefix_len, last

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int):
        assert not is_compressed(child), "matching and inserting never split a compressed node"
        head = super()._split_node(key, child, split_len)
        setattr(head, RECORD_ATTR, NodeRecord())
        self.order.inherit(node_record(head), node_record(child))
        deferred = self._undefer(child)
        if deferred is not None:  # each part keeps its positions' entries
            head_plan, tail_plan = deferred.split(deferred.start + split_len)
            self._defer(child, tail_plan)
            # A head of a model with local layers would lack their window before the split: it stays dense.
            if self.local_layers is None:
                self._defer(head, head_plan)
        return head

    def _defer(self, node: TreeNode, deferred: DeferredPlan) -> None:
        """Keep ``deferred`` on dense ``node`` until ``evict`` needs its room (none: it evicts nothing)."""
        if deferred.evicts_anything():
            node_record(node).deferred = deferred
            self._deferred[id(node)] = node
            self.stats.plan_deferred(deferred.nbytes)

    def _undefer(self, node: TreeNode) -> Optional[DeferredPlan]:
        """Take ``node``'s plan off it (None: it had none)."""
        record = node_record(node)
        deferred, record.deferred = record.deferred, None
        if deferred is not None:
            del self._deferred[id(node)]
            self.stats.deferred_plan_dropped(deferred.nbytes)
        return deferred

    def _split_compressed_node(
        self, node: TreeNode, split_len: int, split: Split, spare: Optional[SpareCells],
        head_window: Optional[CompressedSegment] = None,
    ) -> TreeNode:  # fmt: skip
        """Split compressed ``node`` after its first ``split_len`` tokens as the stock split does (lock
        count, priority and hit count copied to the head); returns the head, which a match may pass
        through but not end at. The cells are partitioned by position, none is copied; ``spare`` holds
        the extra cells the parts reserve (``Split.extra``), None when there are none; ``head_window``:
        the stored entries the head gains in local layers (``_head_window``), merged into it."""
        record = node_record(node)
        segment = record.segment
        spares_used = 0
        for part, taken, missing in zip(split.parts, split.taken, (split.missing(0), split.missing(1))):
            part.owner_id = self.arena.register(part)
            self.arena.transfer(segment, taken, part, torch.arange(len(taken)))
            if missing:
                extra = torch.arange(spares_used, spares_used + missing)
                self.arena.transfer(spare, extra, part, torch.arange(len(taken), part.num_cells))
                spares_used += missing
        self.arena.forget(segment)
        if spare is not None:
            self.arena.forget(spare)
        added = 0 if head_window is None else head_window.num_entries
        if node.lock_ref > 0:  # the parts' cells count as locked as the node's did
            self.arena.lock(split.extra + added)
        head_segment, tail_segment = split.parts
        if head_window is not None:
            head_segment = self._merged(head_segment, head_window)
        head = super()._split_node(node.key, node, split_len)
        head_record = NodeRecord(segment=head_segment, match_may_end=False, requests_served=record.requests_served)
        self.order.inherit(head_record, record)
        setattr(head, RECORD_ATTR, head_record)
        record.segment = tail_segment
        self.stats.node_split(record.requests_served, split.extra, head_window)
        return head

    def _merged(self, segment: CompressedSegment, added: CompressedSegment) -> CompressedSegment:
        """``segment`` and ``added`` (both stored, the same range) as one segment owning both's cells."""
        merged, from_segment, from_added = segment.merged(added)
        merged.owner_id = self.arena.register(merged)
        for part, indices in ((segment, from_segment), (added, from_added)):
            self.arena.transfer(part, torch.arange(part.num_cells), merged, indices)
            self.arena.forget(part)
        return merged

    # ---- accounting: dense slots in the tree, plus the arena's borrowed slots --------------------

    def evictable_size(self):
        arena = self.arena
        return self.evictable_size_ + arena.slots_borrowed - arena.slots_protected

    def protected_size(self):
        return self.protected_size_ + self.arena.slots_protected

    def _compressed_on_path(self, node: TreeNode, lock_ref: int) -> list[CompressedSegment]:
        """Segments of the compressed nodes on ``node``'s path whose lock count is ``lock_ref``."""
        segments = []
        while node is not self.root_node:
            if node.lock_ref == lock_ref and is_compressed(node):
                segments.append(node_record(node).segment)
            node = node.parent
        return segments

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        newly_locked = [] if self.disable else self._compressed_on_path(node, lock_ref=0)
        result = super().inc_lock_ref(node)
        # The stock method moved these nodes' tokens to protected_size_; they hold no dense slot.
        tokens = sum(segment.length for segment in newly_locked)
        self.evictable_size_ += tokens
        self.protected_size_ -= tokens
        self.arena.lock(sum(segment.num_cells for segment in newly_locked))
        return dataclasses.replace(result, delta=result.delta + tokens)

    def dec_lock_ref(self, node: TreeNode, params=None) -> DecLockRefResult:
        unlocked = [] if self.disable else self._compressed_on_path(node, lock_ref=1)
        result = super().dec_lock_ref(node, params)
        tokens = sum(segment.length for segment in unlocked)
        self.evictable_size_ -= tokens
        self.protected_size_ += tokens
        self.arena.unlock(sum(segment.num_cells for segment in unlocked))
        return dataclasses.replace(result, delta=result.delta - tokens)

    def _delete_leaf(self, node: TreeNode):
        if is_compressed(node):
            self.evictable_size_ += len(node.key)  # the stock method subtracts it; it was never added
        super()._delete_leaf(node)

    def memory_levels(self) -> dict:
        """Thread-safe single loads of the pool's and the arena's levels (the stats snapshot's)."""
        arena = self.arena
        return {
            "kv_slots_total": self.token_to_kv_pool_allocator.size,
            "kv_slots_free": int(self.token_to_kv_pool_allocator.available_size()),
            "arena_cells_per_slot": arena.cells_per_slot,
            "arena_slots_borrowed": arena.slots_borrowed,
            "arena_cells_used": arena.cells_used,
            "arena_cells_free": arena.cells_free,
            "arena_cells_moved": arena.cells_moved,
            "arena_slots_returned_by_moves": arena.slots_given_back_by_moves,
        }

    # ---- eviction: one order for dense and compressed leaves ------------------------------------

    def _cost(self, node: TreeNode) -> NodeCost:
        """What keeping ``node`` is worth: its tokens, and the slots evicting it frees."""
        segment = node_record(node).segment
        slots = len(node.value) if segment is None else segment.num_cells / self.arena.cells_per_slot
        return NodeCost(len(node.key), slots)

    def path_slots(self, node: TreeNode) -> int:
        """Slots the path from the root to ``node`` holds (what a request that matched it keeps locked)."""
        slots = 0.0
        while node is not self.root_node:
            slots += self._cost(node).slots
            node = node.parent
        return math.ceil(slots)

    def evict(self, params: EvictParams) -> EvictResult:
        """Free ``params.num_tokens`` slots into SGLang's allocator: moves first (nothing is lost), then
        leaves in the order's priority until the arena can give back what is still missing."""
        if self.disable:
            return EvictResult()
        start_time = time.perf_counter()
        arena, wanted = self.arena, params.num_tokens
        freed = arena.release_slots(wanted)
        if self.defers and freed < wanted:
            self.felt_pressure()
            freed += self._compress_cold(wanted - freed)
        heap = [(self.order.get_priority(leaf), leaf) for leaf in self.evictable_leaves]
        heapq.heapify(heap)
        while heap and freed + arena.slots_reclaimable_by_moves < wanted:
            priority, leaf = heapq.heappop(heap)
            freed += self._evict_leaf(leaf)
            self.order.evicted(priority)
            parent = leaf.parent
            if len(parent.children) == 0 and parent.lock_ref == 0 and parent is not self.root_node:
                heapq.heappush(heap, (self.order.get_priority(parent), parent))
        if freed < wanted:
            freed += arena.release_slots(wanted - freed)
        self.update_eviction_metrics(freed, start_time)
        return EvictResult(num_tokens_evicted=freed)

    @property
    def under_pressure(self) -> bool:
        """Whether SGLang asked for room the pool did not have free within the last ``PRESSURE_CHECKPOINTS``
        checkpoints: checkpoints then compress at once, and admission counts prompts compressed."""
        return self._checkpoints_since_pressure < PRESSURE_CHECKPOINTS

    def felt_pressure(self) -> None:
        """SGLang needs room the pool does not have free: an ``evict`` that moves alone cannot satisfy, or a
        prompt its admission would keep waiting dense (``admission.prefill_admission``)."""
        self._checkpoints_since_pressure = 0

    def weigh_waiting(self, waiting: list) -> None:
        """Before SGLang admits from its waiting queue (``scheduler_hooks.weigh_waiting_queue``): where the
        waiting requests' new tokens (each prompt and output so far, less what a match would reuse) exceed
        what the pool has free or can free by moves, stock would now evict cached prompts to serve them, so
        the tree is under pressure before the first of them is admitted dense. Admitted a chunk at a time,
        the queue otherwise reaches a prompt the pool cannot take only after the first ones, and the
        prefixes they share with the rest, were prefilled and are read dense by their running requests."""
        room = self.token_to_kv_pool_allocator.available_size() + self.arena.slots_reclaimable_by_moves
        demand = 0
        for req in waiting:
            ids = array("q", req.origin_input_ids)
            ids.extend(req.output_ids)
            key = RadixKey(ids, req.extra_key, cache_salt=req.cache_salt)
            demand += len(key) - cached_prefix_length(self._walk(key), len(key), is_compressed, match_may_end)
            if demand > room:
                self.felt_pressure()
                self.stats.count("pressure_from_waiting_queue")
                return

    def _compress_cold(self, wanted: float) -> int:
        """Compress unlocked dense nodes with a plan, coldest first in the eviction order, until ``wanted``
        slots are given back or reclaimable by moves; returns the slots given back to SGLang."""
        order = self.order
        candidates = sorted((order.get_priority(node), node) for node in self._deferred.values() if node.lock_ref == 0)
        freed = 0
        for _, node in candidates:
            if freed + self.arena.slots_reclaimable_by_moves >= wanted:
                break
            freed += self._compress_in_place(node)
        return freed

    def _compress_in_place(self, node: TreeNode) -> int:
        """Turn unlocked dense ``node`` into a compressed node with its plan; returns the slots given back.
        Its children stay as they are (a compressed node's children may be dense), no request reads it (it
        is unlocked), and the paths below it see its cells from the next view on."""
        assert node.lock_ref == 0, "a node a request reads is never compressed under it"
        deferred = self._undefer(node)
        before = self._cost(node)
        [segment], freed = self._store(node.value, [(deferred.plan, deferred.rank_counts)], deferred.start, deferred.end)
        node.value = torch.zeros(len(node.key), dtype=torch.int64, device=self.device)  # dummy slot 0
        record = node_record(node)
        record.segment, record.match_may_end, record.requests_served = segment, deferred.match_may_end, 1
        self.evictable_size_ -= len(node.key)  # its dense slots were evictable; its cells count as the arena's
        self.order.resized(record, before, self._cost(node))
        self.arena.paths_changed()
        self.stats.compressed_under_pressure(freed)
        return freed

    def _evict_leaf(self, leaf: TreeNode) -> int:
        """Free the leaf's storage and delete it; returns the slots given back to SGLang (a dense leaf's;
        a compressed leaf's cells go back to the arena, whose slots ``evict`` releases after)."""
        self._undefer(leaf)
        segment = node_record(leaf).segment
        if segment is not None:
            self.arena.free(segment, segment.cells)
            freed = 0
            self.arena.forget(segment)
            self.stats.compressed_node_evicted(segment)
        else:
            self.token_to_kv_pool_allocator.free_segment(leaf.value, start_pos=0)
            freed = len(leaf.value)
            self.stats.dense_node_evicted(freed)
        self._delete_leaf(leaf)
        self.kv_events.record_remove(leaf)
        return freed

    # ---- checkpoint: store the ready plans, then insert what is left densely ---------------------

    def checkpoint(self, req, *, up_to: int):
        """``RadixCache.checkpoint`` with the request's ready plans stored first (``handover``).

        The stock method asserts that the tree now holds the whole key; here an insert stops at a
        compressed node the key diverges inside, so the request adopts the tree's path up to where it
        stops and keeps the rest of its row as its own (freed with the row, as any uncached tail). It
        also stops where the request's first segment still in flight begins.
        """
        if self.disable:
            return
        record = request_record(req)
        if record is None:  # never matched through this tree: the stock checkpoint
            self._insert_dense(req, up_to, split_prompt=True)
            return
        first_checkpoint = not record.use_counted
        matched = compressed_nodes(req.last_node)
        if first_checkpoint:
            record.use_counted = True
            self._count_use(req.last_node)
        handover = self.coordinator.handover(req, final=req.finished())
        created = [node for ready in handover.ready if (node := self._compress(req, ready))]
        if created and not record.stored_any:
            record.stored_any = True
            self.stats.count("requests_compressed")
        end = up_to if handover.hold_from is None else min(up_to, handover.hold_from)
        if end > req.kv.cache_protected_len:
            self._insert_dense(req, end, split_prompt=True)
        if first_checkpoint:  # heads it hangs below, and nodes a concurrent request compressed first
            known = {id(node) for node in matched + created}
            for node in compressed_nodes(req.last_node):
                if id(node) not in known:
                    self._count_served(node)

    def on_release(self, req, *, checkpointed: bool) -> None:
        """The request's row is freed and its lock dropped. While the pool is full (``PRESSURE_CHECKPOINTS``),
        the dense prompts with a plan that no running request reads any more are compressed now, not at the
        next request for room: the next turn of a conversation then reads its history compressed, as under
        ``prefill``, instead of locking it dense again for the whole turn."""
        self.coordinator.on_request_end(req)
        if self.defers and self.under_pressure:
            self._compress_cold(math.inf)  # every unlocked one

    def _insert_dense(self, req, end: int, split_prompt: bool = False) -> None:
        """Insert the request's tokens ``[0, end)`` as the stock checkpoint does and adopt the tree's path."""
        radix_key, _, _ = self._insert_cache(req, req.full_untruncated_fill_ids[:end], split_prompt=split_prompt)
        self._adopt_path(req, self.match_prefix(MatchPrefixParams(key=radix_key)).last_device_node)

    def _count_use(self, matched: TreeNode) -> None:
        """A request's match ended at ``matched``: every node on the path served it once more."""
        reused = compressed_nodes(matched)
        if reused:
            stats = self.stats
            stats.count("reuse_hits")
            stats.count("reused_tokens", sum(len(node.key) for node in reused))
            stats.count("shared_node_hits", len(reused))
            for node in reused:
                self._count_served(node)
        node = matched
        while node is not self.root_node:
            self.order.reused(node_record(node), self._cost(node))
            node = node.parent

    def _count_served(self, node: TreeNode) -> None:
        record = node_record(node)
        self.stats.node_served(record.requests_served)
        record.requests_served += 1

    def _adopt_path(self, req, node: TreeNode) -> None:
        """Point the request's row at the tree's values up to ``node``; the tree now protects them."""
        path = self.path_device_indices(node)
        protected = req.kv.cache_protected_len
        assert len(path) >= protected, (req.rid, len(path), protected)
        self.req_to_token_pool.write((req.kv.req_pool_idx, slice(protected, len(path))), path[protected:])
        req.kv.cache_protected_len = len(path)
        self.unlock(req.lock)
        req.lock = self.lock(node)
        req.last_node = node

    def _compress(self, req, ready: ReadyPlan) -> Optional[TreeNode]:
        """Turn the request's segment into a compressed node below its path and adopt it; None when the segment
        stays dense (``engine.tree_decisions``)."""
        spec = ready.spec
        if spec.start > req.kv.cache_protected_len:
            self._insert_dense(req, spec.start)  # an earlier block of this request stayed dense
        start, end = req.kv.cache_protected_len, ready.node_end
        if spec.start != start or len(self.path_device_indices(req.last_node)) != start:
            return None  # the row changed since the forward scored it (e.g. retraction), or the insert stopped short
        if ready.rank_counts.restricted(start, end).keeps_everything():
            return None  # nothing evicted: the policy kept the segment whole (on every rank)
        key = RadixKey(req.full_untruncated_fill_ids[:end], req.extra_key, cache_salt=req.cache_salt)
        walk = self._walk(key, req.last_node, start)
        decision = decide_compression(walk, req.last_node, end, is_compressed, match_may_end)
        if decision.outcome is Outcome.LOST_RACE:
            self.stats.count("compression_races_lost")
        if decision.outcome is not Outcome.COMPRESS:
            return None
        if self.defers:
            # A prompt admitted by its compressed footprint is compressed whole, however long its prefill.
            at_once = self.under_pressure or request_record(req).admitted_compressed
            self._checkpoints_since_pressure += 1
            if decision.split_node is None and not at_once:
                self._insert_deferred(req, ready, decision.own_start, end)
                return None
            self.stats.count("compressed_at_checkpoint_under_pressure")
        # Under pressure too, a segment diverging inside a compressed node (one the pool's pressure compressed)
        # is compressed now: it could not enter the tree dense, as the node is matched whole or not at all; so
        # is every segment for a while after SGLang asked for room the pool did not have free.
        # Hanging the node may split a compressed node: lock what it hangs on while cells are taken.
        anchor = self.lock(decision.split_node or decision.parent)
        try:
            split, spare, parts = None, None, []
            if decision.split_node is not None:
                split_segment = node_record(decision.split_node).segment
                split = split_segment.split(split_segment.start + decision.split_offset)
                spare = self._spare_cells(split.extra)
                if split.extra and spare is None:
                    self.stats.count("splits_without_room")
                    return None
                head_window = self._head_window(split.parts[0])
                if head_window is not None:  # copied from this request's dense slots, like its own entries
                    parts.append((head_window, RankCounts.of_plan(head_window)))
            own = decision.own_start
            row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            (segment, *head_additions), _ = self._store(
                row[start:end], [(ready.plan.restricted(own, end), ready.rank_counts.restricted(own, end)), *parts], start, end
            )  # fmt: skip
            parent = decision.parent
            if split is not None:
                parent = self._split_compressed_node(
                    decision.split_node, decision.split_offset, split, spare, *head_additions
                )  # fmt: skip
            node = self._attach_compressed_node(parent, key[decision.own_start :], segment, req.priority or 0)
            self._adopt_path(req, node)
            return node
        finally:
            self.unlock(anchor)

    def _insert_deferred(self, req, ready: ReadyPlan, own_start: int, end: int) -> None:
        """Insert the request's tokens up to ``end`` dense and keep its plan of ``[own_start, end)`` on the node
        that holds exactly those positions (``engine.deferred``); where another request's node holds some of
        them, it stays dense without a plan."""
        self._insert_dense(req, end)
        node = req.last_node
        if node is self.root_node or is_compressed(node) or len(node.key) != end - own_start:
            return
        self._defer(node, DeferredPlan(ready.plan.restricted(own_start, end), ready.rank_counts.restricted(own_start, end)))

    def _spare_cells(self, count: int) -> Optional[SpareCells]:
        """``count`` cells taken from the arena for a split (None: zero, or SGLang has no slot for them)."""
        if count == 0:
            return None
        spare = SpareCells(count)
        spare.owner_id = self.arena.register(spare)
        if self.arena.alloc(spare, count) is None:
            self.arena.forget(spare)
            return None
        return spare

    def _head_window(self, head: CompressedSegment) -> Optional[CompressionPlan]:
        """What ``head`` (a split's) lacks of its local layers' window (None: nothing, or a model without
        local layers): ``LocalLayers.window_before``."""
        local = self.local_layers
        if local is None:
            return None
        num_layers, num_kv_heads = head.counts.shape
        return local.window_before(head.start, head.end, head.layer_positions(local.layers[0]), num_layers, num_kv_heads)

    def _store(
        self, slots: torch.Tensor, plans: list[tuple[CompressionPlan, RankCounts]], start: int, end: int
    ) -> tuple[list[CompressedSegment], int]:
        """Copy the entries of ``plans`` (each with its rank counts: the request's own node, then what a split
        head gains; every entry inside ``[start, end)``) from the segment's dense slots (``slots`` ``[end -
        start]``: a request's ``req_to_token`` row there, or a dense node's value) into arena cells and free
        those slots; the slots the arena needs are adopted from the segment itself, so a compression never
        waits for memory. Returns the segments and the slots given back to SGLang."""
        segment_slots = slots.to(torch.int64).cpu()
        arena, space = self.arena, self.arena.space
        segments, sources, adopted = [], [], torch.empty(0, dtype=torch.int64)
        for plan, rank_counts in plans:
            segment = CompressedSegment.of_plan(plan, rank_counts)
            segment.owner_id = arena.register(segment)
            sources.append(space.entry_rows(segment.layer_ids(), segment_slots[segment.positions - start], segment.head_ids()))
            taken = arena.alloc(segment, segment.num_cells, adoptable=segment_slots[~torch.isin(segment_slots, adopted)])
            assert taken is not None, "the segment's own slots always hold its reserved cells"
            adopted = torch.cat([adopted, taken])
            segments.append(segment)
        sources = torch.cat(sources)
        # A source in an adopted slot may be overwritten by another entry's copy: read those first.
        at_risk = torch.isin(space.slot_of(sources), adopted)
        saved_k, saved_v = space.k_rows[sources[at_risk].to(space.device)], space.v_rows[sources[at_risk].to(space.device)]
        entry_cells = torch.cat([segment.entry_cells for segment in segments])
        space.copy(sources[~at_risk], entry_cells[~at_risk])
        targets = entry_cells[at_risk].to(space.device)
        space.k_rows[targets], space.v_rows[targets] = saved_k, saved_v
        freed = segment_slots[~torch.isin(segment_slots, adopted)]
        self.token_to_kv_pool_allocator.free(freed.to(slots.device))
        self.stats.node_added(segments[0])
        return segments, len(freed)

    def _attach_compressed_node(
        self, parent: TreeNode, key: RadixKey, segment: CompressedSegment, priority: int
    ) -> TreeNode:
        node = TreeNode(priority=priority)
        node.parent = parent
        node.key = key
        node.value = torch.zeros(len(key), dtype=torch.int64, device=self.device)  # dummy slot 0
        setattr(node, RECORD_ATTR, NodeRecord(segment=segment, requests_served=1))
        parent.children[key.child_key(self.page_size)] = node
        # Not added to evictable_size_: it holds no dense slot.
        self._update_leaf_status(parent)
        self._update_leaf_status(node)
        self.order.created(node_record(node), self._cost(node))
        self.kv_events.record_store(node)
        return node
