"""One eviction order for dense and compressed radix nodes, as a strategy object of SGLang's kind.

SGLang's ``RadixCache.evict`` pops leaves in ``eviction_strategy.get_priority(node)`` order
(``sglang/srt/mem_cache/evict_policy.py``: LRU, LFU, FIFO, ...). The compressed tree plugs its own
strategy in the same slot (duck-typed: only ``get_priority`` is read); another order is one more
subclass of ``CompressedTreeOrder``.

``GreedyDualSizeFrequency`` (the default, and today the only one): a leaf's priority is
``clock + reuses * cost / size``; the lowest priority is evicted first (among equals, the newest node
first) and the clock rises to it. ``cost`` is what losing the node costs: its tokens, prefilled again
by the next request that needs them; ``size`` is the memory it frees, in token slots (a dense node:
one slot per token; a compressed node: its cells over the cells of one slot), so per slot freed a
compressed node is ``1 / kept fraction`` times costlier to lose than a dense one and dense tails go
first. ``reuses`` counts the requests that matched the node after the one that made it.

Why not LRU (SGLang's default): when the working set is a little larger than memory and requests
cycle through it (concurrent chat users taking turns), LRU evicts exactly the conversation needed
next, and every turn misses. Here a node enters *cold* (no reuse yet: priority ``clock``), so it is the
next to go unless a later request reuses it; reused nodes stay. In a cycle that does not fit, the
conversations that fit keep hitting and the rest miss, instead of all of them (LRU Insertion Policy,
Qureshi et al. 2007). The clock (GreedyDual's inflation) still ages out nodes nobody reuses any more,
so a new conversation is not evicted before long-idle ones.
"""

from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass, field

from sgl_kvevict.engine.records import NodeRecord, node_record


@dataclass(frozen=True)
class NodeCost:
    """What a node is worth keeping: ``tokens`` prefilled again if it is lost, ``slots`` freed by evicting it."""

    tokens: int
    slots: float


class CompressedTreeOrder(abc.ABC):
    """An eviction order the compressed tree drives: it reports every node made, reused and evicted. It
    fills SGLang's ``eviction_strategy`` slot of the tree, whose one method is ``get_priority``."""

    @abc.abstractmethod
    def get_priority(self, node) -> tuple:
        """The node's place in the order: the smallest is evicted first."""

    @abc.abstractmethod
    def created(self, record: NodeRecord, cost: NodeCost) -> None:
        """A new node (inserted, stored compressed, or the head of a split; a head calls ``inherit``)."""

    @abc.abstractmethod
    def reused(self, record: NodeRecord, cost: NodeCost) -> None:
        """A request's match passed through the node."""

    @abc.abstractmethod
    def evicted(self, priority) -> None:
        """A leaf of ``priority`` (``get_priority``'s value) was evicted."""

    def resized(self, record: NodeRecord, before: NodeCost, after: NodeCost) -> None:
        """A dense node was compressed in place (``engine.deferred``): it frees ``after.slots`` now (an order
        that does not weigh size keeps its place)."""

    def inherit(self, head: NodeRecord, node: NodeRecord) -> None:
        """``head`` was split off ``node`` and takes its place in the order (the stock split copies priorities)."""
        head.reuses, head.priority, head.rank = node.reuses, node.priority, node.rank

    @abc.abstractmethod
    def reset(self) -> None:
        """The tree was flushed."""


@dataclass
class GreedyDualSizeFrequency(CompressedTreeOrder):
    clock: float = 0.0
    _created: itertools.count = field(default_factory=itertools.count, repr=False)

    def get_priority(self, node) -> tuple:
        record = node_record(node)
        return record.priority, record.rank, node.id

    def created(self, record: NodeRecord, cost: NodeCost) -> None:
        record.reuses = 0
        record.rank = -next(self._created)  # among equal priorities the newest node goes first
        record.priority = self._priority(record, cost)

    def reused(self, record: NodeRecord, cost: NodeCost) -> None:
        record.reuses += 1
        record.priority = self._priority(record, cost)

    def evicted(self, priority: tuple) -> None:
        self.clock = max(self.clock, priority[0])  # never falls

    def resized(self, record: NodeRecord, before: NodeCost, after: NodeCost) -> None:
        # The clock it was last touched at stays: only its reuses' worth per slot freed changes.
        record.priority += self._priority(record, after) - self._priority(record, before)

    def reset(self) -> None:
        self.clock = 0.0

    def _priority(self, record: NodeRecord, cost: NodeCost) -> float:
        return self.clock + record.reuses * cost.tokens / max(cost.slots, 1e-9)
