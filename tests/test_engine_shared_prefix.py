"""Request scope with a shared prefix on one real server (tiny model, snapkv): conversations that share
a system prompt are all compressed, by splitting the first conversation's node at the divergence.

Each prompt is the same ``SYSTEM`` tokens, then its own ``DOCUMENT`` tokens (distinct first tokens,
so conversations diverge exactly at ``SYSTEM``). snapkv at 0.25 keeps 91 - 32 = 59 entries per
(layer, KV head) of a 364-token prompt, window excluded: 236 cells, 59 slots' worth, plus its dense
window and answer. The pool (700 slots) holds one prompt's dense prefill and about three compressed
conversations, so a few more evict. Every test ends with /flush_cache giving every cell and slot back.
"""

from __future__ import annotations

import pytest

from engine_client import (
    TINY_SERVER_FLAGS,
    assert_no_leak_after_flush,
    module_server,
    flush,
    generate,
    stats,
)
from test_engine_memory import prompt

pytestmark = pytest.mark.server

WINDOW = 32
SYSTEM = prompt(seed=0, length=64)
DOCUMENT = 300
SERVER_FLAGS = (
    "--kv-evict-policy", "snapkv", "--kv-evict-budget", "0.25", "--max-total-tokens", "700", *TINY_SERVER_FLAGS,
)  # fmt: skip


def conversation(seed: int) -> list[int]:
    return SYSTEM + prompt(seed, DOCUMENT)


server = module_server("shared-prefix", *SERVER_FLAGS)


@pytest.fixture(autouse=True)
def empty_tree(server):
    flush(server)


def test_every_conversation_sharing_a_system_prompt_is_compressed_and_reused(server):
    before = stats(server)
    prompts = [conversation(seed) for seed in (1, 2, 3)]
    outputs = [generate(server, ids, 8)["output_ids"] for ids in prompts]
    compressed = stats(server)
    assert compressed["requests_compressed"] - before["requests_compressed"] == 3
    # The first conversation's node split into the shared head and its tail; the other two hang below the head.
    assert compressed["compressed_nodes"] == 4
    assert compressed["compressed_nodes_created"] - before["compressed_nodes_created"] == 4
    own_segment = len(prompts[0]) - WINDOW
    assert compressed["compressed_tokens"] == own_segment + 2 * (own_segment - len(SYSTEM))
    assert compressed["arena_cells_used"] == compressed["kept_cells"]
    assert compressed["requests_served_per_node_max"] == 3  # the head, by all three conversations

    for ids, output in zip(prompts, outputs):
        next_turn = ids + output + prompt(seed=50, length=40)
        assert generate(server, next_turn, 4)["meta_info"]["cached_tokens"] >= len(ids)
    reused = stats(server)
    assert reused["reuse_hits"] - compressed["reuse_hits"] == 3

    # Sharing only the system prompt reuses none of the head: a match may pass through it, never end at it.
    assert generate(server, conversation(seed=4), 4)["meta_info"]["cached_tokens"] < len(SYSTEM)
    assert generate(server, SYSTEM + prompt(seed=5, length=8), 4)["meta_info"]["cached_tokens"] < len(SYSTEM)
    assert_no_leak_after_flush(server)


def test_conversations_sharing_a_system_prompt_evict_each_other_but_never_leak(server):
    before = stats(server)
    for seed in range(10, 16):
        generate(server, conversation(seed), 4)
    after = stats(server)
    assert after["requests_compressed"] - before["requests_compressed"] == 6
    assert after["compressed_nodes_evicted"] > before["compressed_nodes_evicted"]
    assert after["arena_cells_used"] == after["kept_cells"]
    # The newest conversation survived the evictions, the head it hangs below included.
    assert generate(server, conversation(seed=15) + prompt(seed=60, length=20), 4)["meta_info"]["cached_tokens"] >= (
        len(SYSTEM) + DOCUMENT
    )
    assert_no_leak_after_flush(server)
