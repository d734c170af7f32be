"""Tensor-parallel ranks keep identical memory decisions (``sharding``, ``engine.tensor_parallel``): two
in-process trees on real SGLang pools, one per rank, each holding one of the model's two KV heads, whose
heads keep different positions (so each rank keeps a different number of entries, and which rank keeps
more changes along the prompt). They run the same script in two threads and exchange through a thread
all-gather, as ranks do through SGLang's TP group. SGLang's schedulers assume every rank has the same
free slots at every step: after every step the two trees' allocators, arenas and counters must agree."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from sgl_kvevict.engine.adapter.radix_cache import match_may_end
from sgl_kvevict.engine.deferred import PRESSURE
from sgl_kvevict.engine.records import node_record
from sgl_kvevict.engine.tensor_parallel import RankGroup
from sgl_kvevict.plan import CompressionPlan, LayerPlan
from sgl_kvevict.policies.base import SegmentSpec
from sgl_kvevict.local_layers import LocalLayers
from sgl_kvevict.scope import BlockScope, RequestScope
from sgl_kvevict.sharding import HeadShard
from tree_harness import WINDOW, TreeHarness, tokens

SYSTEM = 40  # conversations share this prefix: their nodes split there


@dataclass(frozen=True)
class DenseThenSparse:
    """Global head 0 keeps every 2nd position before ``SYSTEM`` and every 7th after; head 1 the reverse.
    ``heads``: the global heads of this rank."""

    heads: tuple[int, ...]

    def plan(self, spec: SegmentSpec) -> CompressionPlan:
        window_start = spec.end - min(WINDOW, spec.length)
        layers = []
        for layer in range(spec.num_layers):
            kept = []
            for head in self.heads:
                every = lambda p: (2 if p < SYSTEM else 7) if head == 0 else (7 if p < SYSTEM else 2)  # noqa: E731
                positions = [p for p in range(spec.start, window_start) if (p + layer) % every(p) == 0]
                kept.append(torch.tensor(positions + list(range(window_start, spec.end)), dtype=torch.int64))
            layers.append(LayerPlan.from_heads(kept))
        return CompressionPlan(spec.start, spec.end, tuple(layers))


class ThreadGather:
    """An all-gather between threads (each thread one rank)."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list = [None] * size

    def for_rank(self, rank: int):
        def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            gathered = list(self.slots)
            self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
            return gathered

        return gather


def ledger(harness: TreeHarness) -> dict:
    """What SGLang's scheduler and our stats see of one rank's memory."""
    tree, arena = harness.tree, harness.arena
    return {
        "available": harness.allocator.available_size(), "evictable": tree.evictable_size(),
        "protected": tree.protected_size(), "slots_borrowed": arena.slots_borrowed, "cells_used": arena.cells_used,
        "cells_locked": arena.cells_locked, "compressed_nodes": len(harness.compressed_nodes()),
        # Not SGLang's ledger: a rank's moves, the host bytes of its own heads' deferred plans, and the kept
        # shares of its own heads.
        **{k: v for k, v in harness.stats_snapshot().items()
           if k not in ("arena_cells_moved", "deferred_plan_bytes") and not k.startswith("kept_share")},
    }  # fmt: skip


def conversations(harness: TreeHarness, record) -> None:
    """The script every rank runs: conversations sharing a system prompt (splits), follow-up turns
    (reuse), two requests racing for one segment, a pool too small for all of them (eviction, moves), a
    prefill needing most of the pool."""
    system = tokens(1, SYSTEM, first=1)
    first_turns = []
    for user in range(4):
        req = harness.prefill(system + tokens(10 + user, 70 + 5 * user))
        record()
        harness.decode(req, tokens(20 + user, 3))
        harness.finish(req)
        record()
        first_turns.append(list(req.origin_input_ids) + list(req.output_ids))
    for user, history in enumerate(first_turns):
        req = harness.prefill(history + tokens(30 + user, 12))
        record()
        harness.finish(req)
        record()
    racers = [harness.prefill(tokens(35, 90, first=35), checkpoint=False) for _ in range(2)]  # both scored it
    for racer in racers:
        harness.checkpoint(racer)
        record()
    for racer in racers:
        harness.finish(racer)
    record()
    big = harness.prefill(tokens(40, 230, first=40))
    record()
    harness.finish(big)
    record()
    harness.flush()
    record()


