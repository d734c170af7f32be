"""``--kv-evict-when pressure`` in-process (``tree_harness``): a scored segment stays dense in the tree with
its plan (``engine.deferred``), and only ``evict`` compresses it, coldest first, before anything is
evicted; a locked node never; a split keeps each part's plan; SGLang's ledger after every step."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sgl_kvevict.engine.adapter import radix_cache
from sgl_kvevict.engine.deferred import PRESSURE
from sgl_kvevict.engine.records import node_record, request_record
from sgl_kvevict.scope import BlockScope
from tree_harness import WINDOW, TreeHarness, tokens


def pressure_harness(**kwargs) -> TreeHarness:
    return TreeHarness(compress_when=PRESSURE, **kwargs)


def chat_turn(harness: TreeHarness, prompt: list[int], output: list[int] = (7, 8, 9)) -> list[int]:
    """Prefill ``prompt``, decode ``output``, finish; the conversation so far."""
    req = harness.prefill(prompt)
    harness.assert_ledger()
    harness.decode(req, list(output))
    harness.finish(req)
    harness.assert_ledger()
    harness.assert_cells_hold_their_entries()
    return prompt + list(output)


def compress_every_deferred_node(harness: TreeHarness) -> None:
    """What ``evict`` does first when SGLang asks for more slots than those compressions give back."""
    harness.tree._compress_cold(harness.allocator.size)


def stored_entries(node) -> tuple[torch.Tensor, ...]:
    segment = node_record(node).segment
    return segment.start, segment.end, segment.layer_ids(), segment.head_ids(), segment.positions


def test_a_pool_with_room_keeps_the_prompt_dense_with_its_plan_and_the_next_turn_reuses_it():
    harness = pressure_harness()
    conversation = chat_turn(harness, tokens(1, 100, first=1))
    assert harness.compressed_nodes() == [] and harness.arena.slots_borrowed == 0
    (node,) = harness.deferred_nodes()
    assert len(node.key) == 100 - WINDOW and node_record(node).deferred.start == 0
    stats = harness.stats_snapshot()
    assert stats["deferred_nodes"] == 1 and stats["deferred_plan_bytes"] == node_record(node).deferred.nbytes > 0
    follow_up = harness.prefill(conversation + tokens(2, 20))
    assert harness.last_match == len(conversation)
    harness.finish(follow_up)
    assert stats["nodes_compressed_under_pressure"] == 0 and harness.stats.dense_nodes_evicted == 0


def test_pressure_compresses_cold_prompts_with_the_plan_prefill_would_have_stored_and_evicts_nothing():
    harness = pressure_harness(pool_slots=300)
    conversations = [chat_turn(harness, tokens(10 + seed, 90, first=10 + seed)) for seed in range(3)]
    # The first conversation's next turn: its nodes are reused, so warmer than the others.
    conversations[0] = chat_turn(harness, conversations[0] + tokens(20, 6))
    assert harness.compressed_nodes() == [] and harness.allocator.available_size() < 40
    deferred = {id(node): node_record(node).deferred for node in harness.deferred_nodes()}
    big = harness.prefill(tokens(30, 100, first=30))  # needs slots the pool has only in cached prompts
    harness.assert_ledger()
    stats = harness.stats_snapshot()
    assert stats["nodes_compressed_under_pressure"] >= 1 and stats["slots_freed_under_pressure"] > 0
    assert stats["dense_nodes_evicted"] == stats["compressed_nodes_evicted"] == 0
    # The cold prompts compressed in place, and the big prompt's own segment at its checkpoint (the pool is full).
    compressed = [node for node in harness.compressed_nodes() if id(node) in deferred]
    assert len(compressed) == stats["nodes_compressed_under_pressure"]
    assert len(harness.compressed_nodes()) == len(compressed) + 1 == len(compressed) + stats["compressed_at_checkpoint_under_pressure"]
    warm = {id(node) for node in harness.tree.root_node.children.values() if node.key.token_ids[0] == 10}
    assert not warm & {id(node) for node in compressed}  # the reused conversation is compressed last
    harness.assert_cells_hold_their_entries()
    # Each compressed node holds exactly the entries its plan kept, as the prefill mode stores them.
    for node in compressed:
        plan = deferred[id(node)]
        assert node_record(node).deferred is None and plan.evicts_anything()
        _, _, layers, heads, positions = stored_entries(node)
        expected = torch.cat([
            torch.stack([torch.full_like(layer.kept_positions, index), layer.head_ids(), layer.kept_positions])
            for index, layer in enumerate(plan.plan.layers)
        ], dim=1)  # fmt: skip
        assert torch.equal(torch.stack([layers, heads, positions]).sort(dim=1).values, expected.sort(dim=1).values)
    harness.finish(big)
    harness.assert_next_turns_reuse(conversations, seed=40, new_tokens=4)  # each still reuses its whole history


def test_the_same_prompt_is_stored_the_same_under_pressure_as_after_its_prefill():
    prompt = tokens(50, 120, first=50)
    at_prefill = TreeHarness(pool_slots=200)
    chat_turn(at_prefill, prompt)
    under_pressure = pressure_harness(pool_slots=200)
    chat_turn(under_pressure, prompt)
    under_pressure.tree.evict(EvictParams(num_tokens=1))
    (left,), (right,) = at_prefill.compressed_nodes(), under_pressure.compressed_nodes()
    for a, b in zip(stored_entries(left), stored_entries(right)):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    under_pressure.assert_cells_hold_their_entries()
    under_pressure.assert_ledger()


def test_a_node_a_running_request_reads_is_never_compressed_under_it():
    harness = pressure_harness(pool_slots=300)
    conversation = chat_turn(harness, tokens(60, 100, first=60))
    reader = harness.prefill(conversation + tokens(61, 10))  # running: it locks the conversation's nodes
    (node,) = [node for node in harness.deferred_nodes() if node.key.token_ids[0] == 60]
    assert node.lock_ref > 0
    harness.tree.evict(EvictParams(num_tokens=harness.allocator.size))
    assert node_record(node).deferred is not None and not node_record(node).is_compressed
    harness.assert_ledger()
    harness.finish(reader)
    compress_every_deferred_node(harness)  # unlocked now
    assert node_record(node).is_compressed and harness.stats.dense_nodes_evicted == 0
    harness.assert_cells_hold_their_entries()
    harness.assert_ledger()


def assert_one_more_checkpoint_compresses_then_prompts_defer(harness: TreeHarness, seed: int) -> None:
    """With ``PRESSURE_CHECKPOINTS`` 2, after the checkpoint of the request SGLang made room for: the next
    chat turn's segment is compressed at once, the one after it stays dense with its plan."""
    deferred_before = len(harness.deferred_nodes())
    chat_turn(harness, tokens(seed, 40, first=seed))  # the second checkpoint since: compressed at once
    assert harness.stats.compressed_at_checkpoint_under_pressure == 2 and len(harness.deferred_nodes()) == deferred_before
    chat_turn(harness, tokens(seed + 1, 40, first=seed + 1))  # then dense again, with its plan
    assert harness.stats.compressed_at_checkpoint_under_pressure == 2 and len(harness.deferred_nodes()) == deferred_before + 1
    harness.assert_cells_hold_their_entries()
    harness.assert_ledger()


