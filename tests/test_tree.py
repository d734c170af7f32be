"""The compressed radix cache in-process (``tree_harness``): matching, splitting, atomic nodes, races,
eviction in both directions, moves, locks and SGLang's memory ledger after every step. Seconds, no server."""

from __future__ import annotations

import itertools

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sgl_kvevict.engine.eviction import CompressedTreeOrder, NodeCost
from sgl_kvevict.engine.adapter.radix_cache import match_may_end
from sgl_kvevict.engine.records import NodeRecord, node_record
from sgl_kvevict.scope import BlockScope
from tree_harness import WINDOW, KeepEvery, TreeHarness, tokens


def turn(harness: TreeHarness, prompt: list[int], output: list[int]) -> tuple[list[int], int]:
    """One chat turn: prefill ``prompt``, decode ``output``, finish; returns (the conversation so far,
    the prompt tokens its match reused)."""
    req = harness.prefill(prompt)
    reused = harness.last_match
    harness.assert_ledger()
    harness.decode(req, output)
    harness.finish(req)
    harness.assert_ledger()
    harness.assert_cells_hold_their_entries()
    return prompt + output, reused


@pytest.fixture
def harness():
    return TreeHarness()


def test_the_next_turn_reuses_the_compressed_prompt_and_a_divergent_prompt_does_not(harness):
    first = harness.prefill(tokens(1, 100, first=1))
    harness.assert_ledger()
    (node,) = harness.compressed_nodes()
    assert (node_record(node).segment.start, node_record(node).segment.length) == (0, 100 - WINDOW)
    assert harness.arena.cells_used == node_record(node).segment.num_cells
    harness.decode(first, [7, 8, 9])
    harness.finish(first)
    harness.assert_ledger()

    conversation = list(first.origin_input_ids) + [7, 8, 9]
    second = harness.prefill(conversation + tokens(2, 20))
    assert harness.last_match == len(conversation)  # the compressed node, the window and the answer
    harness.finish(second)
    divergent = harness.prefill(conversation[:50] + tokens(3, 60))
    assert harness.last_match == 0  # diverging inside a compressed node reuses none of it
    harness.finish(divergent)
    harness.assert_ledger()
    harness.assert_cells_hold_their_entries()
    stats = harness.stats_snapshot()
    assert stats["reuse_hits"] == 1 and stats["reused_tokens"] == 100 - WINDOW


def test_conversations_sharing_a_prefix_split_the_node_and_each_hangs_its_own(harness):
    system = tokens(5, 40, first=5)
    first = harness.prefill(system + tokens(6, 80))
    harness.finish(first)
    second = harness.prefill(system + tokens(7, 70))
    assert harness.last_match == 0  # its match may not end inside the first node
    harness.finish(second)
    heads = [node for node in harness.compressed_nodes() if not match_may_end(node)]
    assert len(heads) == 1 and len(heads[0].key) == 40 and len(heads[0].children) == 2
    third = harness.prefill(system + tokens(8, 90))
    assert harness.last_match == 0  # sharing only the head: nothing to end a match at
    harness.finish(third)
    assert len(heads[0].children) == 3 and len(harness.compressed_nodes()) == 4
    # A prompt whose compressed segment would end inside the shared head has nothing of its own to store.
    short = harness.prefill(system[:30] + tokens(10, WINDOW))
    assert len(heads[0].children) == 3 and len(harness.compressed_nodes()) == 4
    harness.finish(short)
    # Every conversation's next turn reuses all of it.
    harness.assert_next_turns_reuse([list(c.origin_input_ids) for c in (first, second, third)], seed=9, new_tokens=10)


def test_requests_racing_for_the_same_segment_store_it_once():
    harness = TreeHarness()
    prompt = tokens(11, 90, first=11)
    racers = [harness.prefill(prompt, checkpoint=False) for _ in range(2)]  # both scored it
    for racer in racers:
        harness.checkpoint(racer)
        harness.assert_ledger()
    assert len(harness.compressed_nodes()) == 1
    assert harness.stats.compression_races_lost == 1
    for racer in racers:
        harness.finish(racer)
    harness.assert_ledger()
    harness.flush()
    assert harness.allocator.available_size() == harness.allocator.size
    harness.assert_ledger()


