"""Gemma 3 served with a policy: local (sliding-window) layers keep only what their window can still read.

A tiny random Gemma 3 (three local layers with a 16-token window, then a global one; fp32) is served by
stock SGLang and by the plugin with ``full`` in request scope and in block scope (48-token blocks),
both with chunked prefill (256-token chunks), and per request with every other policy. ``full`` keeps every global-layer entry and trims local
layers to their window (``sgl_kvevict.local_layers``): lossless, so stock, the plugin and the HF
reference decode the same greedy tokens over 3-turn chats whose answers outrun the window, shared
prefixes that split compressed nodes (the split head gains the window before the divergence from the
splitting request's dense slots), and concurrent requests. With snapkv on the global layers the
plans equal the reference's, and the tokens equal the reference's whether local layers are trimmed or
kept whole. Memory per node is counted exactly; after every test a flush gives every cell and slot
back, and SGLang's strict idle check never fires (``checked_server``). Every other policy keeps, in both
scopes, the plans the reference keeps and decodes its tokens (KVzip's reconstruction passes window
their local layers too).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import engine_client as client
from sgl_kvevict.checkpoints import build_tiny_model
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.policies import get_policy_class, registered_policies

pytestmark = pytest.mark.server

WINDOW = 16  # the local layers' sliding_window
LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention"]
LOCAL, GLOBAL = 3, 1
KV_HEADS = 2
BLOCK = 48
OBSERVATION_WINDOW = 32  # full's window: request scope leaves the prompt's last 32 tokens dense
ANSWER = 40  # longer than the window: later turns read only the answer in local layers
# A prompt over 256 new tokens is prefilled in chunks (the chat's first turn). Plans and tokens of a compressing
# policy are compared with the one-forward reference on prompts prefilled in one forward: a chunked prefill
# rounds its fp32 sums in other shapes, which can flip a near tie of this random model's scores or logits.
CHUNK = 256
FLAGS = ("--kv-evict-policy", "full", *client.ANY_REQUEST_OPTIONS, "--chunked-prefill-size", str(CHUNK),
         "--max-total-tokens", "4096", *client.TINY_SERVER_FLAGS)  # fmt: skip
SCOPES = {"request": (), "block": ("--kv-evict-scope", "block", "--kv-evict-block-size", str(BLOCK))}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("gemma3"), "gemma3", num_layers=4, num_kv_heads=KV_HEADS,
        overrides=dict(layer_types=LAYER_TYPES, sliding_window=WINDOW),
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(gemma_dir):
    from sgl_kvevict.reference.engine import ReferenceEngine

    return ReferenceEngine(gemma_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def stock(gemma_dir, tmp_path_factory):
    with client.checked_server(gemma_dir, tmp_path_factory.mktemp("stock"), "--max-total-tokens", "4096",
                               *client.TINY_SERVER_FLAGS) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module", params=sorted(SCOPES))
def plugin(request, gemma_dir, tmp_path_factory):
    dump_dir = tmp_path_factory.mktemp(f"plans-{request.param}")
    log_dir = tmp_path_factory.mktemp(f"plugin-{request.param}")
    with client.checked_server(gemma_dir, log_dir, *FLAGS, *SCOPES[request.param], dump_dir=dump_dir) as server:
        server.scope, server.dump_dir = request.param, dump_dir
        yield server


@pytest.fixture(autouse=True)
def flushed(request):
    yield
    if "plugin" in request.fixturenames:
        client.assert_no_leak_after_flush(request.getfixturevalue("plugin"))


def tokens(server, prompt: list[int], rid: str | None = None, options: str | None = None) -> list[int]:
    return client.generate(server, prompt, ANSWER, rid=rid, options=options)["output_ids"]


def test_a_three_turn_chat_decodes_stocks_tokens_and_the_references(plugin, stock, reference):
    full = build_policy(EvictionConfig.for_policy("full"))
    conversation = client.random_prompt(CHUNK + 50, seed=1)  # turn 1 in two chunks
    for turn in range(3):
        answer = tokens(plugin, conversation)
        assert answer == tokens(stock, conversation), f"turn {turn + 1}"
        assert tuple(answer) == reference.generate(conversation, full, max_new_tokens=ANSWER).output_ids
        conversation = conversation + answer + client.random_prompt(30, seed=10 + turn)
    after = client.stats(plugin)
    assert after["compressed_nodes"] >= 1 and after["reuse_hits"] >= 2 and after["chunked_prefills"] >= 1


def test_shared_prefixes_split_compressed_nodes_and_concurrent_requests_decode_stocks_tokens(plugin, stock):
    system = client.random_prompt(100, seed=2)
    first = system + client.random_prompt(90, seed=3)
    assert tokens(plugin, first) == tokens(stock, first)
    # Each diverges inside the first one's node (request scope) or block [96, 144) (block scope): a split.
    others = [system + client.random_prompt(90, seed=4 + index) for index in range(3)]
    others.append(system[:70] + client.random_prompt(110, seed=9))  # inside the split head, in both scopes
    with ThreadPoolExecutor(len(others)) as pool:
        served = list(pool.map(lambda prompt: tokens(plugin, prompt), others))
    assert served == [tokens(stock, prompt) for prompt in others]
    after = client.stats(plugin)
    assert after["shared_node_hits"] >= 1 and after["requests_served_per_node_max"] >= 2
    # The split heads' windows are read again: a second round answers as the first.
    assert [tokens(plugin, prompt) for prompt in others] == served


def test_trimming_local_layers_changes_no_token_of_snapkv(plugin, reference):
    """snapkv on the global layers (its plans equal the reference's: the every-policy test): the server's
    tokens equal the reference's with local layers trimmed and with them kept whole."""
    config = EvictionConfig.for_policy("snapkv", budget=0.3, window=8)
    prompt = client.random_prompt(200, seed=5)
    answer = tokens(plugin, prompt, options=client.request_options(config))
    block_size = BLOCK if plugin.scope == "block" else None
    trimmed = reference.generate(prompt, build_policy(config), max_new_tokens=ANSWER, block_size=block_size)
    reference.local_layers, trimmed_layers = dataclasses.replace(reference.local_layers, trim=False), reference.local_layers
    try:
        kept_whole = reference.generate(prompt, build_policy(config), max_new_tokens=ANSWER, block_size=block_size)
    finally:
        reference.local_layers = trimmed_layers
    for trimmed_plan, whole_plan in zip(trimmed.plans, kept_whole.plans):
        assert trimmed_plan.counts()[:LOCAL].le(WINDOW + (0 if block_size else config.window)).all()
        assert whole_plan.counts()[:LOCAL].eq(whole_plan.segment_length).all()
        assert torch.equal(trimmed_plan.layers[LOCAL].kept_positions, whole_plan.layers[LOCAL].kept_positions)
    assert tuple(answer) == trimmed.output_ids == kept_whole.output_ids


def policy_config(policy: str) -> EvictionConfig:
    """``policy`` at 0.3 where it takes a budget; ``topk`` with KVzip's score (its passes windowed too), since
    no learned weights fit the random model."""
    budget = {"budget": 0.3} if get_policy_class(policy).defaults.takes_budget else {}
    return EvictionConfig.for_policy(policy, **budget, **({"score": "kvzip"} if policy == "topk" else {}))


@pytest.mark.parametrize("policy", sorted(set(registered_policies()) - {"full"}))
def test_every_policy_keeps_the_references_plans_and_decodes_its_tokens(plugin, reference, policy):
    config = policy_config(policy)
    prompt = client.random_prompt(200, seed=7)
    rid = f"{policy}-{plugin.scope}"
    answer = tokens(plugin, prompt, rid=rid, options=client.request_options(config))
    block_size = BLOCK if plugin.scope == "block" else None
    expected = reference.generate(prompt, build_policy(config), max_new_tokens=ANSWER, block_size=block_size)
    dumped = [plugin.dump_dir / f"{rid}.pt"] if block_size is None else [
        plugin.dump_dir / f"{rid}.block{index}.pt" for index in range(len(expected.plans))
    ]  # fmt: skip
    assert len(expected.plans) >= 1 and not list(plugin.dump_dir.glob(f"{rid}.block{len(expected.plans)}.pt"))
    for path, plan in zip(dumped, expected.plans):
        client.assert_same_plan(torch.load(path), plan)
        node = plan.restricted(plan.segment_start, plan.segment_end - (0 if block_size else config.window))
        assert node.counts()[:LOCAL].le(WINDOW).all()
    assert tuple(answer) == expected.output_ids


def test_a_node_holds_its_global_layers_whole_and_its_local_layers_window(plugin):
    length = 4 * BLOCK + 20
    before = client.stats(plugin)
    tokens(plugin, client.random_prompt(length, seed=6))
    after = client.stats(plugin)
    if plugin.scope == "block":  # four full blocks, each holding its last WINDOW positions in local layers
        nodes, per_node = 4, KV_HEADS * (BLOCK * GLOBAL + min(BLOCK, WINDOW) * LOCAL)
        assert after["kept_cells"] - before["kept_cells"] == nodes * per_node
    else:  # one node before the dense observation window, holding the WINDOW positions before its end
        node = length - OBSERVATION_WINDOW
        assert after["kept_cells"] - before["kept_cells"] == KV_HEADS * (node * GLOBAL + min(node, WINDOW) * LOCAL)
    assert after["arena_cells_used"] == after["kept_cells"]


def test_a_request_diverging_just_after_a_node_reads_the_window_before_its_end(plugin, stock):
    """Request scope: the first prompt's node ends where its dense observation window begins (position 128);
    a prompt sharing 130 tokens reuses the node and its first queries read positions 115-127 of it, which
    its local layers keep (block scope: it splits block [96, 144) instead)."""
    first = client.random_prompt(160, seed=60)
    second = first[:130] + client.random_prompt(40, seed=61)
    assert [tokens(plugin, prompt) for prompt in (first, second)] == [tokens(stock, prompt) for prompt in (first, second)]
    if plugin.scope == "request":
        assert client.stats(plugin)["reuse_hits"] >= 1


def test_plain_requests_in_a_batch_with_compressed_ones_keep_their_window(plugin, stock):
    """A plain request (no compressed node on its path) prefilled in the same forward as a compressed one
    runs stock's per-request SDPA, which must still window its local layers: a decode in flight keeps the
    scheduler busy, so the requests sent together are admitted in one prefill batch."""
    conversations = [client.random_prompt(120, seed=20 + index) for index in range(3)]
    answers = [tokens(plugin, conversation) for conversation in conversations]
    later = [c + a + client.random_prompt(20, seed=30 + i) for i, (c, a) in enumerate(zip(conversations, answers))]
    fresh = [client.random_prompt(100, seed=40 + index) for index in range(3)]
    with ThreadPoolExecutor(7) as pool:
        busy = pool.submit(client.generate, plugin, client.random_prompt(60, seed=50), 300)
        served = list(pool.map(lambda prompt: tokens(plugin, prompt), [p for pair in zip(later, fresh) for p in pair]))
        busy.result()
    assert served == [tokens(stock, prompt) for pair in zip(later, fresh) for prompt in pair]
