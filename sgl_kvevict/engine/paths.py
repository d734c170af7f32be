"""What a request sees of the tree: the compressed nodes on its path and their cells as one ``PathView``.

Pure functions of tree nodes and their ``NodeRecord``s (``engine.records``): a node is anything with a
``parent`` (None at the root) and a record, so the coordinator reads a request's path without knowing
the tree (``engine.adapter.radix_cache`` is SGLang's ``RadixCache`` subclass that builds the nodes).
"""

from __future__ import annotations

from typing import Optional

import torch

from sgl_kvevict.engine.arena import Arena
from sgl_kvevict.engine.records import node_record
from sgl_kvevict.engine.segments import PathView


def is_compressed(node) -> bool:
    return node_record(node).is_compressed


def match_may_end(node) -> bool:
    """A match may end at ``node``'s end: always for a dense node, not for a split head."""
    return node_record(node).match_may_end


def compressed_nodes(node) -> list:
    """The compressed nodes from the root down to ``node``, root first."""
    nodes = []
    while node.parent is not None:  # the root has no parent
        if is_compressed(node):
            nodes.append(node)
        node = node.parent
    return nodes[::-1]


class PathViews:
    """arena: where the nodes' cells are (its ``generation`` says when placements changed); device: where
    views are built."""

    def __init__(self, arena: Arena, device: torch.device):
        self.arena = arena
        self.device = device

    def of(self, node) -> Optional[PathView]:
        """The compressed content on the path from the root to ``node`` (None when there is none),
        memoised on the node while the arena's placements stay the same (a locked path only changes by
        the split of a compressed node, which keeps every cell, or by cell moves)."""
        record = node_record(node)
        if record.view_generation != self.arena.generation:
            segments = [node_record(path_node).segment for path_node in compressed_nodes(node)]
            record.view = PathView.of(segments, self.device) if segments else None
            record.view_generation = self.arena.generation
        return record.view