def block_tree_after(prompt: list[int]) -> TreeHarness:
    """A tree in 32-token blocks (1200 slots) that has served ``prompt`` once: prefilled and finished."""
    harness = TreeHarness(pool_slots=1200, scope=BlockScope(32))
    harness.finish(harness.prefill(prompt))
    return harness


def test_block_scope_compresses_every_document_after_a_shared_system_prompt():
    harness = TreeHarness(pool_slots=1200, scope=BlockScope(32))
    system = tokens(20, 20, first=20)
    documents = [system + tokens(21 + i, 120) for i in range(3)]
    for document in documents:
        req = harness.prefill(document)
        harness.finish(req)
        harness.assert_ledger()
    # Block 0 of every document diverges inside the first document's block 0 at the system prompt's
    # end: the first block was split there, and every document hangs its own part below the head.
    heads = [node for node in harness.compressed_nodes() if not match_may_end(node)]
    assert len(heads) == 1 and len(heads[0].key) == 20 and len(heads[0].children) == 3
    assert harness.stats.compressed_nodes_created == 3 * 4 + 1  # 4 blocks each (139 tokens), one head
    for document in documents:  # each later question reuses every block of its own document
        req = harness.prefill(document + tokens(30, 8))
        assert harness.last_match >= 4 * 32
        harness.finish(req)
    harness.assert_cells_hold_their_entries()
    harness.assert_ledger()


def test_block_scope_a_document_that_extends_another_reuses_its_blocks():
    short = tokens(40, 70, first=40)
    harness = block_tree_after(short)
    longer = harness.prefill(short + tokens(41, 60))
    assert harness.last_match == 70  # the shorter document's two blocks and its dense tail
    harness.finish(longer)
    # A block starting before the request's own tokens holds tokens the tree already has: [64, 96) stays
    # dense (the tail, then the longer one's own tokens); the next full block is compressed.
    blocks = sorted((node_record(n).segment.start, node_record(n).segment.end) for n in harness.compressed_nodes())
    assert blocks == [(0, 32), (32, 64), (96, 128)]
    harness.assert_ledger()
    harness.assert_cells_hold_their_entries()


def test_a_conversation_branching_at_a_later_turn_keeps_its_shared_history():
    history = tokens(50, 100, first=50)
    harness = block_tree_after(history)
    branches = [history + tokens(51 + i, 70) for i in range(2)]
    for branch in branches:
        req = harness.prefill(branch)
        assert harness.last_match >= 96  # the shared history's blocks
        harness.finish(req)
    for branch in branches:
        req = harness.prefill(branch + tokens(60, 5))
        assert harness.last_match >= 160
        harness.finish(req)
    harness.assert_ledger()
    harness.assert_cells_hold_their_entries()


def test_a_compression_needs_no_free_memory():
    harness = TreeHarness(pool_slots=110)
    req = harness.prefill(tokens(70, 108, first=70), checkpoint=False)  # the pool is now full
    assert harness.allocator.available_size() == 2
    harness.checkpoint(req)  # its cells come from the segment's own slots
    harness.assert_ledger()
    assert len(harness.compressed_nodes()) == 1 and harness.allocator.available_size() > 60
    harness.finish(req)
    harness.assert_cells_hold_their_entries()
    harness.assert_ledger()


def test_a_prefill_that_needs_room_evicts_compressed_and_dense_nodes():
    harness = TreeHarness(pool_slots=300)
    for seed in range(6):
        harness.finish(harness.prefill(tokens(80 + seed, 100, first=80 + seed)))
        harness.assert_ledger()
    before = harness.stats_snapshot()
    big = harness.prefill(tokens(90, 260, first=90))  # needs nearly the whole pool dense
    harness.assert_ledger()
    after = harness.stats_snapshot()
    assert after["compressed_nodes_evicted"] > before["compressed_nodes_evicted"]
    assert after["dense_nodes_evicted"] > before["dense_nodes_evicted"]
    harness.finish(big)
    harness.assert_ledger()
    harness.assert_cells_hold_their_entries()


