"""The bundled Gemma 3 270M (base, real weights) in block scope: admission counts the local layers' trim,
and a policy's budget is the global layers' share.

One server, ``full`` in 1024-token blocks, pool 4000 slots (fp32). Stock SGLang accepts prompts up to the
pool less a few tokens (3,994 here); with the trim a block holds its 3 global layers whole and the last
512 positions of its 15 local ones, about 0.58 of its KV, so the plugin raises SGLang's length limit by
the trim and serves a 4,600-token prompt, and a flush gives every slot back. On the same server, requests
naming snapkv and topk at 0.25 (``--kv-evict-per-request``) keep a quarter of each global layer's block,
and their local layers keep their window (the plans the server dumps, and the kept shares ``/kvevict/stats``
reports per layer and of global layers).
"""

from __future__ import annotations

import json

import pytest
import torch

import engine_client as client
from sgl_kvevict.measure.tasks import make_task

pytestmark = [pytest.mark.server, pytest.mark.gemma3]

POOL = 4000
BLOCK = 1024
FLAGS = ("--kv-evict-policy", "full", "--kv-evict-scope", "block", "--kv-evict-block-size", str(BLOCK),
         "--chunked-prefill-size", "512", *client.ANY_REQUEST_OPTIONS, "--max-total-tokens", str(POOL),
         *client.GEMMA3_SERVER_FLAGS)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(gemma3_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(gemma3_dir / "tokenizer.json"))


def prompt_ids(tokenizer, tokens: int, seed: int) -> list[int]:
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)  # noqa: E731
    task = make_task("passkey", seed, tokens, 0.5, count)
    return tokenizer.encode(f"{task.context}\n\n{task.question}\n{task.answer_prefix}").ids


def test_full_in_block_scope_serves_a_prompt_longer_than_the_pool_and_policies_spend_on_global_layers(
    gemma3_dir, tokenizer, tmp_path_factory
):
    config = json.loads((gemma3_dir / "config.json").read_text())
    local = [index for index, kind in enumerate(config["layer_types"]) if kind == "sliding_attention"]
    window = config["sliding_window"]
    long_prompt = prompt_ids(tokenizer, 4600, seed=0)
    assert len(long_prompt) > POOL
    dump_dir = tmp_path_factory.mktemp("plans")
    with client.checked_server("gemma3-270m", tmp_path_factory.mktemp("full-block"), *FLAGS, dump_dir=dump_dir) as server:
        served = client.generate(server, long_prompt, max_new_tokens=4, rid="long")
        assert served["meta_info"]["finish_reason"]["type"] != "abort", served["meta_info"]
        assert served["meta_info"]["prompt_tokens"] == len(long_prompt)
        blocks = len(long_prompt) // BLOCK
        stats = client.stats(server)
        assert stats["compressed_tokens"] == blocks * BLOCK  # every block stored trimmed
        # /kvevict/stats: global layers whole, local layers their window (half of each block)
        assert stats["kept_share_global_layers"] == 1.0
        assert [stats["kept_share_by_layer"][layer] for layer in local] == [window / BLOCK] * len(local)
        assert stats["kept_share_all_layers"] == round((len(config["layer_types"]) - len(local) * (1 - window / BLOCK)) / len(config["layer_types"]), 4)
        client.assert_no_leak_after_flush(server)
        for policy in ("snapkv", "topk"):
            options = f"policy={policy},budget=0.25" + (",score=attn" if policy == "topk" else "")
            client.generate(server, prompt_ids(tokenizer, 1100, seed=1), max_new_tokens=1, rid=policy, options=options)
            assert client.stats(server)["kept_share_global_layers"] == 0.25, policy  # the budget, of global layers
        client.assert_no_leak_after_flush(server)
    for policy in ("snapkv", "topk"):
        plan = torch.load(dump_dir / f"{policy}.block0.pt")
        counts = [int(indptr[-1]) for _, indptr in plan["layers"]]
        kv_heads = len(plan["layers"][0][1]) - 1
        assert all(counts[layer] == window * kv_heads for layer in local), (policy, counts)
        assert sum(counts[layer] for layer in range(len(counts)) if layer not in local) == (
            (len(counts) - len(local)) * kv_heads * BLOCK // 4
        ), (policy, counts)
