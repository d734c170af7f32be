"""``--workers 2``: two plugin workers behind SGLang's real cache-aware router (sglang-router), real
HTTP on loopback, the tiny model, ``--api-key`` and ``--admin-api-key`` set. Every route the launcher
exposes needs its key; conversations keep their compressed prefixes on their own worker; a killed
worker is reported and taken out of the router, its client gets an error (no hang) and the other
worker keeps serving from its compressed prefixes; SIGTERM drains the request in flight through the
router. A request sent the moment ``/health`` first answers 200 is served (two starts of their own).
The other tests share one fleet and run in file order: the last two kill a worker and stop it."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import psutil
import pytest

from engine_client import TINY_SERVER_FLAGS, assert_no_leak_after_flush, reply_of, stats, status_of
from serving import RunningServer, running_server
from sgl_kvevict.server.processes import SHUTDOWN_GRACE_SECONDS, free_port, is_healthy

pytestmark = pytest.mark.server

CONVERSATIONS = 4
TURNS = 3
REQUEST_TIMEOUT_SECONDS = 120
WORKER_LINE = re.compile(r"\] worker (\d+) \((http://[\d.:]+)\): ")
API_KEY = "fleet-api-key"
ADMIN_KEY = "fleet-admin-key"
# The router's own /health answered 200 about a second before it could route: a client polling this
# often could not miss that window.
CLIENT_POLL_SECONDS = 0.02
STARTS = 2


def document(index: int) -> str:
    """About 460 tokens of the tiny model's tokenizer, distinct from the first characters on (the
    router matches request texts by prefix)."""
    return f"{index}{index} conversation {index} document " + " ".join(f"w{index}x{j}" for j in range(60))


def chat(server: RunningServer, messages: list[dict], max_tokens: int = 8) -> dict:
    payload = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return server.post("/v1/chat/completions", payload, timeout=REQUEST_TIMEOUT_SECONDS)


def workers_of(server: RunningServer) -> dict[int, RunningServer]:
    """The workers the launcher logged, as servers of their own (their own URL, the launcher's log);
    their admin routes take the API key (the launcher gives them no admin key)."""
    found = {int(index): url for index, url in WORKER_LINE.findall(server.log())}
    return {
        index: RunningServer(url, server.process, server.log_path, server.api_key) for index, url in sorted(found.items())
    }


def stats_port_url(server: RunningServer) -> str:
    return f"http://127.0.0.1:{int(server.base_url.rsplit(':', 1)[1]) + 1}/kvevict/stats"


def routed_urls(server: RunningServer) -> list[str]:
    request = urllib.request.Request(server.base_url + "/workers", headers=server.headers(admin=True))
    with urllib.request.urlopen(request, timeout=60) as response:
        return [worker["url"] for worker in json.loads(response.read())["workers"]]


def run_conversation(server: RunningServer, index: int, start: threading.Barrier, usages: list) -> None:
    messages = [{"role": "user", "content": document(index)}]
    start.wait(timeout=REQUEST_TIMEOUT_SECONDS)
    for turn in range(TURNS):
        response = chat(server, messages)
        usages.append((turn, response["usage"]))
        messages += [
            {"role": "assistant", "content": response["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"question {turn} about document {index}?"},
        ]


def first_answer_after_health(base_url: str, stop: threading.Event) -> Optional[tuple[int, str]]:
    """Poll ``base_url``'s ``/health`` as a client would until it answers 200, then at once send a chat
    request: its HTTP status and body (None when ``stop`` is set first)."""
    while not is_healthy(base_url):
        if stop.wait(CLIENT_POLL_SECONDS):
            return None
    payload = {"model": "default", "messages": [{"role": "user", "content": "a first question"}], "max_tokens": 2}
    return reply_of(base_url + "/v1/chat/completions", "POST", payload=payload)


def test_a_request_sent_the_moment_health_answers_200_is_served(tiny_llama_dir, tmp_path):
    """First, before the fleet starts: at each start a client polls ``/health`` from the launcher's
    first instant and sends a chat request the moment it answers 200 (the router's own /health said
    200 before the router had registered its workers, and that request got 503)."""
    flags = ("--workers", "2", "--max-total-tokens", "2000", *TINY_SERVER_FLAGS)
    for start in range(STARTS):
        port = free_port()
        log_dir = tmp_path / f"start-{start}"
        log_dir.mkdir()
        stop = threading.Event()
        with ThreadPoolExecutor(max_workers=1) as client:
            first_answer = client.submit(first_answer_after_health, f"http://127.0.0.1:{port}", stop)
            try:
                with running_server(tiny_llama_dir, log_dir, *flags, port=port):
                    answer = first_answer.result(timeout=REQUEST_TIMEOUT_SECONDS)
            finally:
                stop.set()
        assert answer is not None and answer[0] == 200, (start, answer)


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    flags = (
        "--workers", "2", "--kv-evict-policy", "lava", "--max-total-tokens", "6000", *TINY_SERVER_FLAGS,
        "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY,
    )  # fmt: skip
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
        threading.Thread(target=run_conversation, args=(fleet, index, start, usages[index]))
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

    request = urllib.request.Request(stats_port_url(fleet), headers=fleet.headers())
    with urllib.request.urlopen(request, timeout=60) as response:
        aggregate = json.loads(response.read())
    assert aggregate["workers_answering"] == 2 and aggregate["policy"] == "lava"
    assert aggregate["total"]["reuse_hits"] == CONVERSATIONS * (TURNS - 1)
    assert aggregate["total"]["kv_slots_total"] == sum(s["kv_slots_total"] for s in per_worker.values())

    for worker in workers.values():
        assert_no_leak_after_flush(worker)


def test_every_route_of_the_router_the_stats_port_and_the_workers_needs_its_key(fleet):
    """401 without the right key, served with it. The router's control plane (worker management,
    /flush_cache, /get_loads) takes the admin key only; its inference routes, the stats port and the
    workers take the API key. Open by design: the router's health and model list (docs/deployment.md)."""
    chat_payload = {"model": "default", "messages": [{"role": "user", "content": "a short question"}], "max_tokens": 2}
    worker = next(iter(workers_of(fleet).values())).base_url
    routes = [  # url, method, payload, who may call it, its answer then
        (fleet.base_url + "/v1/chat/completions", "POST", chat_payload, API_KEY, 200),
        (fleet.base_url + "/generate", "POST", {"text": "a short question", "sampling_params": {"max_new_tokens": 2}}, API_KEY, 200),
        (fleet.base_url + "/workers", "GET", None, ADMIN_KEY, 200),
        # Adding a backend: refused before the body is read; with the key the (empty) body is refused.
        (fleet.base_url + "/workers", "POST", {}, ADMIN_KEY, 422),
        (fleet.base_url + "/workers/not-a-worker-id", "DELETE", None, ADMIN_KEY, 400),
        (fleet.base_url + "/flush_cache", "POST", None, ADMIN_KEY, 200),
        (fleet.base_url + "/get_loads", "GET", None, ADMIN_KEY, 200),
        (stats_port_url(fleet), "GET", None, API_KEY, 200),
        (worker + "/kvevict/stats", "GET", None, API_KEY, 200),
        (worker + "/flush_cache", "POST", None, API_KEY, 200),
        (worker + "/v1/models", "GET", None, API_KEY, 200),
    ]
    for url, method, payload, key, answer in routes:
        for presented in (None, "wrong-key", API_KEY, ADMIN_KEY):
            code = status_of(url, method, presented, payload)
            assert code == (answer if presented == key else 401), (method, url, presented, code)
    for path in ("/health", "/readiness", "/liveness", "/v1/models", "/get_server_info"):
        assert status_of(fleet.base_url + path) == 200, path
    # The router forwards only routes it knows: the statistics are on the stats port.
    assert status_of(fleet.base_url + "/kvevict/stats", key=API_KEY) == 404


