"""Compression under tensor parallelism on real servers: the tiny fp32 model (2 KV heads) at
``--tp-size 2``, one KV head per rank, every rank a scheduler process of its own exchanging through
SGLang's TP group (``engine.tensor_parallel``).

For the same prompt and policy the ranks together keep exactly the positions the HF reference keeps
with every head on one device (their plan dumps, one per rank, put together), decode the same greedy
tokens, and reserve the same cells on every rank; later chat turns reuse the compressed prefix; every
cell and slot comes back on /flush_cache and SGLang's idle memory check (every rank runs it) never
fires. The tiny model's single-rank runs are held to the same reference by test_engine_parity.py, so
these are the single-rank decisions.
"""

from __future__ import annotations


import psutil
import pytest
import torch

import engine_client as client
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.sharding import PADDING
from test_engine_blocks import BLOCK, reference_run

pytestmark = pytest.mark.server

TP = 2
TP_FLAGS = ("--tp-size", str(TP), "--max-total-tokens", "4096", *client.ANY_REQUEST_OPTIONS, *client.TINY_SERVER_FLAGS)
PROMPT_LENGTHS = (300, 520)
MAX_NEW_TOKENS = 6
POLICIES = ("topk", "lava", "ada-snapkv", "pyramidkv", "snapkv")
# The methods with both score sources, and KVzip's reconstruction passes (forwards of their own,
# run by every rank between batches).
CASES = [(policy, score) for policy in POLICIES for score in ("attn", "learned")] + [("topk", "kvzip")]
# Policies that weigh heads against each other exchange scores; every policy exchanges its kept counts.
EXCHANGES = {"topk": 2, "lava": 2, "ada-snapkv": 2, "pyramidkv": 1, "snapkv": 1}


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tp-plans")


def tp_server(tiny_llama_dir, tmp_path, dump_dir, *flags: str):
    flags = ("--kv-evict-policy", "snapkv", *flags, *TP_FLAGS)
    with client.checked_server(tiny_llama_dir, tmp_path, *flags, dump_dir=dump_dir, idle_check=False) as running:
        yield running


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory, dump_dir):
    for running in tp_server(tiny_llama_dir, tmp_path_factory.mktemp("tp"), dump_dir):
        yield running
        client.assert_strict_idle_check_passed(running)


@pytest.fixture(scope="module")
def block_server(tiny_llama_dir, tmp_path_factory, dump_dir):
    """Block scope; the module's last test kills one of its ranks (a server start saved), so the idle
    check runs in a test of its own before that."""
    yield from tp_server(
        tiny_llama_dir, tmp_path_factory.mktemp("tp-blocks"), dump_dir, "--kv-evict-scope", "block",
        "--kv-evict-block-size", str(BLOCK), "--kv-evict-budget", "0.5",
    )  # fmt: skip


def ranks_plan(dump_dir, name: str, tp: int = TP) -> tuple[dict, list[int]]:
    """The ranks' plan dumps of ``name`` put together in the model's head order (the single-rank dump
    format), and each rank's kept entries."""
    dumps = [torch.load(dump_dir / f"{name}.rank{rank}.pt") for rank in range(tp)]
    heads = {}
    for dump in dumps:
        for local, head in enumerate(dump["heads"]):
            if head != PADDING:
                heads[head] = [positions[indptr[local] : indptr[local + 1]] for positions, indptr in dump["layers"]]
    layers = []
    for layer in range(len(dumps[0]["layers"])):
        per_head = [heads[head][layer] for head in sorted(heads)]
        indptr = torch.tensor([0, *torch.cumsum(torch.tensor([len(p) for p in per_head]), 0).tolist()])
        layers.append((torch.cat(per_head), indptr))
    merged = {"segment_start": dumps[0]["segment_start"], "segment_end": dumps[0]["segment_end"], "layers": layers}
    return merged, [sum(len(positions) for positions, _ in dump["layers"]) for dump in dumps]


def config_of(case, learned_weights: str) -> EvictionConfig:
    policy, score = case
    return EvictionConfig.for_policy(
        policy, score=score, **({"learned_weights": learned_weights} if score == "learned" else {})
    )


