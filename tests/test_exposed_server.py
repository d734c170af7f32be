"""One worker exposed as an operator would: ``--api-key`` and ``--admin-api-key``, clients choosing their
own eviction options (default allow-list), SGLang's metrics on. One real server (tiny model, snapkv)
serves every test: each route's key, refusals the client reads, 10,000 distinct option strings at
flat scheduler memory, a client that disconnects mid-stream, and last, because it stops the server,
SIGTERM draining the request in flight."""

from __future__ import annotations

import http.client
import json
import re
import signal
import threading
import time
import urllib.parse
import urllib.request

import psutil
import pytest

from engine_client import (
    TINY_SERVER_FLAGS,
    assert_no_leak_after_flush,
    assert_strict_idle_check_passed,
    stats,
    status_of,
)
from serving import RunningServer, running_server
from sgl_kvevict.request_options import REQUEST_OPTIONS_PREFIX, SETUP_CACHE_SIZE
from sgl_kvevict.server.processes import SHUTDOWN_GRACE_SECONDS

pytestmark = pytest.mark.server

API_KEY = "test-api-key"
ADMIN_KEY = "test-admin-key"
SERVER_FLAGS = (
    "--kv-evict-policy", "snapkv", "--kv-evict-per-request", "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY,
    "--enable-metrics", "--max-total-tokens", "3000", *TINY_SERVER_FLAGS,
)  # fmt: skip
CHAT = {"model": "default", "messages": [{"role": "user", "content": "a short question"}], "max_tokens": 2}
GENERATE = {"input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 2}}
# Who may call a route: any client, the API key, or the admin key (SGLang's rule with both keys set).
OPEN, API, ADMIN = "open", "api", "admin"
ROUTES = [
    ("POST", "/v1/chat/completions", CHAT, API),
    ("POST", "/generate", GENERATE, API),
    ("GET", "/v1/models", None, API),
    ("GET", "/kvevict/stats", None, API),
    ("POST", "/flush_cache", None, ADMIN),
    ("GET", "/health", None, OPEN),
    ("GET", "/metrics", None, OPEN),
]
KEYS = {None: OPEN, "wrong-key": OPEN, API_KEY: API, ADMIN_KEY: ADMIN}
OPTION_STRINGS = 10_000
BATCH = 1000
# The scheduler's RSS may move this much while it serves the last 6,000 requests, after a warm-up of
# 4,000 (allocator slack, SGLang's per-request bookkeeping; measured: +4 MiB over the first 3,000, then
# flat); every setup kept would add about 1 KB, 6 MiB over those requests.
WARM_BATCHES = 4
RSS_SLACK_BYTES = 4 * 2**20


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("exposed"), *SERVER_FLAGS) as running:
        yield running


def test_every_route_answers_401_without_its_key_and_serves_with_it(server):
    for method, path, payload, level in ROUTES:
        for key, holder in KEYS.items():
            allowed = level == OPEN or level == holder
            code = status_of(server.base_url + path, method, key, payload)
            assert code == (200 if allowed else 401), (method, path, key, code)


def test_a_refused_option_string_is_answered_400_with_its_reason_before_the_scheduler(server):
    before = stats(server)
    refused = REQUEST_OPTIONS_PREFIX + "policy=topk"  # topk ranks by KVzip's extra pass unless told otherwise
    for path, payload in (("/v1/chat/completions", CHAT), ("/generate", GENERATE)):
        for stream in (False, True):
            reply = _post(server, path, {**payload, "stream": stream, "extra_key": refused})
            assert reply.status == 400, (path, stream, reply.status)
            body = json.loads(reply.read())
            reason = body["message"] if "message" in body else body["error"]
            assert "score kvzip (policy topk) is not among the values a request may choose" in reason, body
            assert "\n" not in reason
    # An accepted choice is served with its own setup; a client's own extra_key is not ours to judge.
    for extra_key in (REQUEST_OPTIONS_PREFIX + "policy=lava,budget=0.5", "tenant-7"):
        assert _post(server, "/generate", {**GENERATE, "extra_key": extra_key}).status == 200
    after = stats(server)
    assert after["request_option_errors"] == before["request_option_errors"]  # never reached the scheduler
    assert after["request_setups_built"] == before["request_setups_built"] + 1


