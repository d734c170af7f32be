"""With SGLang's --enable-metrics, /metrics carries the kvevict_* series beside SGLang's own, with
SGLang's radix-cache labels, and they count a compressed request."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from engine_client import TINY_SERVER_FLAGS, generate
from serving import running_server

from sgl_kvevict.engine.metrics import COUNTERS, GAUGES

pytestmark = pytest.mark.server

SERVER_FLAGS = (
    "--kv-evict-policy", "snapkv", "--kv-evict-budget", "0.25", "--max-total-tokens", "4096",
    "--enable-metrics", *TINY_SERVER_FLAGS,
)  # fmt: skip
PROMPT_LENGTH = 300


def scrape(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/metrics", timeout=60) as response:
        return response.read().decode()


def sample(text: str, name: str) -> float:
    """The value of the one ``name`` series (any labels)."""
    (value,) = re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, flags=re.MULTILINE)
    return float(value)


def test_metrics_export_the_compression_counters(tiny_llama_dir, tmp_path):
    with running_server(tiny_llama_dir, tmp_path, *SERVER_FLAGS) as server:
        assert "sglang:" in scrape(server.base_url)  # SGLang's own series are served as before
        generate(server, [5] + [40 + i % 200 for i in range(PROMPT_LENGTH - 1)], max_new_tokens=4)
        deadline = time.monotonic() + 30  # the exporter copies the stats once a second
        while True:
            text = scrape(server.base_url)
            if "kvevict_requests_compressed_total" in text and sample(text, "kvevict_requests_compressed_total") >= 1:
                break
            assert time.monotonic() < deadline, "kvevict_requests_compressed_total never counted the request:\n" + text
            time.sleep(1)
    for field in GAUGES:
        assert re.search(rf'^kvevict_{field}\{{.*cache_type="CompressedRadixCache".*\}} ', text, re.MULTILINE), field
    for field in COUNTERS:
        assert f"kvevict_{field}_total{{" in text, field
    assert sample(text, "kvevict_compressed_nodes") == 1
    assert 0 < sample(text, "kvevict_kept_cells") == sample(text, "kvevict_arena_cells_used")
    cells_per_slot = 4  # the tiny model: 2 layers x 2 KV heads
    borrowed = sample(text, "kvevict_arena_slots_borrowed")
    assert sample(text, "kvevict_arena_cells_used") + sample(text, "kvevict_arena_cells_free") == borrowed * cells_per_slot
