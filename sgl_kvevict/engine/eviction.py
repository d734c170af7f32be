"""One eviction order for dense and compressed radix nodes: GreedyDual-Size-Frequency, cold insertion.

A leaf's priority is ``clock + reuses * cost / size``; the lowest priority is evicted first (among
equals, the newest node first) and the clock rises to it. ``cost`` is what losing the node costs: its
tokens, prefilled again by the next request that needs them; ``size`` is the memory it frees, in token
slots (a dense node: one slot per token; a compressed node: its cells over the cells of one slot), so
per slot freed a compressed node is ``1 / kept fraction`` times costlier to lose than a dense one and
dense tails go first. ``reuses`` counts the requests that matched the node after the one that made it.

Why not LRU (SGLang's default): when the working set is a little larger than memory and requests
cycle through it (concurrent chat users taking turns), LRU evicts exactly the conversation needed
next, and every turn misses. Here a node enters *cold* (no reuse yet: priority ``clock``), so it is the
next to go unless a later request reuses it; reused nodes stay. In a cycle that does not fit, the
conversations that fit keep hitting and the rest miss, instead of all of them (LRU Insertion Policy,
Qureshi et al. 2007). The clock (GreedyDual's inflation) still ages out nodes nobody reuses any more,
so a new conversation is not evicted before long-idle ones.

Pure Python: the tree (``engine.radix_cache``) keeps each node's reuses, creation order and priority.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass
class EvictionOrder:
    clock: float = 0.0
    _created: itertools.count = field(default_factory=itertools.count, repr=False)

    def priority(self, reuses: int, cost_tokens: int, size_slots: float) -> float:
        """The priority of a node used now: ``clock + reuses * cost / size``."""
        return self.clock + reuses * cost_tokens / max(size_slots, 1e-9)

    def creation_rank(self) -> int:
        """Among equal priorities the newest node goes first: a decreasing rank per node created."""
        return -next(self._created)

    def evicted(self, priority: float) -> None:
        """A node of ``priority`` was evicted: the clock rises to it (never falls)."""
        self.clock = max(self.clock, priority)

    def reset(self) -> None:
        self.clock = 0.0
