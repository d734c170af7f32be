"""``--kv-evict-when pressure`` on a real server (tiny fp32 model, snapkv at 0.25, request scope): while the
pool has room every prompt stays dense with its plan, so a conversation decodes the dense model's greedy
tokens (the reference's, which evicts nothing) and nothing is compressed; when later conversations need
the room, cold prompts are compressed in place instead of evicted, their next turns still reuse them, and
a flush gives every slot, cell and plan back. Block scope with chunked prefill: a prompt the pool cannot take
dense beside a running request is admitted at once by its compressed peak, and the running request's
prompt is not compressed under it; prompts arriving together that the pool cannot take dense are
compressed at their checkpoints from the first one on."""

from __future__ import annotations

import threading

import pytest

import engine_client as client
from sgl_kvevict.config import EvictionConfig, build_policy

pytestmark = pytest.mark.server

POOL = 1500
PROMPT = 300
MAX_NEW_TOKENS = 6
FLAGS = ("--kv-evict-policy", "snapkv", "--kv-evict-budget", "0.25", "--kv-evict-when", "pressure",
         "--max-total-tokens", str(POOL), *client.TINY_SERVER_FLAGS)  # fmt: skip


BLOCK_POOL = 2200
BLOCK_FLAGS = ("--kv-evict-policy", "snapkv", "--kv-evict-budget", "0.25", "--kv-evict-when", "pressure",
               "--kv-evict-scope", "block", "--kv-evict-block-size", "192", "--chunked-prefill-size", "128",
               "--max-total-tokens", str(BLOCK_POOL), *client.TINY_SERVER_FLAGS)  # fmt: skip
block_server = client.module_server("pressure-blocks", *BLOCK_FLAGS)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with client.checked_server(tiny_llama_dir, tmp_path_factory.mktemp("pressure"), *FLAGS) as running:
        yield running


def chat(server, reference, prompt: list[int], rid: str, *, dense_tokens: bool) -> list[int]:
    """One turn; with ``dense_tokens``, its greedy tokens are the dense model's. Returns the conversation."""
    response = client.generate(server, prompt, MAX_NEW_TOKENS, rid=rid)
    output = list(response["output_ids"])
    if dense_tokens:
        dense = reference.generate(prompt, build_policy(EvictionConfig.for_policy("full")), max_new_tokens=MAX_NEW_TOKENS)
        assert tuple(output) == dense.output_ids, rid
    return prompt + output


def test_with_room_answers_are_dense_and_under_pressure_cold_prompts_are_compressed_not_evicted(server, reference):
    first = chat(server, reference, client.random_prompt(PROMPT, seed=1), "first-1", dense_tokens=True)
    second_prompt = first + client.random_prompt(20, seed=2)
    response = client.generate(server, second_prompt, MAX_NEW_TOKENS, rid="first-2")
    assert response["meta_info"]["cached_tokens"] >= len(first) - 1
    chat(server, reference, second_prompt, "first-2-again", dense_tokens=True)
    stats = client.stats(server)
    assert stats["compress_when"] == "pressure" and stats["deferred_nodes"] >= 1 and stats["deferred_plan_bytes"] > 0
    assert stats["compressed_nodes"] == stats["nodes_compressed_under_pressure"] == 0

    # Five more conversations of 300 tokens do not fit beside it dense: the coldest prompts are compressed.
    others = [chat(server, reference, client.random_prompt(PROMPT, seed=10 + k), f"other-{k}", dense_tokens=False) for k in range(5)]
    stats = client.stats(server)
    assert stats["nodes_compressed_under_pressure"] >= 1 and stats["slots_freed_under_pressure"] > 0
    assert stats["compressed_nodes"] >= 1 and stats["compressed_nodes_evicted"] == 0
    for k, conversation in enumerate(others[-2:]):  # the latest conversations' next turns reuse their prompts
        response = client.generate(server, conversation + client.random_prompt(10, seed=30 + k), MAX_NEW_TOKENS, rid=f"next-{k}")
        assert response["meta_info"]["cached_tokens"] >= PROMPT
    after = client.assert_no_leak_after_flush(server)
    assert after["deferred_nodes"] == after["deferred_plan_bytes"] == 0


def test_a_prompt_the_pool_cannot_take_dense_is_admitted_compressed_beside_a_running_request(block_server):
    """A 1000-token prompt decoding 600 tokens holds its prompt dense (the pool had room) and SGLang reserves
    room for its answer, so a 900-token prompt does not fit dense beside it: counted dense, it would wait
    until the first finishes. Counted by its compressed peak (~510 slots), it is admitted at once, its
    blocks are compressed at their checkpoints, and it finishes while the first still decodes, whose prompt
    nothing compresses under it."""
    first_tokens = threading.Event()
    long_answer = {"input_ids": client.random_prompt(1000, seed=40), "rid": "long",
                   "sampling_params": {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    received = []

    def decode_long():
        received.append(client.stream(block_server, long_answer, on_chunk=first_tokens.set))

    running = threading.Thread(target=decode_long)
    running.start()
    try:
        assert first_tokens.wait(timeout=300)
        assert client.stats(block_server)["prompts_admitted_compressed"] == 0  # the first was admitted dense
        client.generate(block_server, client.random_prompt(900, seed=41), 4, rid="squeezed")
        assert running.is_alive(), "the second prompt waited for the first request to finish"
        stats = client.stats(block_server)
        assert stats["prompts_admitted_compressed"] == 1
        assert stats["compressed_at_checkpoint_under_pressure"] >= 900 // 192
        assert stats["nodes_compressed_under_pressure"] == 0 and stats["deferred_nodes"] >= 1000 // 192
    finally:
        running.join(timeout=300)
    assert received and not running.is_alive()
    client.assert_no_leak_after_flush(block_server)


def test_prompts_arriving_together_that_the_pool_cannot_take_dense_are_compressed_from_the_first_on(block_server):
    """Four 700-token prompts in one batch (2800 new tokens, pool 2200): the waiting queue alone exceeds the
    free pool, so the tree is under pressure before the first is admitted, and every full block of every
    prompt is compressed at its checkpoint. Weighed one prompt at a time (SGLang admits one 128-token chunk
    per forward), the first prompts would be inserted dense and only compressed cold later."""
    before = client.stats(block_server)
    prompts = [client.random_prompt(700, seed=50 + k) for k in range(4)]
    replies = client.generate(block_server, prompts, 4, rid=[f"together-{k}" for k in range(4)])
    assert len(replies) == 4 and all(reply["meta_info"]["completion_tokens"] == 4 for reply in replies)
    stats = client.stats(block_server)
    grew = {name: stats[name] - before[name] for name in (
        "pressure_from_waiting_queue", "compressed_at_checkpoint_under_pressure", "nodes_compressed_under_pressure")}  # fmt: skip
    assert grew["pressure_from_waiting_queue"] >= 1
    assert grew["compressed_at_checkpoint_under_pressure"] == 4 * (700 // 192), grew
    assert grew["nodes_compressed_under_pressure"] == 0, grew
    client.assert_no_leak_after_flush(block_server)
