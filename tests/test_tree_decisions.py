"""The tree's compression decisions as a pure function of a walk (``engine.tree_decisions``), on plain nodes."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_kvevict.engine.tree_decisions import Outcome, Walk, atomic_prefix_length, decide_compression


@dataclass(eq=False)
class Node:
    key: tuple
    compressed: bool = False
    may_end: bool = True


def decide(walk: Walk, end: int, anchor=None):
    return decide_compression(walk, anchor, end, lambda n: n.compressed, lambda n: n.may_end)


def atomic(walk: Walk, key_length: int) -> int:
    return atomic_prefix_length(walk, key_length, lambda n: n.compressed, lambda n: n.may_end)


ROOT = Node(())
HEAD = Node((1,) * 10, compressed=True, may_end=False)  # a split head: shared positions
FULL = Node((2,) * 20, compressed=True)
DENSE = Node((3,) * 5)


def test_a_segment_below_nothing_is_compressed_below_the_anchor():
    decision = decide(Walk((), 0), end=30, anchor=ROOT)
    assert decision == decide(Walk((), 0), 30, ROOT)
    assert (decision.outcome, decision.parent, decision.own_start, decision.split_node) == (Outcome.COMPRESS, ROOT, 0, None)


def test_passing_split_heads_hangs_the_own_node_below_the_last_one():
    decision = decide(Walk((HEAD,), 10), end=30, anchor=ROOT)
    assert (decision.outcome, decision.parent, decision.own_start) == (Outcome.COMPRESS, HEAD, 10)


def test_diverging_inside_a_compressed_node_splits_it_there():
    decision = decide(Walk((HEAD,), 10, FULL, 7), end=40, anchor=ROOT)
    assert decision.outcome is Outcome.COMPRESS
    assert (decision.split_node, decision.split_offset, decision.own_start) == (FULL, 7, 17)


def test_the_same_segment_compressed_first_by_another_request_is_a_lost_race():
    assert decide(Walk((FULL,), 20), end=20, anchor=ROOT).outcome is Outcome.LOST_RACE
    # Part of it taken (a node a match may end at, or a dense node the segment diverges inside): stays dense.
    assert decide(Walk((FULL,), 20), end=30, anchor=ROOT).outcome is Outcome.TAKEN
    assert decide(Walk((), 0, DENSE, 3), end=30, anchor=ROOT).outcome is Outcome.TAKEN


def test_a_segment_that_compressed_nodes_already_hold_is_left_alone():
    assert decide(Walk((HEAD,), 10), end=10, anchor=ROOT).outcome is Outcome.SHARED
    # Ending inside a compressed node it shares: nothing of the segment is the request's own (no empty node).
    assert decide(Walk((), 0, HEAD, 6), end=6, anchor=ROOT).outcome is Outcome.SHARED


def test_matching_takes_compressed_nodes_whole_and_never_ends_at_a_split_head():
    assert atomic(Walk((FULL,), 20), key_length=25) == 25  # leaves the tree at FULL's end: all of it
    assert atomic(Walk((), 0, FULL, 12), key_length=12) == 0  # ends inside a compressed node: none of it
    assert atomic(Walk((HEAD,), 10), key_length=10) == 0  # only a split head: a match may not end there
    assert atomic(Walk((HEAD, FULL), 30, DENSE, 2), key_length=40) == 40  # inside a dense node: the stock split
    assert atomic(Walk((HEAD, FULL), 30), key_length=40) == 40
