"""Block scope on real servers (tiny fp32 model): shared prefixes compressed once, reused by every request.

Blocks of ``BLOCK`` tokens aligned at position 0; a document of three blocks plus a short tail, then
a question. Server ``blocks`` (lava, a roomy pool) checks reuse, parity with the reference engine
and concurrent sharing; a server with a tight pool checks the eviction order. Both end with
/flush_cache giving every cell and slot back.

Reference schedules (``sgl_kvevict.reference.schedule``) mirror the server's forwards: a request
prefills its own tokens in one forward and compresses the blocks ending in it afterwards (blocks of
that forward score over each other densely, blocks reused from the tree over their kept entries).
A request that reuses every block of the document is the reference's context-only mode (document
compressed, then the question over it); the request that first computes them is the reference's
one-forward schedule over its whole prompt.
"""

from __future__ import annotations

import random

import pytest
import torch

import engine_client as client
from serving import running_server
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.reference.replay import ReplayedPlans
from test_engine_memory import run_concurrently

pytestmark = pytest.mark.server

BLOCK = 96
DOCUMENT = 3 * BLOCK + 20  # three blocks and a dense tail
QUESTION = 15
MAX_NEW_TOKENS = 6
BLOCK_FLAGS = ("--kv-evict-scope", "block", "--kv-evict-block-size", str(BLOCK), *client.TINY_SERVER_FLAGS)
# Half of a block: 48 entries per (layer, KV head), 12-16 selected beside the 32-token window (and the
# sinks of block 0). At 0.25 a block's budget would leave nothing to select and it would stay dense.
LAVA = EvictionConfig(policy="lava", budget="0.5")


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 250) for _ in range(length)]


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("block-plans")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory, dump_dir):
    flags = ("--kv-evict-policy", "lava", "--kv-evict-budget", "0.5", "--max-total-tokens", "4096",
             *client.ANY_REQUEST_OPTIONS, *BLOCK_FLAGS)  # fmt: skip
    log_dir = tmp_path_factory.mktemp("blocks")
    with client.checked_server(tiny_llama_dir, log_dir, *flags, dump_dir=dump_dir) as running:
        yield running


def reference_run(reference, prompt_ids, context_end, *steps, config=LAVA):
    """The reference's greedy run of ``prompt_ids`` prefilled in forwards ending at ``steps``
    (``(end, blocks compressed after it)``), then the rest densely."""
    from sgl_kvevict.reference import Prompt, PrefillStep, Schedule, Segment

    schedule = Schedule(
        tuple(PrefillStep(end, tuple(Segment(k * BLOCK, (k + 1) * BLOCK) for k in blocks)) for end, blocks in steps)
        + ((PrefillStep(len(prompt_ids)),) if steps[-1][0] < len(prompt_ids) else ())
    )
    prompt = Prompt.from_ids(prompt_ids, context_end)
    return reference.generate_scheduled(prompt, build_policy(config), schedule, MAX_NEW_TOKENS)


def reference_with_plans(reference, prompt_ids, steps):
    """The reference's greedy run of ``prompt_ids`` prefilled in forwards ending at ``steps`` (``(end,
    plans applied after it)``), then the rest densely: the server's composed selection, replayed."""
    from sgl_kvevict.reference import Prompt, PrefillStep, Schedule, Segment

    plans = [plan for _, step_plans in steps for plan in step_plans]
    schedule = Schedule(
        tuple(PrefillStep(end, tuple(Segment(p.segment_start, p.segment_end) for p in step_plans)) for end, step_plans in steps)
        + (PrefillStep(len(prompt_ids)),)
    )
    return reference.generate_scheduled(Prompt.from_ids(prompt_ids), ReplayedPlans(LAVA, plans), schedule, MAX_NEW_TOKENS)


def assert_block_plans(dump_dir, rid: str, blocks, expected_plans) -> None:
    for block, plan in zip(blocks, expected_plans, strict=True):
        client.assert_same_plan(torch.load(dump_dir / f"{rid}.block{block}.pt"), plan)