def test_locked_compressed_nodes_are_protected_and_never_evicted():
    harness = TreeHarness(pool_slots=300)
    running = harness.prefill(tokens(100, 100, first=100))  # not finished: it locks its nodes
    (node,) = harness.compressed_nodes()
    cells = node_record(node).segment.num_cells
    assert harness.arena.cells_locked == cells
    assert harness.tree.protected_size() >= -(-cells // harness.arena.cells_per_slot)
    harness.tree.evict(EvictParams(num_tokens=10_000))
    assert harness.compressed_nodes() == [node]
    harness.assert_ledger()
    harness.finish(running)
    assert harness.arena.cells_locked == 0
    harness.tree.evict(EvictParams(num_tokens=10_000))
    assert harness.compressed_nodes() == [] and harness.arena.slots_borrowed == 0
    assert harness.allocator.available_size() == harness.allocator.size
    harness.assert_ledger()


def test_eviction_moves_cells_to_give_slots_back_before_evicting_anything():
    harness = TreeHarness(pool_slots=400, rule=KeepEvery(3))
    # Uneven cell counts, so conversations share borrowed slots (holes are filled first).
    requests = [harness.prefill(tokens(110 + i, 61 + i, first=110 + i)) for i in range(6)]
    for req in requests:
        harness.finish(req)
    nodes = harness.compressed_nodes()
    for node in nodes[::2]:  # evicting every other conversation leaves holes in shared slots
        harness.tree._evict_leaf(next(iter(node.children.values())))  # its dense tail first
        harness.tree._evict_leaf(node)
    harness.assert_ledger()
    reclaimable = harness.arena.slots_reclaimable_by_moves
    assert reclaimable >= 1
    survivors = harness.compressed_nodes()
    evicted_before = harness.stats.compressed_nodes_evicted
    harness.tree.evict(EvictParams(num_tokens=reclaimable))
    assert harness.stats.compressed_nodes_evicted == evicted_before  # moves were enough
    assert harness.arena.slots_reclaimable_by_moves == 0 and harness.compressed_nodes() == survivors
    harness.assert_cells_hold_their_entries()  # every cell followed its move
    harness.assert_ledger()


def run_cycling_conversations(harness: TreeHarness, users: int, turns: int) -> float:
    """Users taking turns one after the other over their own documents; the fraction of prompt tokens
    of later turns that the prefix cache served."""
    conversations = [tokens(200 + user, 100, first=200 + user) for user in range(users)]
    served = prompted = 0
    for round_index, user in itertools.product(range(turns), range(users)):
        prompt = conversations[user] + ([] if round_index == 0 else tokens(300 + round_index, 8))
        conversations[user], reused = turn(harness, prompt, tokens(400 + round_index, 4))
        if round_index:
            served, prompted = served + reused, prompted + len(prompt)
    return served / prompted


class LeastRecentlyUsed(CompressedTreeOrder):
    """SGLang's default order, for comparison (another order is one class): the last use goes last."""

    def __init__(self):
        self.counter = itertools.count()

    def get_priority(self, node) -> tuple:
        return node_record(node).priority, node.id

    def created(self, record: NodeRecord, cost: NodeCost) -> None:
        record.priority = float(next(self.counter))

    reused = created

    def evicted(self, priority) -> None:
        pass

    def reset(self) -> None:
        pass


def test_conversations_cycling_through_a_slightly_too_small_pool_keep_a_stable_subset():
    """Five users taking turns where four conversations fit: LRU evicts exactly the next one needed and
    every turn misses; the GDSF order keeps most histories and their turns hit."""
    pool = 3 * 32 + 100 + 20  # three conversations' compressed histories (~32 slots each) and one prefill
    ours = run_cycling_conversations(TreeHarness(pool_slots=pool), users=5, turns=6)
    lru = run_cycling_conversations(TreeHarness(pool_slots=pool, order=LeastRecentlyUsed()), users=5, turns=6)
    assert lru < 0.05, lru
    assert ours > 0.35, ours


def test_flush_returns_the_pool_to_its_initial_state(harness):
    for seed in range(4):
        harness.finish(harness.prefill(tokens(500 + seed, 90, first=500 + seed)))
    assert harness.arena.slots_borrowed > 0
    harness.flush()
    assert harness.arena.slots_borrowed == harness.arena.cells_used == 0
    assert harness.compressed_nodes() == []
    assert harness.allocator.available_size() == harness.allocator.size
    harness.assert_ledger()


def test_block_scope_compresses_while_prefilling_in_chunks():
    """Chunks of 48 tokens, blocks of 32: each block is stored at the checkpoint of the chunk it ends in,
    its dense slots go back before the next chunk, and the request holds at most a chunk and a block dense."""
    harness = TreeHarness(pool_slots=400, scope=BlockScope(32))
    document = tokens(110, 300, first=110)
    req = harness.begin_chunked(document, 48)
    peak_dense = 0
    while req.kv.kv_committed_len < len(document):
        prefilled = req.kv.kv_committed_len
        harness.next_chunk(req, 48)
        harness.assert_ledger()
        stored_until = max((node_record(n).segment.end for n in harness.compressed_nodes()), default=0)
        assert stored_until == prefilled // 32 * 32  # every block of the chunks before
        assert req.kv.cache_protected_len == stored_until  # the rest is still the request's own
        peak_dense = max(peak_dense, req.kv.kv_allocated_len - req.kv.cache_protected_len)
    assert peak_dense <= 48 + 32
    harness.checkpoint(req)
    harness.finish(req)
    assert len(harness.compressed_nodes()) == 9  # [0, 288): the last token never joins a block
    harness.assert_cells_hold_their_entries()
    again = harness.prefill(document + tokens(111, 4), chunk=48)
    assert harness.last_match >= 9 * 32  # a later question reuses every block
    harness.finish(again)
    harness.assert_ledger()


def test_request_scope_holds_a_chunked_segment_until_its_last_chunk():
    harness = TreeHarness(pool_slots=400)
    prompt = tokens(120, 150, first=120)
    req = harness.begin_chunked(prompt, 64)
    harness.next_chunk(req, 64)
    assert harness.compressed_nodes() == [] and req.kv.cache_protected_len == 0  # nothing of it in the tree yet
    harness.next_chunk(req, 64)
    harness.checkpoint(req)
    (node,) = harness.compressed_nodes()
    assert (node_record(node).segment.start, node_record(node).segment.end) == (0, 150 - WINDOW)
    harness.finish(req)
    assert harness.stats.chunked_prefills == 1 and harness.stats.chunked_prefills_aborted == 0
    harness.assert_cells_hold_their_entries()
    harness.assert_ledger()


def test_an_abort_between_chunks_frees_everything_the_request_held():
    harness = TreeHarness(pool_slots=400, scope=BlockScope(32))
    document = tokens(130, 200, first=130)
    req = harness.begin_chunked(document, 64)
    harness.next_chunk(req, 64)  # blocks 0-1 stored, block 2 in progress
    assert len(harness.compressed_nodes()) == 2
    harness.abort(req)
    assert harness.stats.chunked_prefills_aborted == 1 and harness.stats.chunked_prefills == 0
    harness.assert_ledger()
    assert harness.coordinator.reconstructor is None
    harness.flush()
    assert harness.allocator.available_size() == harness.allocator.size
    harness.assert_ledger()


def test_chunked_requests_interleaved_and_a_reused_prefix_followed_by_chunks():
    """Two requests prefilled chunk by chunk in turns, then a third that reuses the first one's blocks and
    prefills its own part in chunks."""
    harness = TreeHarness(pool_slots=900, scope=BlockScope(32))
    first_doc, second_doc = tokens(140, 180, first=140), tokens(141, 170, first=141)
    first, second = harness.begin_chunked(first_doc, 40), harness.begin_chunked(second_doc, 40)
    while first.kv.kv_committed_len < len(first_doc) or second.kv.kv_committed_len < len(second_doc):
        for req in (first, second):
            if req.kv.kv_committed_len < len(req.origin_input_ids):
                harness.next_chunk(req, 40)
        harness.assert_ledger()
    for req in (first, second):
        harness.checkpoint(req)
        harness.finish(req)
    assert len(harness.compressed_nodes()) == 5 + 5
    third = harness.prefill(first_doc[:160] + tokens(142, 100), chunk=40)
    assert harness.last_match == 160  # the first document's five blocks
    harness.finish(third)
    assert len(harness.compressed_nodes()) == 10 + 3  # its own blocks [160, 256) after the reused ones
    harness.assert_cells_hold_their_entries()
    harness.assert_ledger()