def test_ten_thousand_distinct_option_strings_keep_the_scheduler_memory_flat(server):
    """A client varying one digit per request: the scheduler builds a setup per string, keeps the last
    ``SETUP_CACHE_SIZE``, and its resident memory stays flat once the pool and caches are warm."""
    scheduler = _scheduler(server)
    before = stats(server)
    rss = []
    for start in range(0, OPTION_STRINGS, BATCH):
        # Distinct budgets inside the default allow-list's [0.05, 0.95].
        keys = [f"{REQUEST_OPTIONS_PREFIX}policy=snapkv,budget=0.5{index:05d}" for index in range(start, start + BATCH)]
        prompts = [[5 + index % 50, 17, 33, 48, 60, 71, 82, 93] for index in range(start, start + BATCH)]
        batch = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 1}, "extra_key": keys}
        assert len(server.post("/generate", batch, timeout=600)) == BATCH
        rss.append(scheduler.memory_info().rss)
    after = stats(server)
    assert after["request_setups_built"] - before["request_setups_built"] == OPTION_STRINGS
    assert after["request_setups_cached"] == SETUP_CACHE_SIZE
    assert after["request_option_errors"] == before["request_option_errors"]
    warm = WARM_BATCHES - 1
    growth = rss[-1] - rss[warm]
    print(f"scheduler RSS: {rss[warm] / 2**20:.1f} MiB after {(warm + 1) * BATCH} strings, {rss[-1] / 2**20:.1f} MiB after {OPTION_STRINGS}")
    assert growth < RSS_SLACK_BYTES, [f"{value / 2**20:.1f} MiB" for value in rss]
    assert_no_leak_after_flush(server)


def test_a_client_that_disconnects_mid_stream_frees_its_slots_and_cells(server):
    aborted = _aborted_requests(server)
    prompt = [7] + [40 + (index * 37) % 200 for index in range(299)]  # compressed: 300 tokens, window 32
    payload = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    url = urllib.parse.urlsplit(server.base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    connection.request("POST", "/generate", json.dumps(payload), headers=server.headers())
    response = connection.getresponse()
    chunks = 0
    while chunks < 3:
        if response.readline().startswith(b"data:"):
            chunks += 1
    connection.close()  # mid-stream: the request has 2,000 tokens to go
    # SGLang aborts a streamed request whose client left (its abort task waits 2 s).
    deadline = time.monotonic() + 60
    while _aborted_requests(server) == aborted and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _aborted_requests(server) == aborted + 1
    assert stats(server)["requests_compressed"] > 0
    assert_no_leak_after_flush(server)
    assert_strict_idle_check_passed(server)


def test_sigterm_drains_the_request_in_flight_and_exits_0_within_the_grace_period(server):
    """Last: it stops the module's server."""
    processes = psutil.Process(server.process.pid).children(recursive=True)
    outcome: dict = {}
    first_token = threading.Event()

    def stream():
        payload = {**CHAT, "max_tokens": 64, "stream": True, "ignore_eos": True, "temperature": 0}
        reply = _post(server, "/v1/chat/completions", payload)
        finish = None
        for line in reply:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                first_token.set()
                finish = json.loads(line[5:])["choices"][0]["finish_reason"] or finish
        outcome["finish_reason"] = finish

    client = threading.Thread(target=stream)
    client.start()
    assert first_token.wait(120)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(timeout=SHUTDOWN_GRACE_SECONDS + 30)
    stopped_after = time.monotonic() - started
    client.join(timeout=60)
    assert outcome.get("finish_reason") == "length", outcome  # every token of the request in flight came
    assert code == 0 and stopped_after < SHUTDOWN_GRACE_SECONDS, (code, stopped_after)
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert alive == []
    assert "did not exit within" not in server.log()


def _post(server: RunningServer, path: str, payload: dict) -> http.client.HTTPResponse:
    url = urllib.parse.urlsplit(server.base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    connection.request("POST", path, json.dumps(payload), headers=server.headers())
    return connection.getresponse()


def _scheduler(server: RunningServer) -> psutil.Process:
    [scheduler] = [p for p in psutil.Process(server.process.pid).children(recursive=True) if p.name() == "sglang::scheduler"]
    return scheduler


def _aborted_requests(server: RunningServer) -> float:
    """SGLang's ``sglang:num_aborted_requests_total`` (``--enable-metrics``; /metrics needs no key)."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    return sum(float(value) for value in re.findall(r"^sglang:num_aborted_requests_total\{[^}]*\} (\S+)$", text, re.M))