@pytest.mark.parametrize("case", CASES, ids=["-".join(case) for case in CASES])
def test_ranks_keep_what_one_device_keeps(case, server, reference, dump_dir, learned_weights, tiny_llama_dir):
    config = config_of(case, learned_weights)
    for index, length in enumerate(PROMPT_LENGTHS):
        prompt = client.random_prompt(length, seed=index)
        rid = f"tp-{'-'.join(case)}-{index}"
        before = client.stats(server)
        response = client.generate(server, prompt, MAX_NEW_TOKENS, rid=rid, options=client.request_options(config))
        expected = reference.generate(prompt, build_policy(config).for_model(tiny_llama_dir), max_new_tokens=MAX_NEW_TOKENS)
        (reference_plan,) = expected.plans
        merged, per_rank = ranks_plan(dump_dir, rid)
        client.assert_same_plan(merged, reference_plan)
        assert tuple(response["output_ids"]) == expected.output_ids

        during = client.stats(server)
        window = config.window
        compressed = [  # each rank's entries before the dense window: what its node holds
            sum(int((positions < reference_plan.segment_end - window).sum()) for positions, _ in dump["layers"])
            for dump in (torch.load(dump_dir / f"{rid}.rank{rank}.pt") for rank in range(TP))
        ]
        assert during["tp_size"] == TP and during["compressed_nodes"] == 1
        assert during["kept_entries"] == sum(compressed)
        assert during["kept_cells"] == during["arena_cells_used"] == max(compressed)  # every rank reserves alike
        assert during["tp_exchanges"] - before["tp_exchanges"] == EXCHANGES[case[0]]
        assert sum(per_rank) == reference_plan.total_kept()
        client.assert_no_leak_after_flush(server)


def test_later_turns_reuse_the_compressed_prefix_on_every_rank(server, learned_weights):
    options = client.request_options(config_of(("lava", "learned"), learned_weights))
    conversation = client.random_prompt(400, seed=7)
    for turn in range(3):
        before = client.stats(server)
        response = client.generate(server, conversation, MAX_NEW_TOKENS, rid=f"turn-{turn}", options=options)
        after = client.stats(server)
        if turn:  # the previous turn's compressed prefix, on both ranks (a mismatch would hang the TP group)
            assert after["reuse_hits"] == before["reuse_hits"] + 1
            assert response["meta_info"]["cached_tokens"] >= 400
        conversation = conversation + list(response["output_ids"]) + client.random_prompt(20, seed=10 + turn)
    assert client.stats(server)["requests_compressed"] >= 1
    client.assert_no_leak_after_flush(server)


BLOCK_CASES = [case for case in CASES if case[1] != "kvzip"]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=["-".join(case) for case in BLOCK_CASES])
def test_block_scope_ranks_keep_what_one_device_keeps(case, block_server, reference, dump_dir, learned_weights, tiny_llama_dir):
    config = EvictionConfig.for_policy(case[0], score=case[1], budget="0.5",
                                       **({"learned_weights": learned_weights} if case[1] == "learned" else {}))  # fmt: skip
    prompt = client.random_prompt(3 * BLOCK + 35, seed=3)
    rid = f"tp-block-{'-'.join(case)}"
    response = client.generate(block_server, prompt, MAX_NEW_TOKENS, rid=rid, options=client.request_options(config))
    expected = reference_run(reference, prompt, len(prompt), (len(prompt), (0, 1, 2)), config=config)
    for block, plan in enumerate(expected.plans):
        client.assert_same_plan(ranks_plan(dump_dir, f"{rid}.block{block}")[0], plan)
    assert tuple(response["output_ids"]) == expected.output_ids
    assert client.stats(block_server)["compressed_nodes"] == 3
    client.assert_no_leak_after_flush(block_server)


def test_every_rank_of_the_block_server_kept_its_ledger(block_server):
    client.assert_strict_idle_check_passed(block_server)


def test_a_killed_rank_ends_the_server_with_a_clear_error_and_no_process_left(block_server):
    descendants = psutil.Process(block_server.process.pid).children(recursive=True)
    (rank_one,) = [process for process in descendants if "scheduler_TP1" in " ".join(process.cmdline())]
    rank_one.kill()
    code = block_server.process.wait(timeout=120)
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert code != 0 and alive == []
    log = block_server.log()
    assert "Scheduler hit an exception" in log  # rank 0's TP group saw its peer go
    assert "[sgl-kvevict] SGLang exited with code -9 (killed by signal 9: SGLang ends all its processes" in log
