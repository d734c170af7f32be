"""Greedy tokens of a changing batch through the plugin's batched decode equal stock SGLang's (fp32, SmolLM2).

A decode batch with one compressed request goes wholly through the plugin's batched decode
(``KVEvictTorchBackend._decode_attention``: every request's keys in one pass per layer), its plain
requests included. Here one *anchor* request with a compressed prompt (snapkv, 25%) streams for the
whole run while eight requests with nothing evicted (``policy=full``, dense) join at staggered times and
leave after different lengths, a ninth is aborted mid-decode, and SGLang's test hook retracts a request
every few steps (``SGLANG_TEST_RETRACT``: it re-enters through a new prefill, in another request-pool
row). Stock SGLang serves the same requests in the same way; every one of the eight must produce stock's
greedy tokens over its 64 to 92 steps. Nothing may leak on either server.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import engine_client as client

pytestmark = [pytest.mark.server, pytest.mark.smollm2]

TOPICS = ("lighthouses", "bread", "comets", "bees", "glaciers", "violins", "deserts", "chess")
COMPARED = [  # (rid, prompt, new tokens, seconds after the anchor starts)
    (f"compared-{index}", f"Write a short essay about {topic}. Mention where they are found and why they matter.",
     64 + 4 * index, 0.6 * index)
    for index, topic in enumerate(TOPICS)
]  # fmt: skip
ANCHOR_PROMPT = " ".join(f"Note {index}: the {topic} section of the archive is on shelf {index * 7}." for index, topic in enumerate(TOPICS * 6))
ABORTED_AFTER_CHUNKS = 6
RETRACT_EVERY_STEPS = 10
SERVERS = {
    "stock": ("--kv-evict-policy", "none"),
    "plugin": ("--kv-evict-policy", "snapkv", "--kv-evict-default", "budget=0.25", "--kv-evict-scope", "request",
               *client.ANY_REQUEST_OPTIONS),
}  # fmt: skip
COMMON_FLAGS = ("--max-total-tokens", "8192", *client.TINY_SERVER_FLAGS)


def greedy(prompt: str, max_new_tokens: int, rid: str, options: str | None = None) -> dict:
    payload = {"text": prompt, "rid": rid, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    if options is not None:
        payload["extra_key"] = client.REQUEST_OPTIONS_PREFIX + options
    return payload


def serve_batch(server, options: str | None) -> dict[str, list[int]]:
    """The scenario on ``server``: the compared requests' output ids by rid (``options``: theirs)."""

    def compared(rid, prompt, new_tokens, delay):
        time.sleep(delay)
        return rid, server.post("/generate", greedy(prompt, new_tokens, rid, options))["output_ids"]

    with ThreadPoolExecutor(len(COMPARED) + 2) as pool:
        anchor = pool.submit(client.stream, server, greedy(ANCHOR_PROMPT, 2000, "anchor"), None)
        time.sleep(1.0)  # the anchor decodes before the others join
        aborted = pool.submit(client.stream, server, greedy(COMPARED[0][1] + " Be brief.", 500, "aborted", options), ABORTED_AFTER_CHUNKS)
        outputs = dict(future.result() for future in [pool.submit(compared, *request) for request in COMPARED])
        assert ABORTED_AFTER_CHUNKS <= aborted.result() < 500
        assert not anchor.done(), "the anchor must outlast every compared request"
        client.abort(server, "anchor")
        anchor.result()
    return outputs


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, tuple[dict, str, dict]]:
    """Per server: the compared outputs, its log, and its stats before the flush."""
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SGLANG_TEST_RETRACT", "1")
        patch.setenv("SGLANG_TEST_RETRACT_INTERVAL", str(RETRACT_EVERY_STEPS))
        for name, flags in SERVERS.items():
            log_dir = tmp_path_factory.mktemp(f"batch-tokens-{name}")
            with client.checked_server("smollm2", log_dir, *flags, *COMMON_FLAGS) as server:
                outputs = serve_batch(server, "policy=full" if name == "plugin" else None)
                stats = client.stats(server) if name == "plugin" else {}
                if name == "plugin":
                    client.assert_no_leak_after_flush(server)
                results[name] = (outputs, server.log(), stats)
    return results


def test_every_request_of_a_changing_batch_decodes_stock_tokens(served):
    stock, plugin = served["stock"][0], served["plugin"][0]
    for rid, _, new_tokens, _ in COMPARED:
        assert len(stock[rid]) == len(plugin[rid]) == new_tokens
        first = next((step for step, (a, b) in enumerate(zip(stock[rid], plugin[rid])) if a != b), None)
        assert first is None, f"{rid}: first different token at step {first}: stock {stock[rid][first:first + 5]}, plugin {plugin[rid][first:first + 5]}"


def test_the_batch_went_through_compression_retraction_and_abort(served):
    for name in SERVERS:
        log = served[name][1]
        assert "Testing retraction" in log, name  # SGLang retracted running requests on both servers
    stats = served["plugin"][2]
    # The anchor's prompt was compressed (so every decode batch it was in ran the plugin's batched decode);
    # the compared requests kept everything (policy=full: no compressed node of theirs).
    assert stats["requests_compressed"] >= 1 and stats["compressed_nodes_created"] >= 1, stats
