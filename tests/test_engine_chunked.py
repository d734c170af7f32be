"""Chunked prefill on the compressed path: a prompt prefilled in several forwards is compressed as if it
were prefilled in one (request scope), and block scope compresses each block at the chunk it ends in.

Request scope: one tiny fp32 server per chunk size (256 and 1024 tokens) serves every case through
per-request options; for prompts longer than a chunk the kept positions per (layer, KV head) equal the
reference engine's unchunked plan (the unchunked server's are held to the same plans by
``test_engine_parity``), for window (attn), learned and KVzip scores under topk, lava and ada-snapkv.
Ties aside: a chunked forward computes keys and hidden states in other shapes, so scores equal to the
last bit may order differently; the fp32 tiny model has none on these prompts (the test would say).

Block scope: a later chunk reads the blocks of earlier chunks compressed (they were stored and their
dense slots freed: compress while prefilling), which is the reference engine's block schedule fed in
the same forwards (``Schedule`` steps at the chunk ends). With it a prompt longer than the pool is
served, and a request that cannot fit even compressed is refused rather than left waiting.
"""

from __future__ import annotations


import pytest
import torch

import engine_client as client
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.reference.engine import Prompt
from sgl_kvevict.reference.schedule import PrefillStep, Schedule, Segment

pytestmark = pytest.mark.server

CHUNK_SIZES = (256, 1024)
PROMPT_LENGTHS = (600, 1300)
CASES = [(policy, score) for score in ("attn", "learned", "kvzip") for policy in ("topk", "lava", "ada-snapkv")]


@pytest.fixture(scope="module", params=CHUNK_SIZES, ids=lambda size: f"chunk{size}")
def chunked_server(request, tiny_llama_dir, tmp_path_factory):
    dump_dir = tmp_path_factory.mktemp("plans")
    flags = ("--kv-evict-policy", "snapkv", *client.ANY_REQUEST_OPTIONS, "--max-total-tokens", "8192",
             "--chunked-prefill-size", str(request.param), *client.TINY_SERVER_FLAGS)  # fmt: skip
    log_dir = tmp_path_factory.mktemp("chunked")
    with client.checked_server(tiny_llama_dir, log_dir, *flags, dump_dir=dump_dir) as running:
        yield running, dump_dir, request.param


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(case))
def test_a_chunked_prompt_keeps_what_the_unchunked_reference_keeps(
    case, chunked_server, reference, learned_weights, tiny_llama_dir
):
    server, dump_dir, chunk = chunked_server
    policy, score = case
    overrides = {"score": score, **({"learned_weights": learned_weights} if score == "learned" else {})}
    config = EvictionConfig.for_policy(policy, **overrides)
    for index, length in enumerate(PROMPT_LENGTHS):
        prompt = client.random_prompt(length, seed=10 + index)
        rid = f"chunk{chunk}-{policy}-{score}-{index}"
        client.generate(server, prompt, 2, rid=rid, options=client.request_options(config))
        expected = reference.generate(prompt, build_policy(config).for_model(tiny_llama_dir), max_new_tokens=1)
        (reference_plan,) = expected.plans
        client.assert_same_plan(torch.load(dump_dir / f"{rid}.pt"), reference_plan)
    assert client.stats(server)["chunked_prefills"] >= sum(length > chunk for length in PROMPT_LENGTHS)
    client.assert_no_leak_after_flush(server)


BLOCK, BLOCK_CHUNK, BLOCK_POOL, BLOCK_BUDGET = 128, 256, 1000, "0.3"


@pytest.fixture(scope="module")
def block_server(tiny_llama_dir, tmp_path_factory):
    """Block scope, chunks of 256 tokens, blocks of 128, a pool of 1000 slots: a fresh prompt of up to
    ~2170 tokens fits compressed while prefilling (``PrefillFootprint.longest_prompt``)."""
    dump_dir = tmp_path_factory.mktemp("block-plans")
    flags = ("--kv-evict-policy", "snapkv", "--kv-evict-budget", BLOCK_BUDGET, *client.ANY_REQUEST_OPTIONS,
             "--kv-evict-scope", "block", "--kv-evict-block-size", str(BLOCK), "--chunked-prefill-size", str(BLOCK_CHUNK),
             "--max-total-tokens", str(BLOCK_POOL), *client.TINY_SERVER_FLAGS)  # fmt: skip
    log_dir = tmp_path_factory.mktemp("blocks")
    with client.checked_server(tiny_llama_dir, log_dir, *flags, dump_dir=dump_dir) as running:
        yield running, dump_dir


@pytest.mark.parametrize("policy,score", [("topk", "attn"), ("ada-snapkv", "learned")])
def test_block_scope_compresses_each_block_at_its_chunk(policy, score, block_server, reference, learned_weights, tiny_llama_dir):
    """Blocks 0-1 are stored after the first chunk, so the second chunk's prefill and scoring read them
    compressed, as the reference's schedule with the same steps."""
    server, dump_dir = block_server
    length = 700
    overrides = {"score": score, "budget": BLOCK_BUDGET, **({"learned_weights": learned_weights} if score == "learned" else {})}
    config = EvictionConfig.for_policy(policy, **overrides)
    prompt = client.random_prompt(length, seed=3)
    chunked_before = client.stats(server)["chunked_prefills"]
    rid = f"blocks-{policy}-{score}"
    response = client.generate(server, prompt, 4, rid=rid, options=client.request_options(config))
    blocks = [Segment(start, start + BLOCK) for start in range(0, length - 1 - BLOCK + 1, BLOCK)]
    ends = [*range(BLOCK_CHUNK, length, BLOCK_CHUNK), length]
    steps = [PrefillStep(end, tuple(b for b in blocks if begin < b.end <= end)) for begin, end in zip([0, *ends], ends)]
    expected = reference.generate_scheduled(
        Prompt.from_ids(prompt), build_policy(config).for_model(tiny_llama_dir), Schedule(tuple(steps)), 4
    )
    assert len(expected.plans) == len(blocks) == 5
    for index, plan in enumerate(expected.plans):
        client.assert_same_plan(torch.load(dump_dir / f"{rid}.block{index}.pt"), plan)
    assert tuple(response["output_ids"]) == expected.output_ids
    assert client.stats(server)["chunked_prefills"] == chunked_before + 1
    client.assert_no_leak_after_flush(server)


def test_a_prompt_longer_than_the_pool_is_served_and_one_that_cannot_fit_is_refused(block_server):
    """Compress while prefilling: a 1600-token prompt in a 1000-slot pool is served (stock SGLang refuses
    any prompt longer than its pool). A follow-up whose cached prefix (compressed blocks plus the dense
    tail and reply) and new tokens exceed the pool at their peak is refused with an error instead of
    waiting forever for room that can never come."""
    server, _ = block_server
    prompt = client.random_prompt(1600, seed=5)
    first = client.generate(server, prompt, 2)
    assert first["meta_info"]["finish_reason"]["type"] == "length", first["meta_info"]
    assert len(first["output_ids"]) == 2  # SGLang alone would clip the answer to nothing (prompt + answer > pool)
    after = client.stats(server)
    assert after["compressed_nodes"] == (len(prompt) - 1) // BLOCK, after  # every block ends before the last token
    follow_up = [*prompt, *first["output_ids"], *client.random_prompt(500, seed=6)]
    status, body = client.post_status(server, {"input_ids": follow_up, "sampling_params": {"max_new_tokens": 2}})
    assert status == 400, (status, body[:500])
    assert "the KV pool holds" in body, body[:500]
    client.assert_no_leak_after_flush(server)