def test_different_questions_share_the_document_blocks(server, reference, dump_dir):
    document = tokens(1, DOCUMENT)
    first_prompt, second_prompt = document + tokens(2, QUESTION), document + tokens(3, QUESTION)

    first = client.generate(server, first_prompt, MAX_NEW_TOKENS, rid="first")
    expected_first = reference_run(reference, first_prompt, len(first_prompt), (len(first_prompt), (0, 1, 2)))
    assert_block_plans(dump_dir, "first", (0, 1, 2), expected_first.plans)
    assert tuple(first["output_ids"]) == expected_first.output_ids
    after_first = client.stats(server)
    assert (after_first["scope"], after_first["block_size"]) == ("block", BLOCK)
    assert after_first["compressed_nodes"] == after_first["compressed_nodes_created"] == 3
    assert after_first["compressed_tokens"] == 3 * BLOCK
    kept = sum(plan.total_kept() for plan in expected_first.plans)  # a block keeps its window in its cells
    assert after_first["arena_cells_used"] == after_first["kept_cells"] == kept

    second = client.generate(server, second_prompt, MAX_NEW_TOKENS, rid="second")
    assert second["meta_info"]["cached_tokens"] >= DOCUMENT  # three blocks and the dense tail
    assert not list(dump_dir.glob("second.*"))  # nothing scored, nothing compressed
    # Context-only: the document compressed in blocks, then the question over it.
    expected_second = reference_run(reference, second_prompt, DOCUMENT, (DOCUMENT, (0, 1, 2)))
    for recomputed, stored in zip(expected_second.plans, expected_first.plans, strict=True):
        for layer, other in zip(recomputed.layers, stored.layers):  # the blocks the server holds
            assert torch.equal(layer.kept_positions, other.kept_positions)
    assert tuple(second["output_ids"]) == expected_second.output_ids
    after_second = client.stats(server)
    assert after_second["compressed_nodes"] == after_second["compressed_nodes_created"] == 3  # each block held once
    assert after_second["arena_cells_used"] == after_first["arena_cells_used"]
    assert after_second["shared_node_hits"] == 3
    assert after_second["requests_served_per_node"] == {"2": 3}

    # Diverging inside the second block: the first block is reused; the request scores its own second
    # and third blocks in one forward over the compressed first one (the reference's second forward).
    # At its checkpoint the stored second block is split where the request diverges: the shared head
    # keeps the first request's selection, the request's own part hangs below it (its plan from the
    # divergence on), and its third block below that.
    divergence = BLOCK + 40
    diverging_prompt = document[:divergence] + tokens(4, 2 * BLOCK + 10) + tokens(5, QUESTION)
    diverging = client.generate(server, diverging_prompt, MAX_NEW_TOKENS, rid="diverging")
    assert diverging["meta_info"]["cached_tokens"] == BLOCK
    scored = reference_run(reference, diverging_prompt, BLOCK, (BLOCK, (0,)), (len(diverging_prompt), (1, 2)))
    assert_block_plans(dump_dir, "diverging", (1, 2), scored.plans[1:])
    # The tree's split rule: the stored selection before the divergence, the request's own from there.
    stored_second, own_second = expected_first.plans[1], scored.plans[1]
    head = stored_second.restricted(stored_second.segment_start, divergence)
    own = own_second.restricted(divergence, own_second.segment_end)
    steps = ((BLOCK, (expected_first.plans[0],)), (3 * BLOCK, (head, own, scored.plans[2])))
    expected_diverging = reference_with_plans(reference, diverging_prompt, steps)
    assert tuple(diverging["output_ids"]) == expected_diverging.output_ids
    after_diverging = client.stats(server)
    assert after_diverging["compressed_nodes"] == after_diverging["compressed_nodes_created"] == 6  # + head, own, third
    assert after_diverging["shared_node_hits"] == 4
    client.assert_no_leak_after_flush(server)


