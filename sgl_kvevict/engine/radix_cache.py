"""CompressedRadixCache: SGLang's pure-Python ``RadixCache`` with compressed nodes.

Request scope (DESIGN.md §4). After a request's prefill, the tree's ``checkpoint`` compresses the
request's own prompt span ``[cache_protected_len, prompt_end - window)`` with the plan its
compressor built from the forward's ``observe`` calls: kept entries are copied into arena cells, the
span's dense slots go back to SGLang's allocator, and the span becomes a *compressed node* below the
request's matched node. The last ``window`` prompt tokens (and later the output) are inserted as an
ordinary dense node by the stock insert path. The request's ``req_to_token`` row then holds dummy
slot 0 over the compressed span; attention reads those positions from the cells instead.

Shared prefixes in request scope. A request's span starts where its match ended, so the first
conversation's node also covers whatever later conversations share with it (a chat template's
system prompt), and they diverge inside it. At such a request's checkpoint the tree *splits* that
node at the divergence (``CompressedSegment.split``: its cells partitioned by position, nothing
copied) into a head and a tail, hangs the request's own node for ``[divergence, span end)`` below
the head (its plan restricted to those positions, ``skip_plan_prefix``), frees the request's dense
copy of the head's positions and re-points its row. Positions before the divergence are therefore
reused from the first compressor's selection, chosen with that conversation's observation window;
the request's own selection of them is dropped. A later request sharing the same prefix finds the
head whole and hangs its node there too, so every conversation is compressed, however many share
the prefix. Block scope never splits (blocks are aligned at position 0, so they are shared whole).

Block scope (shared prefixes). The spans are the blocks ``[k * B, (k + 1) * B)`` of the request's
own prompt tokens that end before its last token (``BlockScope.compressible_spans``), each scored by
its own last ``window`` tokens and kept whole as one compressed node, window included. The
checkpoint compresses them in order, each below the one before; a span that cannot be compressed
(the policy kept it whole, the arena is full, another request holds it) is inserted densely first,
so the next block still hangs at its logical start. Matching is unchanged: any request with the same
first ``k`` blocks matches those ``k`` nodes whole and prefills from there. The prompt's tail after
its last block, the question and the output are dense, exactly as a request-scope window is.

Concurrent requests needing the same new block (same batch, or admitted before the first one's
checkpoint) each score it; the first checkpoint compresses it and the later ones find it in the
tree *before taking any cell*: their plan is dropped (``block_races_lost``), their dense copy of the
block is freed by the insert that adopts the first one's node, and their later blocks hang below it.
A block is therefore stored once; waiting for the first request instead would need the scheduler
to hold requests back, which the tree cannot do, and costs more latency than one extra ``[w, B]``
scoring per layer.

A compressed node keeps SGLang's logical bookkeeping intact: its key is the span's tokens and its
``value`` is dummy slot 0 at every position (``len(value) == len(key)``, so prefix lengths, row
re-pointing and ``prefix_device_indices`` work unchanged). Its data is the ``CompressedSegment`` in
``node.kvevict_segment``.

Invariants and the methods that keep them:

* **Slot 0 is never freed.** Stock code frees tree values only in ``evict`` (overridden: a
  compressed leaf frees its cells, not its value) and frees a request's row only from
  ``cache_protected_len`` on (``_insert_cache`` duplicates, ``free_kv_row``); compressed spans always
  lie below ``cache_protected_len`` because only the tree's own checkpoint creates them and it moves
  ``cache_protected_len`` past them in the same step.
* **Dense accounting is exact.** ``evictable_size_``/``protected_size_`` count dense slots only
  (SGLang's admission budget and its strict idle check add them to the allocator's free slots): a
  compressed node is never added to them, and ``inc_lock_ref``/``dec_lock_ref``/``_delete_leaf``,
  which move ``len(node.key)`` for every node, are compensated for compressed nodes. Cells have
  their own ledger (``Arena``).
* **Compressed content is matched atomically.** A node's content was selected with the
  observation window that followed it, so a request diverging inside one must not reuse part of it:
  a match passes through compressed nodes only whole, and ends only at the end of a dense node (or
  inside one) or of a compressed node whose ``kvevict_match_end`` is True (``match_may_end``). Every
  node has it True except the head of a split, so a request diverging inside the tail, or between
  the head and its children, matches only up to the head's start, exactly as before the split: the
  original node is still all-or-nothing. An insert stops at the same point (the rest of the
  inserting request's tokens stay request-owned and are freed with its row). The stock match and
  insert never split a compressed node (``_split_node`` asserts it); only ``_compress`` does, through
  ``_split_compressed_node``, after locking the node so that the cell allocation cannot evict it.
  A head keeps the stock split's bookkeeping (lock count copied), so the lock compensation below
  holds for head and tail as it did for the whole node; a head with children is no leaf, and once
  its children are evicted it is an ordinary compressed leaf whose eviction frees its cells.
* **Arena pressure** evicts LRU leaves (dense leaves included: a compressed node is usually the
  parent of its dense window node) until the new segment's cells fit; if the tree cannot free enough
  (locked), the request stays dense and ``requests_left_dense`` counts it.

Chunked prefill: middle chunks are checkpointed densely by the stock path, so only the span of the
last chunk (the one holding the window) is compressed. Serve with chunked prefill off, or chunks
larger than the prompts, to compress whole prompts.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from typing import Callable, Optional

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

from sgl_kvevict.engine.segments import CompressedSegment, skip_plan_prefix, truncate_plan
from sgl_kvevict.engine.state import EngineState, request_state
from sgl_kvevict.kernels import ArenaCellMap, gather_kv_to_arena
from sgl_kvevict.policies.base import SegmentCompressor

logger = logging.getLogger(__name__)

SEGMENT_ATTR = "kvevict_segment"
# Distinct requests a compressed node served: its creator, then each request whose path took it.
SERVED_ATTR = "kvevict_requests_served"
# False on the head of a split compressed node: a match may pass through it but not end at it.
MATCH_END_ATTR = "kvevict_match_end"


def compressed_segment(node: TreeNode) -> Optional[CompressedSegment]:
    return getattr(node, SEGMENT_ATTR, None)


def match_may_end(node: TreeNode) -> bool:
    """A match may end at ``node``'s end: always for a dense node, not for a split head."""
    return getattr(node, MATCH_END_ATTR, True)


