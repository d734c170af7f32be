"""Host-synchronising calls per decode forward, through real servers on CPU (``engine.adapter.sync_probe``).

A compressed decode must cost the host no more round trips than stock SGLang's, and none per layer: the
per-forward metadata is built once (``engine.batch``), every layer only indexes it. Measured in the
scheduler process while one request decodes over its compressed prompt, on tiny models of 2 and 6
layers, against a stock server on the 6-layer model.
"""

from __future__ import annotations

import json

import pytest

from engine_client import TINY_SERVER_FLAGS, generate, stats
from serving import running_server
from sgl_kvevict.engine.adapter.sync_probe import PROBE_ENV
from test_engine_memory import prompt

pytestmark = pytest.mark.server

DECODE_STEPS = 48


@pytest.fixture(scope="module")
def six_layer_llama(tmp_path_factory):
    from sgl_kvevict.checkpoints import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("six-layers"), num_layers=6)


def decode_calls_per_forward(model, tmp_path, policy_flags: tuple[str, ...]) -> float:
    """Mean syncing calls per decode forward while one request decodes ``DECODE_STEPS`` tokens."""
    probe = tmp_path / f"probe-{len(list(tmp_path.iterdir()))}.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(PROBE_ENV, str(probe))
        with running_server(model, tmp_path, *policy_flags, "--max-total-tokens", "4096", *TINY_SERVER_FLAGS) as server:
            generate(server, prompt(seed=1, length=8), 1)  # warm-up: an extend only
            before = json.loads(probe.read_text())["decode"]
            response = server.post(
                "/generate",
                {"input_ids": prompt(seed=2), "sampling_params": {"max_new_tokens": DECODE_STEPS, "temperature": 0, "ignore_eos": True}},
            )  # fmt: skip
            assert len(response["output_ids"]) == DECODE_STEPS
            if policy_flags:
                assert stats(server)["compressed_nodes"] == 1  # the decode ran over a compressed prompt
            generate(server, prompt(seed=3, length=8), 1)  # its extend closes the last decode interval
            after = json.loads(probe.read_text())["decode"]
    forwards = after["forwards"] - before["forwards"]
    assert forwards >= DECODE_STEPS - 1
    return (after["calls"] - before["calls"]) / forwards


def test_compressed_decode_syncs_no_more_than_stock_and_none_per_layer(tiny_llama_dir, six_layer_llama, tmp_path):
    lava = ("--kv-evict-policy", "lava", "--kv-evict-budget", "0.25")
    stock = decode_calls_per_forward(six_layer_llama, tmp_path, ())
    lava_six = decode_calls_per_forward(six_layer_llama, tmp_path, lava)
    lava_two = decode_calls_per_forward(tiny_llama_dir, tmp_path, lava)
    print(f"syncing calls per decode forward: stock {stock:.2f}, lava 6 layers {lava_six:.2f}, lava 2 layers {lava_two:.2f}")
    assert lava_six <= stock + 4, (lava_six, stock)
    assert lava_six - lava_two < 1, (lava_six, lava_two)  # four more layers, not one more call