def test_kvzip_reconstructs_each_block_over_the_keys_before_its_end(server, reference, dump_dir):
    # Each block's reconstruction pass repeats the block's own tokens after its end, attending to
    # [0, block end): the reference engine's passes for the same block schedule.
    config = EvictionConfig.for_policy("lava", budget="0.5", score="kvzip")
    prompt = tokens(6, DOCUMENT) + tokens(7, QUESTION)
    response = client.generate(server, prompt, MAX_NEW_TOKENS, rid="kvzip", options=client.request_options(config))
    expected = reference_run(reference, prompt, len(prompt), (len(prompt), (0, 1, 2)), config=config)
    assert_block_plans(dump_dir, "kvzip", (0, 1, 2), expected.plans)
    assert tuple(response["output_ids"]) == expected.output_ids
    after = client.stats(server)
    assert after["compressed_nodes"] == 3 and after["arena_cells_used"] == after["kept_cells"]
    assert after["reconstructions_skipped"] == 0
    client.assert_no_leak_after_flush(server)  # the passes' slots and rows went back


def test_concurrent_requests_compress_every_shared_block_once(server):
    documents = [tokens(10 + d, DOCUMENT) for d in range(3)]
    prompts = [document + tokens(20 + q, QUESTION) for document in documents for q in range(4)]
    before = client.stats(server)
    calls = [lambda prompt=prompt: client.generate(server, prompt, 2) for prompt in prompts]
    run_concurrently(calls)
    after = client.stats(server)
    distinct_blocks = 3 * len(documents)
    assert after["compressed_nodes"] == distinct_blocks
    assert after["compressed_nodes_created"] - before["compressed_nodes_created"] == distinct_blocks
    assert after["arena_cells_used"] == after["kept_cells"]
    # Each of the 12 requests used its document's 3 blocks: reused, compressed or adopted after a lost race.
    served = after["requests_served_per_node"]
    assert sum(served.values()) == after["compressed_nodes_created"]
    races = after["compression_races_lost"] - before["compression_races_lost"]
    hits = after["shared_node_hits"] - before["shared_node_hits"]
    assert races + hits == len(prompts) * 3 - distinct_blocks
    client.assert_no_leak_after_flush(server)


def test_reused_blocks_survive_a_new_document_in_a_tight_pool(tiny_llama_dir, tmp_path):
    # snapkv at 0.5 keeps 48 of a block's 96 positions per (layer, KV head): 48 slots' worth of cells
    # per block, ~180 slots per document with its dense tail. The pool holds one document's dense
    # prefill and about two compressed documents.
    flags = ("--kv-evict-policy", "snapkv", "--kv-evict-budget", "0.5", "--max-total-tokens", "540", *BLOCK_FLAGS)
    reused, once, newest = (tokens(30 + d, DOCUMENT) for d in range(3))
    with running_server(tiny_llama_dir, tmp_path, *flags) as server:
        client.generate(server, reused + tokens(40, QUESTION), 2)
        assert client.generate(server, reused + tokens(41, QUESTION), 2)["meta_info"]["cached_tokens"] >= 3 * BLOCK
        client.generate(server, once + tokens(42, QUESTION), 2)
        client.generate(server, newest + tokens(43, QUESTION), 2)  # needs room: evicts compressed blocks
        full = client.stats(server)
        assert full["compressed_nodes_created"] == 9 and full["compressed_nodes_evicted"] >= 2
        assert full["arena_cells_used"] == full["kept_cells"]
        # A node enters cold; the blocks a second request reused stay, the ones used once go first.
        assert client.generate(server, reused + tokens(44, QUESTION), 2)["meta_info"]["cached_tokens"] >= 3 * BLOCK
        assert client.generate(server, once + tokens(45, QUESTION), 2)["meta_info"]["cached_tokens"] <= BLOCK
        client.assert_no_leak_after_flush(server)
        client.assert_strict_idle_check_passed(server)


def test_compressible_segments_by_scope():
    from sgl_kvevict.scope import BlockScope, RequestScope

    assert RequestScope().compressible_segments(10, 300, window=32) == [(10, 300)]  # request scope: its own segment
    assert RequestScope().compressible_segments(10, 40, window=32) == []  # not longer than the window
    # Block scope: full blocks before the prompt's last token, and none that starts before `start`.
    assert BlockScope(96).compressible_segments(0, 289, window=32) == [(0, 96), (96, 192), (192, 288)]
    assert BlockScope(96).compressible_segments(0, 288, window=32) == [(0, 96), (96, 192)]
    assert BlockScope(96).compressible_segments(100, 400, window=32) == [(192, 288), (288, 384)]  # block 1 is the tree's
