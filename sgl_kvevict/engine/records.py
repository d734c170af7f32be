"""The engine's state on SGLang's objects, declared in one place: one record per radix node, one per request.

SGLang's ``TreeNode`` and ``Req`` carry exactly one attribute of ours, ``kvevict``, pointing to a record
defined here. Who writes what:

* ``NodeRecord``: the tree (``engine.adapter.radix_cache``) creates one for every node it makes or adopts and
  writes its content fields; the eviction strategy (``engine.eviction``) writes its order fields.
* ``RequestRecord``: the coordinator (``engine.coordinator``) creates it and writes its compression
  fields; the tree writes its two tree fields.

Pure Python over torch: nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from sgl_kvevict.engine.deferred import DeferredPlan
from sgl_kvevict.engine.segments import CompressedSegment, PathView

if TYPE_CHECKING:
    from sgl_kvevict.engine.compression import SegmentCompression
    from sgl_kvevict.engine.setups import EvictionSetup

RECORD_ATTR = "kvevict"


@dataclass(eq=False)
class NodeRecord:
    """One radix node.

    Content (the tree): ``segment``: the compressed entries of a compressed node, None for a dense
    one; ``match_may_end``: False on the head of a split compressed node, which a match may pass
    through but not end at; ``requests_served``: distinct requests that used a compressed node (its
    creator first); ``deferred``: the plan a dense node is compressed with under pressure
    (``engine.deferred``), None for a node that stays dense until it is evicted; ``view``/``view_generation``:
    the memoised ``PathView`` of the compressed content on the path from the root to this node, valid while
    the arena's generation is the same.
    Order (the eviction strategy): ``reuses`` (requests that matched the node after the one that made
    it), ``priority`` and ``rank`` (creation order; newest first among equal priorities).
    """

    segment: Optional[CompressedSegment] = None
    match_may_end: bool = True
    deferred: Optional[DeferredPlan] = None
    requests_served: int = 0
    view: Optional[PathView] = None
    view_generation: int = -1
    reuses: int = 0
    priority: float = 0.0
    rank: int = 0

    @property
    def is_compressed(self) -> bool:
        return self.segment is not None


@dataclass(eq=False)
class RequestRecord:
    """One request the engine saw (``CompressionCoordinator.on_request_begin``).

    setup: the eviction configuration serving it (None: it stays dense). submitted: its segments were
    submitted (at its first prefill forward). prefill_forwards: forwards its prompt took so far (more
    than one under chunked prefill). prefilled: the forward holding its prompt's last token ran. compressions: its segments in flight, in position order, from the forward that submits them
    until the tree stores them. Tree fields: use_counted: the nodes its match passed through counted
    this request's use (at its first checkpoint: SGLang may match a waiting request several times);
    stored_any: the tree stored one of its segments compressed; admitted_compressed: under
    ``--kv-evict-when pressure``, SGLang admitted it by its compressed footprint, so every segment of it is
    stored compressed at its checkpoint.
    """

    setup: Optional["EvictionSetup"]
    submitted: bool = False
    prefill_forwards: int = 0
    prefilled: bool = False
    compressions: list["SegmentCompression"] = field(default_factory=list)
    use_counted: bool = False
    stored_any: bool = False
    admitted_compressed: bool = False


def node_record(node: Any) -> NodeRecord:
    """The node's record; every node of the compressed tree has one (the tree gives it at creation)."""
    return getattr(node, RECORD_ATTR)


def request_record(req: Any) -> Optional[RequestRecord]:
    """The request's record, or None for a request the engine never saw (not matched by its tree)."""
    return getattr(req, RECORD_ATTR, None)
