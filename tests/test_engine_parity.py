"""Parity of the SGLang engine with the HF reference engine, every policy on one real server (tiny fp32 model).

The server runs with ``--kv-evict-per-request``: each case's requests name their policy in SGLang's
``extra_key`` field, so one server start serves every policy (each policy's nodes live in their own
subtree). For the same prompt and policy the server keeps exactly the positions the reference keeps
per (layer, KV head) (read from the server's plan dumps), decodes the same greedy tokens over its
compressed + dense attention, holds exactly the planned cells within the budget, and gives every cell
and slot back on /flush_cache.
"""

from __future__ import annotations


import pytest
import torch

import engine_client as client
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.policies import registered_policies

pytestmark = pytest.mark.server

PROMPT_LENGTHS = (300, 520)
MAX_NEW_TOKENS = 6


def compressed_cells(plan, window: int) -> int:
    """Arena cells the plan stores: its kept entries before the dense window."""
    return sum(int((layer.kept_positions < plan.segment_end - window).sum()) for layer in plan.layers)


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("plans")


# Every registered policy at its defaults, and the question-agnostic scores with the allocators that take
# them: KVzip's reconstruction passes and the learned scorer run inside the server.
CASES = [(policy, ()) for policy in registered_policies()] + [
    (policy, (("score", score),)) for score in ("kvzip", "learned") for policy in ("topk", "ada-snapkv", "lava")
]


def case_id(case) -> str:
    policy, overrides = case
    return "-".join([policy, *(value for _, value in overrides)])


def parity_server(tiny_llama_dir, tmp_path, dump_dir, *schedule_flags: str):
    flags = ("--kv-evict-policy", "snapkv", *client.ANY_REQUEST_OPTIONS, "--max-total-tokens", "4096", *client.TINY_SERVER_FLAGS)
    with client.checked_server(tiny_llama_dir, tmp_path, *flags, *schedule_flags, dump_dir=dump_dir) as running:
        yield running


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory, dump_dir):
    """SGLang's default overlap schedule (the launcher's, on CPU too)."""
    yield from parity_server(tiny_llama_dir, tmp_path_factory.mktemp("parity"), dump_dir)


@pytest.fixture(scope="module")
def serial_server(tiny_llama_dir, tmp_path_factory, dump_dir):
    yield from parity_server(tiny_llama_dir, tmp_path_factory.mktemp("serial"), dump_dir, "--disable-overlap-schedule")


def check_keeps_what_the_reference_keeps(server, case, reference, dump_dir, learned_weights, tiny_llama_dir, rid_prefix=""):
    """Every prompt of ``PROMPT_LENGTHS`` under ``case``: the server's plan, tokens, cells and ledger
    against the reference's; returns the overlap waits the server counted."""
    policy, overrides = case
    overrides = dict(overrides, **({"learned_weights": learned_weights} if ("score", "learned") in case[1] else {}))
    config = EvictionConfig.for_policy(policy, **overrides)
    waits = 0
    for index, length in enumerate(PROMPT_LENGTHS):
        prompt = client.random_prompt(length, seed=index)
        rid = f"{rid_prefix}{case_id(case)}-{index}"
        waits_before = client.stats(server)["overlap_waits"]
        response = client.generate(server, prompt, MAX_NEW_TOKENS, rid=rid, options=client.request_options(config))
        expected = reference.generate(prompt, build_policy(config).for_model(tiny_llama_dir), max_new_tokens=MAX_NEW_TOKENS)
        (reference_plan,) = expected.plans

        client.assert_same_plan(torch.load(dump_dir / f"{rid}.pt"), reference_plan)
        assert tuple(response["output_ids"]) == expected.output_ids

        during = client.stats(server)
        waits += during["overlap_waits"] - waits_before
        evicted = reference_plan.total_kept() < length * reference.num_layers * reference.num_kv_heads
        assert during["compressed_nodes"] == int(evicted)
        assert during["arena_cells_used"] == during["kept_cells"]
        assert during["kept_cells"] == (compressed_cells(reference_plan, config.window) if evicted else 0)
        if config.budget is not None:
            per_head = max(config.budget.per_head(length), config.window)
            assert reference_plan.total_kept() <= per_head * reference.num_layers * reference.num_kv_heads
        client.assert_no_leak_after_flush(server)
    return waits


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_server_keeps_what_the_reference_keeps(case, server, reference, dump_dir, learned_weights, tiny_llama_dir):
    waits = check_keeps_what_the_reference_keeps(server, case, reference, dump_dir, learned_weights, tiny_llama_dir)
    # Under the overlap schedule the batch after each compressing prefill is formed after its checkpoint
    # (one per prompt); KVzip's passes run between batches, each piece after such a wait.
    kvzip = EvictionConfig.for_policy(case[0], **dict(case[1])).score == "kvzip"
    assert waits >= len(PROMPT_LENGTHS) if kvzip else waits == len(PROMPT_LENGTHS), waits


SERIAL_CASES = [("snapkv", ()), ("topk", (("score", "learned"),)), ("lava", (("score", "kvzip"),))]


@pytest.mark.parametrize("case", SERIAL_CASES, ids=case_id)
def test_the_serial_schedule_keeps_what_the_reference_keeps(case, serial_server, reference, dump_dir, learned_weights, tiny_llama_dir):
    waits = check_keeps_what_the_reference_keeps(serial_server, case, reference, dump_dir, learned_weights, tiny_llama_dir, "serial-")
    assert waits == 0  # nothing overlaps, so nothing waits
