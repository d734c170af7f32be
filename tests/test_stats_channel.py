"""The scheduler -> HTTP stats side channel: in-process with fake providers, across processes through
the environment, and GET /kvevict/stats on a real server."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from serving import running_server
from sgl_kvevict.engine import stats_channel
from sgl_kvevict.engine.stats_channel import ADDRESS_ENV_VAR, StatsClient, StatsServer, StatsUnavailable
from sgl_kvevict.serving import ENV_VAR as SERVING_ENV_VAR


@pytest.fixture
def address():
    # Not tmp_path: an ipc:// path must stay under ~107 bytes and pytest's names can be long.
    directory = tempfile.mkdtemp(prefix="kvevict-test-")
    yield f"ipc://{directory}/stats.sock"
    shutil.rmtree(directory)


@pytest.fixture
def client(address):
    client = StatsClient(address)
    yield client
    client.close()


class CountingProvider:
    """Counts calls and records the thread and time of each; sleeps ``delays[call]`` seconds if given."""

    def __init__(self, delays: dict[int, float] | None = None):
        self.calls = 0
        self.threads: set[str] = set()
        self.times: list[float] = []
        self.delays = delays or {}

    def __call__(self) -> dict:
        self.calls += 1
        self.times.append(time.monotonic())
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delays.get(self.calls, 0.0))
        return {"policy": "lava", "calls": self.calls}


def test_fetch_returns_the_providers_dict_computed_on_the_serving_thread(address, client):
    provider = CountingProvider()
    server = StatsServer(provider, address)
    try:
        assert client.fetch(timeout_s=5) == {"policy": "lava", "calls": 1}
        assert client.fetch(timeout_s=5)["calls"] == 2
        assert provider.threads == {"kvevict-stats"}
    finally:
        server.close()


def test_concurrent_handlers_share_one_client_and_each_gets_a_snapshot_taken_after_it_asked(address, client):
    provider = CountingProvider()
    server = StatsServer(provider, address)

    def fetch(_):
        before = provider.calls
        return before, client.fetch(timeout_s=5)["calls"]

    try:
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(fetch, range(32)))
        assert all(calls > before for before, calls in replies)
        # Handlers waiting while a snapshot is taken share the next one.
        assert provider.calls < 32
    finally:
        server.close()


def test_a_tight_loop_of_fetches_asks_the_scheduler_once_per_interval(address, client):
    """Every fetch is fresh, but the scheduler takes at most one snapshot per ``MIN_FETCH_INTERVAL_S``."""
    provider = CountingProvider()
    server = StatsServer(provider, address)
    try:
        replies, deadline = [], time.monotonic() + 0.5
        while time.monotonic() < deadline:
            replies.append(client.fetch(timeout_s=5)["calls"])
        assert replies == list(range(1, len(replies) + 1))
        gaps = [later - earlier for earlier, later in zip(provider.times, provider.times[1:])]
        assert min(gaps) >= 0.9 * stats_channel.MIN_FETCH_INTERVAL_S
        assert len(replies) <= 0.5 / stats_channel.MIN_FETCH_INTERVAL_S + 2
    finally:
        server.close()


def test_no_answer_times_out_and_the_socket_recovers_when_the_scheduler_appears(address, client):
    start = time.monotonic()
    with pytest.raises(StatsUnavailable, match="did not answer within 0.3 s"):
        client.fetch(timeout_s=0.3)
    assert 0.25 < time.monotonic() - start < 3
    # A REQ socket that sent without a reply refuses to send again; the client must have replaced it.
    provider = CountingProvider()
    server = StatsServer(provider, address)
    try:
        reply = client.fetch(timeout_s=5)
        # ZMQ closes the dropped socket asynchronously, so its request may still reach the new server
        # (seen on a loaded machine): answering it is harmless (the provider only reads). The fetch
        # succeeds on a fresh socket, and once the stale request is gone every reply is the latest.
        assert reply["policy"] == "lava" and 1 <= reply["calls"] <= provider.calls
        assert client.fetch(timeout_s=5)["calls"] == provider.calls
    finally:
        server.close()


def test_a_late_reply_is_never_taken_for_the_next_one(address, client):
    provider = CountingProvider(delays={1: 1.0})
    server = StatsServer(provider, address)
    try:
        with pytest.raises(StatsUnavailable):
            client.fetch(timeout_s=0.2)
        # The first call's reply arrives after its socket was dropped; the next fetch gets its own.
        assert client.fetch(timeout_s=5)["calls"] == 2
    finally:
        server.close()


def test_a_failing_provider_is_reported_and_the_channel_keeps_serving(address, client):
    results = iter([ZeroDivisionError("no arena yet"), {"calls": 2}])

    def provider() -> dict:
        result = next(results)
        if isinstance(result, Exception):
            raise result
        return result

    server = StatsServer(provider, address)
    try:
        with pytest.raises(StatsUnavailable, match="stats provider failed: ZeroDivisionError: no arena yet"):
            client.fetch(timeout_s=5)
        assert client.fetch(timeout_s=5) == {"calls": 2}
    finally:
        server.close()


def test_close_stops_the_serving_thread(address):
    server = StatsServer(CountingProvider(), address)
    server.close()
    assert not any(thread.name == "kvevict-stats" for thread in threading.enumerate())


def test_serve_stats_runs_once_per_process(address, monkeypatch):
    monkeypatch.setenv(ADDRESS_ENV_VAR, address)
    monkeypatch.setattr(stats_channel, "_server", None)
    stats_channel.serve_stats(CountingProvider())
    try:
        with pytest.raises(RuntimeError, match="already called"):
            stats_channel.serve_stats(CountingProvider())
    finally:
        stats_channel._server.close()


def test_fetch_without_the_launchers_address_says_so(monkeypatch):
    monkeypatch.delenv(ADDRESS_ENV_VAR, raising=False)
    monkeypatch.setattr(stats_channel, "_client", None)
    with pytest.raises(StatsUnavailable, match=f"{ADDRESS_ENV_VAR} is not set"):
        stats_channel.fetch_stats(timeout_s=1)


SCHEDULER_STANDIN = """
import os, sys, time
from sgl_kvevict.engine.stats_channel import serve_stats
serve_stats(lambda: {"pid": os.getpid(), "compressed_nodes": 3})
print("serving", flush=True)
time.sleep(120)
"""


def test_serve_and_fetch_across_processes_through_the_environment(address, monkeypatch):
    monkeypatch.setenv(ADDRESS_ENV_VAR, address)
    monkeypatch.setattr(stats_channel, "_client", None)
    scheduler = subprocess.Popen([sys.executable, "-c", SCHEDULER_STANDIN], stdout=subprocess.PIPE, text=True)
    try:
        assert scheduler.stdout.readline().strip() == "serving"
        assert stats_channel.fetch_stats(timeout_s=10) == {"pid": scheduler.pid, "compressed_nodes": 3}
    finally:
        scheduler.kill()
        scheduler.wait()
        stats_channel._client.close()


@pytest.mark.server
def test_stats_route_on_a_real_server_without_a_policy(tiny_llama_dir, tmp_path):
    with running_server(tiny_llama_dir, tmp_path) as server:
        with urllib.request.urlopen(server.base_url + "/kvevict/stats", timeout=30) as response:
            assert response.status == 200
            assert json.loads(response.read()) == {"policy": "none"}
        assert "policy=none" in server.log()
        # The SGLang main process (its spawned processes inherit its environment) received the serving
        # config, and no stats address: nothing binds one without a policy.
        [sglang_main] = psutil.Process(server.process.pid).children()
        environment = sglang_main.environ()
        assert json.loads(environment[SERVING_ENV_VAR])["policy"] == "none"
        assert ADDRESS_ENV_VAR not in environment