def test_a_worker_killed_mid_stream_fails_its_client_and_the_other_keeps_serving_its_prefixes(fleet):
    workers = workers_of(fleet)
    doomed_messages = [{"role": "user", "content": document(7)}]
    doomed, _ = _served_by(fleet, workers, doomed_messages)
    # A conversation on the other worker: the router sends a first turn back to the worker that served
    # it in the first test (it remembers the texts), so one of those conversations lands there.
    survivor = 1 - doomed
    for index in range(CONVERSATIONS):
        survivor_messages = [{"role": "user", "content": document(index)}]
        first_turn = _served_by(fleet, workers, survivor_messages)
        if first_turn[0] == survivor:
            break
    else:
        pytest.fail(f"no conversation of the first test was routed to worker {survivor}")
    survivor_stats = stats(workers[survivor])

    doomed_port = workers[doomed].base_url.rsplit(":", 1)[1]
    [doomed_server] = [
        child for child in psutil.Process(fleet.process.pid).children()
        if f"--port {doomed_port}" in " ".join(child.cmdline())
    ]  # fmt: skip
    outcome: dict = {"chunks": 0}
    first_chunk = threading.Event()

    def stream():
        started = time.monotonic()
        payload = {"model": "default", "messages": doomed_messages, "max_tokens": 400, "ignore_eos": True, "stream": True}
        request = urllib.request.Request(
            fleet.base_url + "/v1/chat/completions", data=json.dumps(payload).encode(), headers=fleet.headers()
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS) as response:
                for line in response:
                    if line.startswith(b"data:") and b"[DONE]" not in line:
                        outcome["chunks"] += 1
                        outcome["finish"] = json.loads(line[5:]).get("choices", [{}])[0].get("finish_reason")
                        first_chunk.set()
        except (urllib.error.URLError, OSError, ValueError) as error:  # HTTPError included
            outcome["error"] = error
        outcome["seconds"] = time.monotonic() - started
        first_chunk.set()

    in_flight = threading.Thread(target=stream)
    in_flight.start()
    assert first_chunk.wait(REQUEST_TIMEOUT_SECONDS) and outcome["chunks"] > 0, outcome
    doomed_server.send_signal(signal.SIGKILL)  # the HTTP process; its scheduler follows it down
    in_flight.join(timeout=REQUEST_TIMEOUT_SECONDS + 10)
    # The client's stream ends, short of its 400 tokens and without a normal finish: an error, no hang.
    assert not in_flight.is_alive() and outcome["seconds"] < REQUEST_TIMEOUT_SECONDS, outcome
    assert "error" in outcome or outcome.get("finish") != "length", outcome

    deadline = time.monotonic() + 60
    while f"worker {doomed} ({workers[doomed].base_url}) exited" not in fleet.log() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert f"worker {doomed} ({workers[doomed].base_url}) exited with code -9" in fleet.log()
    time.sleep(2.0)  # the router's removal runs in its background queue
    assert routed_urls(fleet) == [workers[survivor].base_url]

    # The survivor's conversation continues from its compressed prefix; the doomed worker's conversation
    # and a fresh one are answered by the survivor (the doomed one's prefix is recomputed).
    survivor_messages += [
        {"role": "assistant", "content": first_turn[1]["choices"][0]["message"]["content"]},
        {"role": "user", "content": "a question about the document?"},
    ]
    second_turn = chat(fleet, survivor_messages)
    assert second_turn["usage"]["prompt_tokens_details"]["cached_tokens"] > 0.9 * first_turn[1]["usage"]["prompt_tokens"]
    assert stats(workers[survivor])["reuse_hits"] == survivor_stats["reuse_hits"] + 1
    for conversation in (doomed_messages, [{"role": "user", "content": document(8)}]):
        assert chat(fleet, conversation)["usage"]["completion_tokens"] > 0
    assert fleet.process.poll() is None
    assert_no_leak_after_flush(workers[survivor])


