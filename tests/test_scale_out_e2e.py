"""``--workers 2``: two plugin workers behind SGLang's real cache-aware router (sglang-router), real
HTTP on loopback, the tiny model. Conversations keep their compressed prefixes on their own worker;
a killed worker is reported, taken out of the router, and no client hangs."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from engine_client import TINY_SERVER_FLAGS, assert_no_leak_after_flush, stats
from serving import RunningServer, running_server

pytestmark = pytest.mark.server

CONVERSATIONS = 4
TURNS = 3
REQUEST_TIMEOUT_SECONDS = 120
WORKER_LINE = re.compile(r"\] worker (\d+) \((http://[\d.:]+)\): ")


def document(index: int) -> str:
    """About 460 tokens of the tiny model's tokenizer, distinct from the first characters on (the
    router matches request texts by prefix)."""
    return f"{index}{index} conversation {index} document " + " ".join(f"w{index}x{j}" for j in range(60))


def chat(base_url: str, messages: list[dict], max_tokens: int = 8) -> dict:
    request = urllib.request.Request(
        base_url + "/v1/chat/completions",
        data=json.dumps({"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS) as response:
        return json.loads(response.read())


def workers_of(server: RunningServer) -> dict[int, RunningServer]:
    """The workers the launcher logged, as servers of their own (their own URL, the launcher's log)."""
    found = {int(index): url for index, url in WORKER_LINE.findall(server.log())}
    return {index: RunningServer(url, server.process, server.log_path) for index, url in sorted(found.items())}


def run_conversation(base_url: str, index: int, start: threading.Barrier, usages: list) -> None:
    messages = [{"role": "user", "content": document(index)}]
    start.wait(timeout=REQUEST_TIMEOUT_SECONDS)
    for turn in range(TURNS):
        response = chat(base_url, messages)
        usages.append((turn, response["usage"]))
        messages += [
            {"role": "assistant", "content": response["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"question {turn} about document {index}?"},
        ]


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    flags = ("--workers", "2", "--kv-evict-policy", "lava", "--max-total-tokens", "6000", *TINY_SERVER_FLAGS)
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("fleet"), *flags) as server:
        yield server


def test_every_later_turn_reuses_its_compressed_prefix_on_its_own_worker(fleet):
    workers = workers_of(fleet)
    assert sorted(workers) == [0, 1]
    usages: dict[int, list] = {index: [] for index in range(CONVERSATIONS)}
    # All first turns at once: on a prefix miss the router picks the least-loaded worker (its
    # in-flight count), so concurrent conversations spread; sequential ones would all tie on worker 0.
    start = threading.Barrier(CONVERSATIONS)
    threads = [
        threading.Thread(target=run_conversation, args=(fleet.base_url, index, start, usages[index]))
        for index in range(CONVERSATIONS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=TURNS * REQUEST_TIMEOUT_SECONDS)
    assert all(len(turns) == TURNS for turns in usages.values()), usages

    for turns in usages.values():
        for (_, previous), (turn, usage) in zip(turns, turns[1:]):
            # Only the worker that prefilled the previous turn holds that prefix.
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0.9 * previous["prompt_tokens"], turns

    per_worker = {index: stats(worker) for index, worker in workers.items()}
    # Both workers served: each compressed the first turns of the conversations routed to it (a later
    # turn's own new tokens, answer and question, may be shorter than the window and stay dense).
    assert all(s["requests_compressed"] > 0 for s in per_worker.values()), per_worker
    assert sum(s["requests_compressed"] for s in per_worker.values()) >= CONVERSATIONS, per_worker
    # Every later turn of every conversation matched a compressed node of its own worker, and each
    # worker's count is whole conversations' worth (a conversation never moved).
    hits = {index: s["reuse_hits"] for index, s in per_worker.items()}
    assert sum(hits.values()) == CONVERSATIONS * (TURNS - 1), per_worker
    assert all(count % (TURNS - 1) == 0 for count in hits.values()), hits

    port = int(fleet.base_url.rsplit(":", 1)[1])
    with urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/kvevict/stats", timeout=60) as response:
        aggregate = json.loads(response.read())
    assert aggregate["workers_answering"] == 2 and aggregate["policy"] == "lava"
    assert aggregate["total"]["reuse_hits"] == CONVERSATIONS * (TURNS - 1)
    assert aggregate["total"]["kv_slots_total"] == sum(s["kv_slots_total"] for s in per_worker.values())

    for worker in workers.values():
        assert_no_leak_after_flush(worker)


def test_a_killed_worker_is_reported_and_taken_out_and_no_client_hangs(fleet):
    workers = workers_of(fleet)
    messages = [{"role": "user", "content": document(7)}]
    before = {index: stats(worker)["requests_compressed"] for index, worker in workers.items()}
    chat(fleet.base_url, messages)
    [doomed] = [i for i, worker in workers.items() if stats(worker)["requests_compressed"] > before[i]]
    doomed_port = workers[doomed].base_url.rsplit(":", 1)[1]
    [doomed_server] = [
        child for child in psutil.Process(fleet.process.pid).children()
        if f"--port {doomed_port}" in " ".join(child.cmdline())
    ]  # fmt: skip

    outcome: dict = {}

    def long_request():
        started = time.monotonic()
        try:
            outcome["response"] = chat(fleet.base_url, messages, max_tokens=400)
        except (urllib.error.URLError, OSError) as error:  # HTTPError included
            outcome["error"] = error
        outcome["seconds"] = time.monotonic() - started

    in_flight = threading.Thread(target=long_request)
    in_flight.start()
    time.sleep(1.0)
    doomed_server.send_signal(signal.SIGKILL)  # the HTTP process; its scheduler follows it down
    in_flight.join(timeout=REQUEST_TIMEOUT_SECONDS + 10)
    assert not in_flight.is_alive() and outcome["seconds"] < REQUEST_TIMEOUT_SECONDS, outcome

    deadline = time.monotonic() + 60
    while f"worker {doomed} ({workers[doomed].base_url}) exited" not in fleet.log() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert f"worker {doomed} ({workers[doomed].base_url}) exited with code -9" in fleet.log()
    time.sleep(2.0)  # the router's removal runs in its background queue
    # The conversation's next turn and a fresh one both land on the survivor and are answered.
    for conversation in (messages, [{"role": "user", "content": document(8)}]):
        assert chat(fleet.base_url, conversation)["usage"]["completion_tokens"] > 0
    with urllib.request.urlopen(fleet.base_url + "/workers", timeout=60) as response:
        listed = [worker["url"] for worker in json.loads(response.read())["workers"]]
    assert listed == [workers[1 - doomed].base_url]
    assert fleet.process.poll() is None
