"""The bundled Gemma 3 270M (base, trained weights) served by the real launcher: `full` decodes stock's
greedy tokens (fp32) and holds its local layers to their window.

One completion prompt of real text: a pass key in about 900 tokens of the task filler
(``sgl_kvevict.measure.tasks``), sent as text so that each server's own tokenizer adds the BOS Gemma
needs. Stock (``--kv-evict-policy none``) and the plugin with ``full`` (request scope) answer it; the
tokens must be equal and find the pass key, which sits outside the last 512 positions the local layers
keep. The compressed node holds exactly its segment in the 3 global layers and its last 512 positions
in the 15 local ones (1 KV head), and after a flush every cell and slot is back (``checked_server``
also checks SGLang's idle memory check never fired). The conversion is the session's cached folder
(``gemma3_dir``), outside the servers' start-ups, which overlap (about 35 s each on 2 cores).
"""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

import engine_client as client
from sgl_kvevict.measure.tasks import make_task

pytestmark = [pytest.mark.server, pytest.mark.gemma3]

CONTEXT_TOKENS = 900
ANSWER_TOKENS = 12
OBSERVATION_WINDOW = 32  # full's default window: request scope leaves the prompt's last 32 tokens dense
FLAGS = ("--max-total-tokens", "4096", *client.GEMMA3_SERVER_FLAGS)


@pytest.fixture(scope="module")
def prompt(gemma3_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(gemma3_dir / "tokenizer.json"))
    count_tokens = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)  # noqa: E731
    task = make_task("passkey", 0, CONTEXT_TOKENS, 0.3, count_tokens)
    text = f"{task.context}\n\n{task.question}\n{task.answer_prefix}"
    return task, text, tokenizer.encode(text).ids


@contextlib.contextmanager
def started_together(*servers):
    """Enter the servers' context managers at once, so that their start-ups overlap; every one that
    started is stopped, whatever happens."""
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(len(servers)) as pool:
            futures = [pool.submit(server.__enter__) for server in servers]
            wait(futures)
        for server, future in zip(servers, futures):
            if future.exception() is None:
                stack.push(server.__exit__)
        yield [future.result() for future in futures]


def completion(server, text: str) -> dict:
    return server.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": ANSWER_TOKENS, "temperature": 0}})


def test_full_decodes_stocks_tokens_with_local_layers_kept_to_their_window(gemma3_dir, prompt, tmp_path_factory):
    task, text, ids = prompt
    config = json.loads((gemma3_dir / "config.json").read_text())
    local = config["layer_types"].count("sliding_attention")
    global_ = config["num_hidden_layers"] - local
    window, kv_heads = config["sliding_window"], config["num_key_value_heads"]
    assert ids[0] == config["bos_token_id"] and len(ids) > window + OBSERVATION_WINDOW

    servers = [
        client.checked_server("gemma3-270m", tmp_path_factory.mktemp(policy), "--kv-evict-policy", policy, *FLAGS)
        for policy in ("none", "full")
    ]
    with started_together(*servers) as (stock, plugin), ThreadPoolExecutor(2) as pool:
        before = client.stats(plugin)
        expected, served = pool.map(lambda server: completion(server, text), (stock, plugin))
        after = client.stats(plugin)
        client.assert_no_leak_after_flush(plugin)

    assert served["output_ids"] == expected["output_ids"], (served["text"], expected["text"])
    assert task.is_correct(served["text"]), (task.answer, served["text"])
    assert served["meta_info"]["prompt_tokens"] == expected["meta_info"]["prompt_tokens"] == len(ids)  # BOS once
    node = len(ids) - OBSERVATION_WINDOW
    assert after["compressed_nodes"] - before["compressed_nodes"] == 1
    assert after["compressed_tokens"] - before["compressed_tokens"] == node
    assert after["kept_cells"] - before["kept_cells"] == kv_heads * (node * global_ + min(node, window) * local)
    assert after["arena_cells_used"] == after["kept_cells"]
