"""Memory behaviour of the compressed radix cache on one real server (tiny model, snapkv, a tight pool).

snapkv at 0.25 keeps 75 - 32 = 43 entries per (layer, KV head) of a 300-token prompt, window excluded:
172 cells, 43 slots' worth (the tiny model has 4 cells per slot), plus the 32-token dense window and
the answer. The pool (900 slots, shared by dense and compressed KV) holds two prompts' dense prefill
and a few compressed conversations, so concurrent conversations fill it and later ones evict; every
test ends with /flush_cache giving every cell and slot back.
"""

from __future__ import annotations

import random
import threading
import urllib.error

import pytest

from engine_client import (
    TINY_SERVER_FLAGS,
    abort,
    assert_no_leak_after_flush,
    module_server,
    flush,
    generate,
    stats,
    stream,
)

pytestmark = pytest.mark.server

PROMPT_LENGTH = 300
SERVER_FLAGS = (
    "--kv-evict-policy", "snapkv", "--kv-evict-budget", "0.25", "--max-total-tokens", "900", *TINY_SERVER_FLAGS,
)  # fmt: skip


def prompt(seed: int, length: int = PROMPT_LENGTH) -> list[int]:
    rng = random.Random(seed)
    # Distinct first tokens: prompts of different seeds share no prefix.
    return [5 + seed] + [rng.randrange(40, 250) for _ in range(length - 1)]


server = module_server("memory", *SERVER_FLAGS)


@pytest.fixture(autouse=True)
def empty_tree(server):
    """Every test starts from an empty tree (counters such as reuse_hits keep counting)."""
    flush(server)


def run_concurrently(calls) -> list:
    results = [None] * len(calls)

    def run(index, call):
        results[index] = call()

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_next_turn_reuses_the_compressed_prompt_and_a_divergent_one_does_not(server):
    first_prompt = prompt(seed=1)
    first = generate(server, first_prompt, 8)
    before = stats(server)
    assert before["compressed_nodes"] == 1 and before["compressed_tokens"] == PROMPT_LENGTH - 32

    next_turn = first_prompt + first["output_ids"] + prompt(seed=2, length=60)
    second = generate(server, next_turn, 8)
    assert second["meta_info"]["cached_tokens"] >= PROMPT_LENGTH
    after = stats(server)
    assert after["reuse_hits"] == before["reuse_hits"] + 1
    assert after["reused_tokens"] == before["reused_tokens"] + PROMPT_LENGTH - 32

    # Diverging inside the compressed node (which starts at 0) reuses none of it.
    divergent = first_prompt[:150] + prompt(seed=3, length=150)
    assert generate(server, divergent, 4)["meta_info"]["cached_tokens"] == 0
    assert stats(server)["reuse_hits"] == after["reuse_hits"]
    assert_no_leak_after_flush(server)


def test_a_tight_pool_serves_concurrent_conversations_and_evicts_without_leaking(server):
    before = stats(server)
    # Five conversations decode together: mixed batches of compressed and plain requests, more dense
    # prefill than the pool holds at once, so SGLang admits them as memory frees up.
    results = run_concurrently([lambda seed=seed: generate(server, prompt(seed), 96) for seed in range(10, 15)])
    assert all(len(result["output_ids"]) == 96 for result in results)
    during = stats(server)
    assert during["requests_compressed"] - before["requests_compressed"] == 5
    assert during["arena_cells_used"] == during["kept_cells"]

    # New conversations need room: compressed nodes and dense leaves are evicted through one order.
    for seed in range(20, 26):
        generate(server, prompt(seed), 4)
    after = stats(server)
    assert after["compressed_nodes_evicted"] > during["compressed_nodes_evicted"]
    assert after["dense_nodes_evicted"] > during["dense_nodes_evicted"]
    assert after["arena_cells_used"] == after["kept_cells"]
    assert_no_leak_after_flush(server)


def stream_then_abort(server, input_ids: list[int], rid: str) -> int:
    """Stream a long generation, abort it after the first chunks; returns the chunks received."""
    payload = {"input_ids": input_ids, "rid": rid, "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    return stream(server, payload, abort_after=3)


def test_client_aborts_in_prefill_and_decode_leak_nothing(server):
    # Decode: aborted after a few streamed tokens, with its compressed prompt in the tree.
    assert 3 <= stream_then_abort(server, prompt(seed=30), rid="abort-decode") < 400
    # Prefill: the abort races the prefill of long prompts; whichever side wins, nothing may leak.
    long_prompts = [prompt(seed, length=1200) for seed in (31, 32)]
    calls = [lambda ids=ids, i=i: _generate_or_aborted(server, ids, f"abort-prefill-{i}") for i, ids in enumerate(long_prompts)]
    calls += [lambda i=i: abort(server, f"abort-prefill-{i}") for i in range(len(long_prompts))]
    run_concurrently(calls)
    assert_no_leak_after_flush(server)


def _generate_or_aborted(server, input_ids: list[int], rid: str) -> dict:
    try:
        return generate(server, input_ids, 64, rid=rid)
    except urllib.error.HTTPError as error:  # an aborted request answers with an error status
        return {"aborted": error.code}