def test_sigterm_drains_the_request_in_flight_through_the_router_and_exits_0(fleet):
    """Last: it stops the fleet."""
    processes = psutil.Process(fleet.process.pid).children(recursive=True)
    outcome: dict = {}
    first_chunk = threading.Event()

    def stream():
        payload = {"model": "default", "messages": [{"role": "user", "content": document(9)}], "max_tokens": 64,
                   "ignore_eos": True, "stream": True}  # fmt: skip
        request = urllib.request.Request(
            fleet.base_url + "/v1/chat/completions", data=json.dumps(payload).encode(), headers=fleet.headers()
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS) as response:
            for line in response:
                if line.startswith(b"data:") and b"[DONE]" not in line:
                    first_chunk.set()
                    outcome["finish"] = json.loads(line[5:])["choices"][0]["finish_reason"] or outcome.get("finish")

    client = threading.Thread(target=stream)
    client.start()
    assert first_chunk.wait(REQUEST_TIMEOUT_SECONDS)
    started = time.monotonic()
    fleet.process.send_signal(signal.SIGTERM)
    code = fleet.process.wait(timeout=SHUTDOWN_GRACE_SECONDS + 30)
    stopped_after = time.monotonic() - started
    client.join(timeout=60)
    assert outcome.get("finish") == "length", outcome
    assert code == 0 and stopped_after < SHUTDOWN_GRACE_SECONDS, (code, stopped_after)
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert alive == []
    assert "did not exit within" not in fleet.log()


def _served_by(fleet: RunningServer, workers: dict[int, RunningServer], messages: list[dict]) -> tuple[int, dict]:
    """Send ``messages``; (the worker that compressed the prompt, the response)."""
    before = {index: stats(worker)["requests_compressed"] for index, worker in workers.items()}
    response = chat(fleet, messages)
    [index] = [i for i, worker in workers.items() if stats(worker)["requests_compressed"] > before[i]]
    return index, response