def compressed_nodes(node: TreeNode) -> list[TreeNode]:
    """The compressed nodes from the root down to ``node``, root first."""
    nodes = []
    while node.parent is not None:  # the root has no parent
        if compressed_segment(node) is not None:
            nodes.append(node)
        node = node.parent
    return nodes[::-1]


def compressed_path(node: TreeNode) -> list[CompressedSegment]:
    """The compressed segments from the root down to ``node``, root first."""
    return [compressed_segment(path_node) for path_node in compressed_nodes(node)]


@dataclasses.dataclass(frozen=True)
class Walk:
    """A read-only match of a key against the tree (``CompressedRadixCache._walk``).

    passed: the nodes the key covers whole, in path order; covered: the key's length up to the end
    of the last of them; partial: the node the key diverges or ends inside, or None;
    partial_matched: the key's tokens that match inside ``partial``.
    """

    passed: list[TreeNode]
    covered: int
    partial: Optional[TreeNode] = None
    partial_matched: int = 0


class CompressedRadixCache(RadixCache):
    def __init__(self, params: CacheInitParams, engine: EngineState):
        self.engine = engine  # before super().__init__, which calls reset()
        super().__init__(params)
        self.kv_pool = params.token_to_kv_pool_allocator.get_kvcache()

    # ---- tree shape ----------------------------------------------------------------------------

    def reset(self):
        super().reset()
        self.engine.arena.reset()
        self.engine.stats.tree_cleared()

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
                return Walk(passed, offset, child, matched)
            passed.append(child)
            node, offset = child, offset + matched
        return Walk(passed, offset)

    def _atomic_prefix_length(self, key: RadixKey) -> int:
        """Length of the longest prefix of ``key`` that matching or inserting may take: it ends at
        the end of a node a match may end at, or inside a dense node (the stock split), or covers the
        whole key when the key leaves the tree at such a point (the rest is new)."""
        walk = self._walk(key)
        limit = offset = 0
        for node in walk.passed:
            offset += len(node.key)
            if match_may_end(node):
                limit = offset
        if limit == walk.covered and (walk.partial is None or compressed_segment(walk.partial) is None):
            return len(key)
        return limit

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        if params.req is not None:
            self.engine.track(params.req)
        return super().match_prefix(params)

    def _match_prefix_helper(self, node: TreeNode, key: RadixKey):
        limit = self._atomic_prefix_length(key)
        if limit == 0:
            node.last_access_time = time.monotonic()
            return [], node
        return super()._match_prefix_helper(node, key[:limit])

    def _insert_helper(self, node: TreeNode, key: RadixKey, value, priority: int = 0, inserted_len: int = 0):
        limit = self._atomic_prefix_length(key)
        return super()._insert_helper(node, key[:limit], value[:limit], priority, inserted_len)

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int):
        assert compressed_segment(child) is None, "matching and inserting never split a compressed node"
        return super()._split_node(key, child, split_len)

    def _split_compressed_node(self, node: TreeNode, split_len: int) -> TreeNode:
        """Split compressed ``node`` after its first ``split_len`` tokens as the stock split does
        (lock count, priority and hit count copied to the head); returns the head, which a match
        may pass through but not end at. Request scope only (module doc)."""
        segment = compressed_segment(node)
        head_segment, tail_segment = segment.split(segment.start + split_len)
        head = super()._split_node(node.key, node, split_len)
        setattr(head, SEGMENT_ATTR, head_segment)
        setattr(head, MATCH_END_ATTR, False)
        setattr(head, SERVED_ATTR, getattr(node, SERVED_ATTR))
        setattr(node, SEGMENT_ATTR, tail_segment)
        self.engine.stats.node_split(getattr(node, SERVED_ATTR))
        return head

    # ---- dense-slot accounting: compressed nodes hold none -----------------------------------------

    def _compressed_len_on_path(self, node: TreeNode, lock_ref: int) -> int:
        """Logical tokens of the compressed nodes on ``node``'s path whose lock count is ``lock_ref``."""
        total = 0
        while node is not self.root_node:
            if node.lock_ref == lock_ref and compressed_segment(node) is not None:
                total += len(node.key)
            node = node.parent
        return total

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        moved = 0 if self.disable else self._compressed_len_on_path(node, lock_ref=0)
        result = super().inc_lock_ref(node)
        self.evictable_size_ += moved
        self.protected_size_ -= moved
        return dataclasses.replace(result, delta=result.delta + moved)

    def dec_lock_ref(self, node: TreeNode, params=None) -> DecLockRefResult:
        moved = 0 if self.disable else self._compressed_len_on_path(node, lock_ref=1)
        result = super().dec_lock_ref(node, params)
        self.evictable_size_ -= moved
        self.protected_size_ += moved
        return dataclasses.replace(result, delta=result.delta - moved)

    def _delete_leaf(self, node: TreeNode):
        if compressed_segment(node) is not None:
            self.evictable_size_ += len(node.key)  # the stock method subtracts it; it was never added
        super()._delete_leaf(node)

    # ---- eviction ------------------------------------------------------------------------------

    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable:
            return EvictResult()
        start_time = time.perf_counter()
        dense_freed = self._evict_leaves(lambda freed: freed >= params.num_tokens)
        self.update_eviction_metrics(dense_freed, start_time)
        return EvictResult(num_tokens_evicted=dense_freed)

    def _evict_leaves(self, done: Callable[[int], bool]) -> int:
        """Evict unlocked leaves in eviction-policy order until ``done(dense slots freed)``."""
        heap = [(self.eviction_strategy.get_priority(node), node) for node in self.evictable_leaves]
        heapq.heapify(heap)
        dense_freed = 0
        while heap and not done(dense_freed):
            _, leaf = heapq.heappop(heap)
            dense_freed += self._evict_leaf(leaf)
            parent = leaf.parent
            if len(parent.children) == 0 and parent.lock_ref == 0:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(parent), parent))
        return dense_freed

    def _evict_leaf(self, leaf: TreeNode) -> int:
        """Free the leaf's storage and delete it; returns the dense slots freed."""
        segment = compressed_segment(leaf)
        if segment is not None:
            self.engine.arena.free(segment.cells)
            self.engine.stats.node_removed(segment)
            dense_freed = 0
        else:
            self.token_to_kv_pool_allocator.free_segment(leaf.value, start_pos=0)
            dense_freed = len(leaf.value)
        self._delete_leaf(leaf)
        self.kv_events.record_remove(leaf)
        return dense_freed

    def _alloc_cells(self, counts: list[int]) -> Optional[list[torch.Tensor]]:
        arena = self.engine.arena
        if not arena.can_alloc(counts):
            self._evict_leaves(lambda _: arena.can_alloc(counts))
        return arena.alloc(counts)

    # ---- checkpoint: compress, then insert what is left densely ---------------------------------

    def checkpoint(self, req, *, up_to: int):
        """``RadixCache.checkpoint`` generalised to a tree that may cover less than the key.

        The stock method asserts that the tree now holds the whole key; here an insert stops at a
        compressed node the key diverges inside, so the request adopts the tree's path up to where
        it stops and keeps the rest of its row as its own (freed with the row, as any uncached tail).
        """
        if self.disable:
            return
        state = request_state(req)
        first_checkpoint = not state.prefill_counted
        if first_checkpoint:
            state.prefill_counted = True
            reused = compressed_nodes(req.last_node)
            self._count_reuse(reused)
        compressors, state.compressors = state.compressors, []
        created = [node for compressor in compressors if (node := self._compress(req, compressor)) is not None]
        if created:
            self.engine.stats.count("requests_compressed")
        self._insert_dense(req, up_to, split_prompt=True)
        if first_checkpoint:  # nodes adopted from a concurrent request that compressed them first
            known = {id(node) for node in reused + created}
            for node in compressed_nodes(req.last_node):
                if id(node) not in known:
                    self._count_served(node)

    def _insert_dense(self, req, end: int, split_prompt: bool = False) -> None:
        """Insert the request's tokens ``[0, end)`` as the stock checkpoint does and adopt the tree's path."""
        radix_key, _, _ = self._insert_cache(req, req.full_untruncated_fill_ids[:end], split_prompt=split_prompt)
        self._adopt_path(req, self.match_prefix(MatchPrefixParams(key=radix_key)).last_device_node)

    def _count_reuse(self, reused: list[TreeNode]) -> None:
        """The request's prefix match reused the compressed nodes ``reused`` (made by other requests)."""
        if not reused:
            return
        stats = self.engine.stats
        stats.count("reuse_hits")
        stats.count("reused_tokens", sum(len(node.key) for node in reused))
        stats.count("shared_block_hits", len(reused))
        for node in reused:
            self._count_served(node)

    def _count_served(self, node: TreeNode) -> None:
        served = getattr(node, SERVED_ATTR)
        self.engine.stats.node_served(served)
        setattr(node, SERVED_ATTR, served + 1)

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

    def _compress(self, req, compressor: SegmentCompressor) -> Optional[TreeNode]:
        """Turn the request's scored span into a compressed node below its path and adopt it; None
        when the span stays dense (see the module doc)."""
        spec = compressor.spec
        if spec.start > req.kv.cache_protected_len:
            self._insert_dense(req, spec.start)  # an earlier block of this request stayed dense
        start = req.kv.cache_protected_len
        if spec.start != start or len(self.path_device_indices(req.last_node)) != start:
            return None  # the row changed since the forward scored it (e.g. retraction), or the insert stopped short
        plan = compressor.plan()
        self.engine.dump_plan(req.rid, plan)
        # Request scope keeps the window dense (the next turn continues from it); a block keeps it inside.
        window = self.engine.eviction.window
        compressed_end = spec.end - min(window, spec.length) if self.engine.scope.window_stays_dense else spec.end
        kept = truncate_plan(plan, compressed_end)
        span_entries = kept.segment_length * kept.num_layers * kept.layers[0].num_kv_heads
        if kept.total_kept() == span_entries:
            return None  # nothing evicted: the policy kept the span whole
        key = RadixKey(req.full_untruncated_fill_ids[:compressed_end], req.extra_key, cache_salt=req.cache_salt)
        walk = self._walk(key, req.last_node, start)
        parent, own_start = (walk.passed[-1] if walk.passed else req.last_node), walk.covered
        split = None  # the compressed node the request diverges inside, split to attach its own node
        if walk.partial is not None and compressed_segment(walk.partial) is not None and self.engine.scope.window_stays_dense:
            split, own_start = walk.partial, walk.covered + walk.partial_matched
        # Past its own path the request may only cover split heads, which nothing may match to the
        # end: its own node hangs below them (or below the head of `split`).
        if any(match_may_end(node) for node in walk.passed) or (walk.partial is not None and split is None):
            # Another request put (part of) this span in the tree meanwhile: reuse theirs.
            if walk.covered == compressed_end and compressed_segment(walk.passed[-1]) is not None:
                self.engine.stats.count("block_races_lost")  # the very same span, compressed first by another request
            return None
        if own_start == compressed_end:
            return None  # split heads hold the whole span: nothing of it is the request's own
        own = skip_plan_prefix(kept, own_start)
        # The allocation below may evict: lock the nodes the request's own node will hang on.
        anchor = self.lock(split if split is not None else parent)
        try:
            cells = self._alloc_cells([len(layer.kept_positions) for layer in own.layers])
            if cells is None:
                self.engine.stats.count("requests_left_dense")
                return None
            row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            arena = self.engine.arena
            for layer, (layer_plan, layer_cells) in enumerate(zip(own.layers, cells)):
                cell_map = ArenaCellMap.from_layer_plan(layer_plan, row, layer_cells)
                k_buffer, v_buffer = self.kv_pool.get_kv_buffer(layer)
                gather_kv_to_arena(k_buffer, v_buffer, arena.k[layer], arena.v[layer], cell_map)
            if split is not None:
                parent = self._split_compressed_node(split, own_start - walk.covered)
            segment = CompressedSegment.of(own, cells)
            node = self._attach_compressed_node(parent, key[own_start:], segment, req.priority or 0)
            # [start, own_start) is read from the split heads' cells from now on.
            self.token_to_kv_pool_allocator.free(row[start:compressed_end].to(torch.int64))
            self.engine.stats.node_added(segment)
            self._adopt_path(req, node)
            return node
        finally:
            self.unlock(anchor)

    def _attach_compressed_node(
        self, parent: TreeNode, key: RadixKey, segment: CompressedSegment, priority: int
    ) -> TreeNode:
        node = TreeNode(priority=priority)
        node.parent = parent
        node.key = key
        node.value = torch.zeros(len(key), dtype=torch.int64, device=self.device)  # dummy slot 0
        setattr(node, SEGMENT_ATTR, segment)
        setattr(node, MATCH_END_ATTR, True)
        setattr(node, SERVED_ATTR, 1)
        parent.children[key.child_key(self.page_size)] = node
        # Not added to evictable_size_: it holds no dense slot.
        self._update_leaf_status(parent)
        self._update_leaf_status(node)
        self.kv_events.record_store(node)
        return node
