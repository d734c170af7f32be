"""What a checkpoint does with a scored segment: the tree's decisions, separated from their effects.

``decide_compression`` is a pure function of a read-only walk of the tree (``Walk``) and of two facts
per node (compressed or dense; may a match end at it); ``CompressedRadixCache._compress`` carries the
decision out. Tests drive this module with plain objects, no SGLang.

The rules (``engine.adapter.radix_cache`` explains the invariants they keep):

* The request's segment ``[start, end)`` hangs below its matched node. Walking the segment's tokens down
  from there, the request may pass only through *split heads* (compressed nodes a match may pass
  through but not end at): their positions are shared with another conversation, which compressed
  them first.
* If the walk passes a node a match may end at, or diverges inside a dense node, another request put
  (part of) this segment in the tree since the match: the segment stays dense and the request adopts
  theirs (a *lost race* when the very same segment is there compressed).
* If the walk diverges inside a compressed node, that node is split at the divergence; the head keeps
  the shared positions (the first compressor's selection), and the request's own node, its plan
  restricted to ``[divergence, end)``, hangs below the head. This holds in request and block scope:
  documents that share a system prompt all get their own compressed node.
* If split heads cover the whole segment, or it ends inside a compressed node it shares, nothing of it
  is the request's own: it stays as it is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Walk:
    """A read-only match of a key against the tree.

    passed: the nodes the key covers whole, in path order; covered: the key's length up to the end
    of the last of them; partial: the node the key diverges or ends inside, or None;
    partial_matched: the key's tokens that match inside ``partial``.
    """

    passed: tuple[Any, ...]
    covered: int
    partial: Any = None
    partial_matched: int = 0


class Outcome(enum.Enum):
    COMPRESS = "compress"  # store the request's own part as a new compressed node
    LOST_RACE = "lost race"  # the very same segment is already compressed: adopt it
    TAKEN = "taken"  # another request inserted part of the segment meanwhile: stay dense, adopt theirs
    SHARED = "shared"  # split heads already hold the whole segment: nothing of it is the request's own


@dataclass(frozen=True)
class CompressionDecision:
    """outcome; for COMPRESS: the node to hang the new node below (``parent``, ignored when
    ``split_node`` is set: the new node hangs below that node's head), the split position inside
    ``split_node`` (tokens from its start), and ``own_start``, where the request's own node begins."""

    outcome: Outcome
    parent: Any = None
    split_node: Any = None
    split_offset: int = 0
    own_start: int = 0


def decide_compression(
    walk: Walk,
    anchor: Any,
    end: int,
    is_compressed: Callable[[Any], bool],
    may_end_at: Callable[[Any], bool],
) -> CompressionDecision:
    """The decision for the segment ``[.., end)`` walked from ``anchor`` (the request's matched node)."""
    if any(may_end_at(node) for node in walk.passed):
        same_segment = walk.covered == end and walk.partial is None and is_compressed(walk.passed[-1])
        return CompressionDecision(Outcome.LOST_RACE if same_segment else Outcome.TAKEN)
    parent = walk.passed[-1] if walk.passed else anchor
    if walk.partial is not None and not is_compressed(walk.partial):
        return CompressionDecision(Outcome.TAKEN)
    own_start = walk.covered + walk.partial_matched
    if own_start == end:  # the segment ends where (or inside where) compressed nodes already hold it
        return CompressionDecision(Outcome.SHARED)
    if walk.partial is not None:
        return CompressionDecision(
            Outcome.COMPRESS, parent, split_node=walk.partial, split_offset=walk.partial_matched, own_start=own_start
        )
    return CompressionDecision(Outcome.COMPRESS, parent, own_start=own_start)


def atomic_prefix_length(
    walk: Walk, key_length: int, is_compressed: Callable[[Any], bool], may_end_at: Callable[[Any], bool]
) -> int:
    """How much of a key a match or an insert may take: up to the end of the last walked node a match
    may end at, or inside a dense node (the stock split), or the whole key when it leaves the tree at
    such a point (the rest is new). A compressed node is never entered partway."""
    limit = offset = 0
    for node in walk.passed:
        offset += node_length(node)
        if may_end_at(node):
            limit = offset
    if limit == walk.covered and (walk.partial is None or not is_compressed(walk.partial)):
        return key_length
    return limit


def cached_prefix_length(
    walk: Walk, key_length: int, is_compressed: Callable[[Any], bool], may_end_at: Callable[[Any], bool]
) -> int:
    """How much of a key a match would reuse: what ``atomic_prefix_length`` lets it take of what the tree
    holds (the walked nodes, and the matched part of a dense node it ends inside)."""
    held = walk.covered + (walk.partial_matched if walk.partial is not None and not is_compressed(walk.partial) else 0)
    return min(held, atomic_prefix_length(walk, key_length, is_compressed, may_end_at))


def node_length(node: Any) -> int:
    return len(node.key)