def test_once_sglang_asks_for_room_checkpoints_compress_at_once_for_a_while(monkeypatch):
    """Cold prompts give SGLang all the room it asked for (nothing evicted), and still the next
    ``PRESSURE_CHECKPOINTS`` checkpoints compress their segments at once (as at prefill): the pool is full,
    and a prompt kept dense would only be compressed cold later; then prompts stay dense again."""
    monkeypatch.setattr(radix_cache, "PRESSURE_CHECKPOINTS", 2)
    harness = pressure_harness(pool_slots=300)
    for seed in range(3):
        chat_turn(harness, tokens(10 + seed, 90, first=10 + seed))
    assert harness.stats.compressed_at_checkpoint_under_pressure == 0  # the pool had room: all deferred
    big = harness.prefill(tokens(30, 100, first=30))  # its slots: cold prompts compressed, nothing evicted
    stats = harness.stats_snapshot()
    assert stats["nodes_compressed_under_pressure"] >= 1 and stats["dense_nodes_evicted"] == stats["compressed_nodes_evicted"] == 0
    assert stats["compressed_at_checkpoint_under_pressure"] == 1  # its own segment, compressed at its checkpoint
    harness.finish(big)
    assert_one_more_checkpoint_compresses_then_prompts_defer(harness, seed=60)


