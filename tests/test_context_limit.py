"""Prompts up to the model's context length, with every score in both scopes: each is served (the segment
compressed, or kept dense where its scoring cannot run) or refused with HTTP 400 and its reason, and
the server stays healthy with an exact ledger.

KVzip's passes run at positions after their segment, so near the context length they get smaller chunks
(``ReconstructionPrompt.chunk_size_before``): a ~3.9K-token prompt of the 4096-position tiny model is
compressed with passes of under 200 tokens, and its plan equals the reference engine's (which chunks
the same way). A segment ending closer than one minimum pass to the limit stays dense
(``reconstructions_skipped``). One request of this kind once brought the scheduler down.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import torch

import engine_client as client
from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.reference.engine import Prompt
from sgl_kvevict.reference.schedule import Mode, Schedule
from sgl_kvevict.scope import DEFAULT_BLOCK_SIZE
from sgl_kvevict.scoring import SCORES
from sgl_kvevict.scoring.kvzip import MIN_CHUNK_TOKENS

pytestmark = pytest.mark.server

SCOPES = ("request", "block")
# The tiny model's context length (``build_tiny_model``'s max_position_embeddings).
CONTEXT_LENGTH = 4096
# Compressed with shrunken KVzip chunks; the longest prompt SGLang accepts (no room for any pass); one more.
SHRUNK_CHUNKS, AT_THE_LIMIT, OVER_THE_LIMIT = 3900, CONTEXT_LENGTH - 7, CONTEXT_LENGTH - 6
MAX_NEW_TOKENS = 4
NEAR_TIE = 0.02


@pytest.fixture(scope="module", params=SCOPES)
def scoped_server(request, tiny_llama_dir, tmp_path_factory):
    dump_dir = tmp_path_factory.mktemp("plans")
    flags = ("--kv-evict-policy", "topk", "--kv-evict-scope", request.param, *client.ANY_REQUEST_OPTIONS,
             "--max-total-tokens", "12000", *client.TINY_SERVER_FLAGS)  # fmt: skip
    log_dir = tmp_path_factory.mktemp(f"limit-{request.param}")
    with client.checked_server(tiny_llama_dir, log_dir, *flags, dump_dir=dump_dir) as running:
        yield running, dump_dir, request.param


def served(server, prompt: list[int], rid: str, options: str) -> dict:
    payload = {"input_ids": prompt, "rid": rid, "extra_key": "kvevict:" + options,
               "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}}  # fmt: skip
    status, body = client.post_status(server, payload)
    assert status == 200, (len(prompt), options, body[:500])
    return json.loads(body)


def dumped_plans(dump_dir, rid: str, expected: bool) -> list[dict]:
    """The plans the server dumped for ``rid`` (``<rid>.pt``, or ``<rid>.block<k>.pt`` in block scope), waited
    for where ``expected`` (KVzip's passes may finish after the reply)."""
    deadline = time.monotonic() + (60 if expected else 0)
    while True:
        paths = sorted(dump_dir.glob(f"{rid}.*pt"))
        if paths or time.monotonic() >= deadline:
            return [torch.load(path) for path in paths]
        time.sleep(0.5)


@pytest.mark.parametrize("score", SCORES)
def test_prompts_up_to_the_context_length_are_served_or_refused(score, scoped_server, learned_weights, tiny_llama_dir):
    server, dump_dir, scope = scoped_server
    num_layers = json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    overrides = {"score": score, **({"learned_weights": learned_weights} if score == "learned" else {})}
    options = client.request_options(EvictionConfig.for_policy("topk", **overrides))
    skipped_before = client.stats(server)["reconstructions_skipped"]
    for length in (SHRUNK_CHUNKS, AT_THE_LIMIT):
        rid = f"{scope}-{score}-{length}"
        reply = served(server, client.random_prompt(length, seed=length), rid, options)
        assert reply["meta_info"]["completion_tokens"] >= 1
        # Every score compresses there (a plan per segment, keeping less than it holds), but for KVzip's
        # request-scope segment at the limit, which has no room for a pass and stays dense.
        stays_dense = score == "kvzip" and scope == "request" and length == AT_THE_LIMIT
        plans = dumped_plans(dump_dir, rid, expected=not stays_dense)
        segments = 0 if stays_dense else 1 if scope == "request" else (length - 1) // DEFAULT_BLOCK_SIZE  # full blocks
        assert len(plans) == segments, (rid, len(plans))
        for plan in plans:
            assert len(plan["layers"]) == num_layers
            kept = sum(len(positions) for positions, _ in plan["layers"])
            heads = len(plan["layers"][0][1]) - 1
            assert 0 < kept < (plan["segment_end"] - plan["segment_start"]) * num_layers * heads, (rid, kept)
    status, body = client.post_status(server, {"input_ids": client.random_prompt(OVER_THE_LIMIT, 1), "sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and "exceeds the maximum allowed length" in body, body[:500]
    skipped = client.stats(server)["reconstructions_skipped"] - skipped_before
    # Request scope: the segment at the limit has no room for a pass. Block scope: blocks end 32 positions
    # or more before the prompt's last token, so every block fits a pass (in shrunken chunks).
    assert skipped == (1 if score == "kvzip" and scope == "request" else 0)
    with urllib.request.urlopen(server.base_url + "/health", timeout=60) as response:
        assert response.status == 200
    client.assert_no_leak_after_flush(server)


@pytest.mark.parametrize("scoped_server", ["request"], indirect=True)
def test_kvzip_near_the_limit_keeps_what_the_reference_keeps(scoped_server, reference, tiny_llama_dir):
    """Request scope: one segment ending ~200 positions before the limit, scored in chunks that fit there;
    the reference engine chunks it the same way and keeps the same entries."""
    server, dump_dir, _ = scoped_server
    config = EvictionConfig.for_policy("topk", score="kvzip")
    prompt = client.random_prompt(SHRUNK_CHUNKS, seed=7)
    rid = "kvzip-near-limit"
    reply = served(server, prompt, rid, client.request_options(config))
    expected = reference.generate(prompt, build_policy(config).for_model(tiny_llama_dir), max_new_tokens=MAX_NEW_TOKENS)
    (plan,) = expected.plans
    assert plan.kept_fraction() < 0.5
    assert CONTEXT_LENGTH - plan.segment_end < 2048 + MIN_CHUNK_TOKENS  # default chunks would not fit
    client.assert_same_plan(torch.load(dump_dir / f"{rid}.pt"), plan)
    # Greedy tokens through the compressed cache: each served token is the reference's best, up to the
    # random model's near ties (top-2 gaps of ~0.01 here), the reference fed the served tokens.
    sequence, logits = reference.prefill(Prompt.from_ids(prompt), build_policy(config).for_model(tiny_llama_dir),
                                         Schedule.for_mode(Mode.QUESTION_AWARE, len(prompt), len(prompt)))  # fmt: skip
    for token in reply["output_ids"]:
        assert logits.max() - logits[token] < NEAR_TIE, (reply["output_ids"], expected.output_ids)
        logits = reference.extend(sequence, [token])
    client.assert_no_leak_after_flush(server)