def run_ranks(script, **harness_options) -> list[TreeHarness]:
    """``script(harness, record)`` on two ranks at once; every ``record()`` must see equal ledgers."""
    gather = ThreadGather(2)
    harnesses = [
        TreeHarness(
            num_kv_heads=1, rule=DenseThenSparse(heads=(rank,)),
            ranks=RankGroup(HeadShard.of(2, 2, rank), num_layers=2, gather=gather.for_rank(rank)), **harness_options,
        )
        for rank in range(2)
    ]  # fmt: skip
    ledgers: list[list[dict]] = [[], []]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        harness = harnesses[rank]

        def record() -> None:
            harness.assert_ledger()
            harness.assert_cells_hold_their_entries()
            ledgers[rank].append(ledger(harness))

        try:
            script(harness, record)
        except BaseException as error:  # reported below; the other rank's barrier then breaks
            errors.append(error)
            gather.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    assert len(ledgers[0]) == len(ledgers[1]) > 0
    for step, (zero, one) in enumerate(zip(*ledgers)):
        assert zero == one, f"step {step}: rank 0 {zero} != rank 1 {one}"
    return harnesses


def test_ranks_keeping_different_entries_take_the_same_memory_decisions():
    splits_with_extra = []

    def watch_splits(harness, record):
        original = harness.tree._split_compressed_node

        def split(node, split_len, split, spare):
            splits_with_extra.append(split.extra)
            return original(node, split_len, split, spare)

        harness.tree._split_compressed_node = split
        conversations(harness, record)

    harnesses = run_ranks(watch_splits, pool_slots=300)
    stats = harnesses[0].stats_snapshot()
    assert stats["compressed_nodes_evicted"] > 0 and stats["reuse_hits"] > 0  # the script did what it says
    assert stats["compression_races_lost"] == 1
    assert any(extra > 0 for extra in splits_with_extra)  # a split had to reserve more than the node held
    assert stats["kept_entries"] == 0 and harnesses[0].allocator.available_size() == 300  # after the flush


def test_ranks_agree_when_prompts_are_compressed_under_pressure():
    """``--kv-evict-when pressure``: every rank defers the same nodes and compresses the same ones when
    SGLang asks for room, though each keeps its own heads' entries."""
    harnesses = run_ranks(conversations, pool_slots=300, compress_when=PRESSURE)
    stats = harnesses[0].stats_snapshot()
    assert stats["nodes_compressed_under_pressure"] > 0 and stats["deferred_nodes"] == 0  # after the flush


@pytest.mark.parametrize("scope", [RequestScope(), BlockScope(block_size=32)], ids=["request", "block"])
def test_ranks_agree_with_a_local_layer_trimmed_to_its_window(scope):
    """Gemma 3's local layers under tensor parallelism: layer 0 keeps its last 8 positions in every head of
    every rank, and a split head gains its window before the split on every rank alike."""
    local = LocalLayers(layers=(0,), window=8, observation_window_dense=scope.window_stays_dense)
    harnesses = run_ranks(conversations, pool_slots=300, scope=scope, local_layers=local)
    stats = harnesses[0].stats_snapshot()
    assert stats["compressed_nodes_created"] > 0 and stats["reuse_hits"] > 0


def test_ranks_agree_in_block_scope_with_nodes_still_held():
    def script(harness, record):
        system = tokens(2, SYSTEM, first=2)
        held = [harness.prefill(system + tokens(50 + i, 90)) for i in range(3)]  # running: nodes locked
        record()
        assert any(not match_may_end(node) for node in harness.compressed_nodes())  # a block was split
        assert any(node_record(node).segment.num_cells > node_record(node).segment.num_entries
                   for node in harness.compressed_nodes())  # fmt: skip
        for req in held:
            harness.finish(req)
            record()

    run_ranks(script, pool_slots=400, scope=BlockScope(block_size=32))