def test_after_compressing_cold_prompts_falls_short_checkpoints_compress_at_once_for_a_while(monkeypatch):
    """Running requests lock their dense prompts, so a prefill that needs room gets too little from cold
    prompts: the tree evicts, and the next ``PRESSURE_CHECKPOINTS`` checkpoints compress their segments at
    once (as at prefill); then prompts stay dense again."""
    monkeypatch.setattr(radix_cache, "PRESSURE_CHECKPOINTS", 2)
    harness = pressure_harness(pool_slots=300)
    chat_turn(harness, tokens(100, 60, first=100))  # a cold prompt with a plan, and its dense tail
    running = [harness.prefill(tokens(101 + k, 90, first=101 + k)) for k in range(2)]  # locked, dense
    assert harness.compressed_nodes() == [] and harness.stats.compressed_at_checkpoint_under_pressure == 0
    squeezed = harness.prefill(tokens(110, 100, first=110))  # its slots: the cold prompt compressed, its tail evicted
    harness.assert_ledger()
    stats = harness.stats_snapshot()
    assert stats["nodes_compressed_under_pressure"] == 1 and stats["dense_nodes_evicted"] >= 1
    assert stats["compressed_at_checkpoint_under_pressure"] == 1  # its own segment, compressed at its checkpoint
    assert len(harness.compressed_nodes()) == 2
    for req in [*running, squeezed]:
        harness.finish(req)
    assert_one_more_checkpoint_compresses_then_prompts_defer(harness, seed=120)


def test_while_the_pool_is_full_a_prompt_is_compressed_as_soon_as_its_last_reader_is_released():
    harness = pressure_harness(pool_slots=300)
    running = harness.prefill(tokens(40, 90, first=40))  # its prompt deferred (the pool has room), locked
    harness.decode(running, [7, 8])
    assert len(harness.deferred_nodes()) == 1 and harness.compressed_nodes() == []
    for seed in range(2):
        chat_turn(harness, tokens(10 + seed, 90, first=10 + seed))
    reader = harness.prefill(tokens(30, 100, first=30))  # needs room: the cold prompts compressed, not the read one
    (read,) = [node for node in harness.deferred_nodes() if node.key.token_ids[0] == 40]
    assert read.lock_ref > 0 and harness.stats.nodes_compressed_under_pressure >= 1
    compressed_before = harness.stats.nodes_compressed_under_pressure
    harness.finish(running)  # its last reader released: compressed at once, nothing evicted
    assert node_record(read).is_compressed and harness.stats.nodes_compressed_under_pressure == compressed_before + 1
    assert harness.stats.dense_nodes_evicted == 0
    harness.assert_ledger()
    harness.assert_cells_hold_their_entries()
    harness.finish(reader)
    harness.assert_ledger()


def test_a_split_keeps_each_parts_plan_and_both_parts_compress_under_pressure():
    harness = pressure_harness(pool_slots=400)
    system = tokens(70, 40, first=70)
    first = chat_turn(harness, system + tokens(71, 80))
    (whole,) = harness.deferred_nodes()
    plan = node_record(whole).deferred
    second = chat_turn(harness, system + tokens(72, 70))
    assert harness.last_match == 40  # a dense node: the match ends inside it (stock's split)
    head = harness.tree.root_node.children[system[0]]
    assert len(head.key) == 40 and len(head.children) == 2
    head_plan, tail_plan = node_record(head).deferred, node_record(whole).deferred
    assert (head_plan.start, head_plan.end, tail_plan.start, tail_plan.end) == (0, 40, 40, plan.end)
    assert not head_plan.match_may_end and tail_plan.match_may_end
    assert head_plan.plan.total_kept() + tail_plan.plan.total_kept() == plan.plan.total_kept()
    assert harness.stats.deferred_nodes == len(harness.deferred_nodes()) == 3  # head, tail, the second's own
    compress_every_deferred_node(harness)
    harness.assert_ledger()
    harness.assert_cells_hold_their_entries()
    assert node_record(head).is_compressed and not node_record(head).match_may_end
    assert harness.stats.deferred_nodes == harness.stats.deferred_plan_bytes == 0


def test_block_scope_defers_every_block_and_a_document_sharing_them_reuses_them_compressed():
    harness = pressure_harness(pool_slots=300, scope=BlockScope(32))
    document = tokens(80, 100, first=80)
    chat_turn(harness, document)
    blocks = harness.deferred_nodes()
    assert sorted(len(node.key) for node in blocks) == [32, 32, 32] and harness.compressed_nodes() == []
    compress_every_deferred_node(harness)
    assert len(harness.compressed_nodes()) == 3
    question = harness.prefill(document[:70] + tokens(81, 10))
    assert harness.last_match == 64  # two whole compressed blocks
    harness.finish(question)
    harness.assert_ledger()
    harness.assert_cells_hold_their_entries()


