"""Where the SGLang-facing parts find the engine that serves their KV pool.

SGLang builds the attention backends before the tree, and calls its hooks with its own objects (the
scheduler, the prefill adder, the model runner): none of them can be handed the engine at
construction. Each finds it by the KV pool it holds, as SGLang's sparse attention finds its
coordinator (``get_sparse_coordinator()``): a lookup, so nothing is wired into them after they are
built. Keyed by pool, not one per process, so that tests may build several engines side by side.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional, Protocol

from sgl_kvevict.engine.arena import Arena
from sgl_kvevict.engine.cells import CellSpace
from sgl_kvevict.engine.coordinator import CompressionCoordinator
from sgl_kvevict.engine.setups import Setups
from sgl_kvevict.engine.stats import EngineStats
from sgl_kvevict.local_layers import LocalLayers


class SegmentStore(Protocol):
    """What the adapter's hooks ask of the tree that stores compressed segments."""

    def checkpoint(self, req, *, up_to: int) -> None:
        """Store the request's ready plans, then insert the rest of ``[0, up_to)`` densely."""

    def path_slots(self, node) -> int:
        """KV slots the path from the root to ``node`` holds."""

    def memory_levels(self) -> dict:
        """The pool's and the arena's levels, for the stats snapshot."""


@dataclass(frozen=True)
class Engine:
    """One KV pool's compression engine: the tree that stores segments, the coordinator that decides them,
    the arena of compressed cells over ``space``, the setups that serve requests, the counters."""

    tree: SegmentStore
    coordinator: CompressionCoordinator
    arena: Arena
    space: CellSpace
    setups: Setups
    stats: EngineStats
    local_layers: Optional[LocalLayers] = None  # the model's local attention layers (Gemma 3), read by the backends


_ENGINES: "weakref.WeakKeyDictionary[object, Engine]" = weakref.WeakKeyDictionary()


def register_engine(kv_pool, engine: Engine) -> None:
    _ENGINES[kv_pool] = engine


def forget_engine(kv_pool) -> None:
    _ENGINES.pop(kv_pool, None)


def engine_for(kv_pool) -> Optional[Engine]:
    """The engine serving ``kv_pool`` (None: no compressed tree was built over it)."""
    return _ENGINES.get(kv_pool)
