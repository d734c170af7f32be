"""Gemma 3's local layers under tensor parallelism on real servers: the tiny fp32 Gemma 3 of
``test_engine_local_layers`` (three local layers with a 16-token window, a global one, 2 KV heads) at
``--tp-size 2``, one KV head per rank, in request and block scope (48-token blocks).

``full`` trims every rank's local layers to their window, losslessly: over a 3-turn chat whose answers
outrun the window, and over prompts sharing a prefix that split compressed nodes (each rank's split head
gains the window before the divergence and keeps the cells the other rank reserves), the ranks decode the
HF reference's greedy tokens with every head on one device. snapkv per request: the ranks' plans put
together are the reference's, and so are the tokens. A flush gives every cell and slot back on every rank.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import engine_client as client
from sgl_kvevict.config import EvictionConfig, build_policy
from test_engine_local_layers import ANSWER, BLOCK, SCOPES, WINDOW, gemma_dir, reference  # noqa: F401 (fixtures)
from test_engine_tensor_parallel import ranks_plan

pytestmark = pytest.mark.server

TP = 2
FLAGS = ("--kv-evict-policy", "full", "--tp-size", str(TP), *client.ANY_REQUEST_OPTIONS, "--max-total-tokens", "4096",
         *client.TINY_SERVER_FLAGS)  # fmt: skip


@pytest.fixture(scope="module", params=sorted(SCOPES))
def plugin(request, gemma_dir, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    dump_dir = tmp_path_factory.mktemp(f"tp-plans-{request.param}")
    log_dir = tmp_path_factory.mktemp(f"tp-{request.param}")
    with client.checked_server(gemma_dir, log_dir, *FLAGS, *SCOPES[request.param], dump_dir=dump_dir) as server:
        server.scope, server.dump_dir = request.param, dump_dir
        yield server


def tokens(server, prompt: list[int], rid: str | None = None, options: str | None = None) -> list[int]:
    return client.generate(server, prompt, ANSWER, rid=rid, options=options)["output_ids"]


def test_full_decodes_the_references_tokens_over_a_chat_and_split_shared_prefixes(plugin, reference):  # noqa: F811
    full = build_policy(EvictionConfig.for_policy("full"))
    dense = lambda prompt: list(reference.generate(prompt, full, max_new_tokens=ANSWER).output_ids)  # noqa: E731
    conversation = client.random_prompt(200, seed=1)
    for turn in range(3):
        answer = tokens(plugin, conversation)
        assert answer == dense(conversation), f"turn {turn + 1}"
        conversation = conversation + answer + client.random_prompt(30, seed=10 + turn)
    system = client.random_prompt(100, seed=2)
    first = system + client.random_prompt(90, seed=3)
    assert tokens(plugin, first) == dense(first)
    others = [system + client.random_prompt(90, seed=4 + index) for index in range(2)]
    others.append(system[:70] + client.random_prompt(110, seed=9))  # inside the split head
    with ThreadPoolExecutor(len(others)) as pool:
        served = list(pool.map(lambda prompt: tokens(plugin, prompt), others))
    assert served == [dense(prompt) for prompt in others]
    assert [tokens(plugin, prompt) for prompt in others] == served  # the split heads' windows read again
    stats = client.stats(plugin)
    assert stats["tp_size"] == TP and stats["shared_node_hits"] >= 1 and stats["compressed_nodes"] >= 1
    client.assert_no_leak_after_flush(plugin)


def test_snapkv_keeps_the_references_positions_and_tokens_on_two_ranks(plugin, reference):  # noqa: F811
    config = EvictionConfig.for_policy("snapkv", budget=0.3, window=8)
    prompt = client.random_prompt(200, seed=5)
    rid = f"snapkv-tp-{plugin.scope}"
    answer = tokens(plugin, prompt, rid=rid, options=client.request_options(config))
    block_size = BLOCK if plugin.scope == "block" else None
    expected = reference.generate(prompt, build_policy(config), max_new_tokens=ANSWER, block_size=block_size)
    names = [rid] if block_size is None else [f"{rid}.block{index}" for index in range(len(expected.plans))]
    for name, plan in zip(names, expected.plans):
        merged, _ = ranks_plan(plugin.dump_dir, name)
        client.assert_same_plan(merged, plan)
        assert plan.counts()[:3].le(WINDOW + (0 if block_size else config.window)).all()
    assert tuple(answer) == expected.output_ids
    client.assert_no_leak_after_flush(plugin)