def test_a_chunked_prefill_defers_its_blocks_and_none_is_compressed_under_the_request_prefilling_it():
    """Chunks of 48 tokens, blocks of 32: each block enters the tree dense with its plan at the checkpoint
    of the chunk it ends in; the request holds them (locked) until it finishes, so a pool that needs room
    compresses none of them under it."""
    harness = pressure_harness(pool_slots=400, scope=BlockScope(32))
    document = tokens(85, 200, first=85)
    req = harness.begin_chunked(document, 48)
    while req.kv.kv_committed_len < len(document):
        harness.next_chunk(req, 48)
        harness.assert_ledger()
    harness.checkpoint(req)
    assert len(harness.deferred_nodes()) == 6 and harness.compressed_nodes() == []
    compress_every_deferred_node(harness)
    assert harness.compressed_nodes() == []  # all locked by the request
    harness.finish(req)
    compress_every_deferred_node(harness)
    assert len(harness.compressed_nodes()) == 6
    harness.assert_cells_hold_their_entries()
    harness.assert_ledger()


def test_a_prompt_admitted_compressed_has_every_block_compressed_though_the_pressure_lapses(monkeypatch):
    """SGLang admitted the prompt by its compressed peak (``admission``): its blocks must be compressed at
    their checkpoints even after ``PRESSURE_CHECKPOINTS`` pass without SGLang asking for room, or the room
    admission counted on would be held dense. Another prompt, admitted dense, defers its blocks."""
    monkeypatch.setattr(radix_cache, "PRESSURE_CHECKPOINTS", 1)
    harness = pressure_harness(pool_slots=400, scope=BlockScope(32))
    harness.tree.felt_pressure()
    assert harness.tree.under_pressure
    admitted = harness.begin_chunked(tokens(86, 200, first=86), 48)
    request_record(admitted).admitted_compressed = True
    while admitted.kv.kv_committed_len < 200:
        harness.next_chunk(admitted, 48)
        harness.assert_ledger()
    harness.checkpoint(admitted)
    assert not harness.tree.under_pressure  # lapsed after its first block
    assert len(harness.compressed_nodes()) == harness.stats.compressed_at_checkpoint_under_pressure == 6
    assert harness.deferred_nodes() == []
    harness.finish(admitted)
    chat_turn(harness, tokens(87, 100, first=87))
    assert len(harness.deferred_nodes()) == 3 and len(harness.compressed_nodes()) == 6
    harness.assert_cells_hold_their_entries()
    harness.assert_ledger()


def test_a_waiting_queue_whose_new_tokens_exceed_the_free_pool_puts_the_tree_under_pressure():
    """``weigh_waiting`` (before SGLang forms a prefill batch): each waiting prompt counts what a match would
    not reuse; the tree goes under pressure only once that exceeds what the pool has free, and the first
    prompt then admitted is compressed at its checkpoint instead of being read dense (and the cached
    conversation no request reads any more, at that request's release)."""
    harness = pressure_harness(pool_slots=600)
    conversation = chat_turn(harness, tokens(95, 150, first=95))
    free = harness.allocator.available_size()
    follow_ups = [harness.request(conversation + tokens(96 + turn, 40)) for turn in range(4)]
    harness.tree.weigh_waiting(follow_ups)  # 4 x 40 new tokens: the history is cached
    assert not harness.tree.under_pressure and harness.stats.pressure_from_waiting_queue == 0
    assert 2 * 190 < free < 4 * 190
    new_documents = [harness.request(tokens(100 + seed, 190, first=100 + seed)) for seed in range(4)]
    harness.tree.weigh_waiting(new_documents[:2])  # 380 new tokens, under the pool's free room
    assert not harness.tree.under_pressure
    harness.tree.weigh_waiting(new_documents)
    assert harness.tree.under_pressure and harness.stats_snapshot()["pressure_from_waiting_queue"] == 1
    chat_turn(harness, tokens(100, 190, first=100))
    assert harness.stats.compressed_at_checkpoint_under_pressure == 1 and harness.stats.nodes_compressed_under_pressure == 1
    assert len(harness.compressed_nodes()) == 2 and harness.deferred_nodes() == []
    harness.assert_ledger()


def test_flush_drops_the_plans_and_returns_every_slot():
    harness = pressure_harness(pool_slots=300)
    for seed in range(3):
        chat_turn(harness, tokens(90 + seed, 80, first=90 + seed))
    harness.tree.evict(EvictParams(num_tokens=100))
    assert harness.compressed_nodes() and harness.deferred_nodes()
    harness.flush()
    assert harness.deferred_nodes() == [] and harness.stats.deferred_nodes == harness.stats.deferred_plan_bytes == 0
    assert harness.allocator.available_size() == harness.allocator.size and harness.arena.slots_borrowed == 0
    harness.assert_ledger()
