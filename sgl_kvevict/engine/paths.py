"""What a compressed radix node carries, and what a request's path holds compressed.

The tree (``engine.radix_cache``) stores a compressed node's data as attributes of SGLang's ``TreeNode``
(it has no slots): its ``CompressedSegment``, whether a match may end at it (False on the head of a
split), and how many distinct requests it served. The attention backend reads a request's compressed
path as one ``PathView`` (``path_view``), rebuilt only when the path or the arena's placements change.
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.mem_cache.radix_cache import TreeNode

from sgl_kvevict.engine.segments import CompressedSegment, PathView
from sgl_kvevict.engine.state import EngineState, request_state

SEGMENT_ATTR = "kvevict_segment"
# Distinct requests a compressed node served: its creator, then each request whose path took it.
SERVED_ATTR = "kvevict_requests_served"
# False on the head of a split compressed node: a match may pass through it but not end at it.
MATCH_END_ATTR = "kvevict_match_end"


def compressed_segment(node: TreeNode) -> Optional[CompressedSegment]:
    return getattr(node, SEGMENT_ATTR, None)


def is_compressed(node: TreeNode) -> bool:
    return compressed_segment(node) is not None


def match_may_end(node: TreeNode) -> bool:
    """A match may end at ``node``'s end: always for a dense node, not for a split head."""
    return getattr(node, MATCH_END_ATTR, True)


def compressed_nodes(node: TreeNode) -> list[TreeNode]:
    """The compressed nodes from the root down to ``node``, root first."""
    nodes = []
    while node.parent is not None:  # the root has no parent
        if is_compressed(node):
            nodes.append(node)
        node = node.parent
    return nodes[::-1]


def compressed_path(node: TreeNode) -> list[CompressedSegment]:
    """The compressed segments from the root down to ``node``, root first."""
    return [compressed_segment(path_node) for path_node in compressed_nodes(node)]


def path_view(engine: EngineState, req, device: torch.device) -> Optional[PathView]:
    """The request's ``PathView``, memoised per ``last_node`` and arena placement (a locked path only
    changes by the split of a compressed node, which keeps every cell, or by cell moves)."""
    state = request_state(req)
    if state.view_node is not req.last_node or state.view_generation != engine.arena.generation:
        segments = compressed_path(req.last_node)
        state.view = PathView.of(segments, device) if segments else None
        state.view_node, state.view_generation = req.last_node, engine.arena.generation
    return state.view
