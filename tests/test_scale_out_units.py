"""Scale-out pieces in-process: the aggregated /kvevict/stats, the public port's relay and the
capacity checks."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sgl_kvevict.server.capacity import GIB, WorkerFootprint, check_gpus, check_host_memory, worker_footprint
from sgl_kvevict.server.port_relay import PortRelay
from sgl_kvevict.server.processes import PICKED_PORT_RANGES, StartupError, ephemeral_port_range, free_loopback_ports
from sgl_kvevict.server.stats_aggregate import StatsServer, aggregate


def worker_stats(reuse_hits: int, served: dict, served_max: int) -> dict:
    return {"policy": "lava", "budget": "0.25", "window": 32, "reuse_hits": reuse_hits, "kv_slots_total": 1000,
            "requests_served_per_node": served, "requests_served_per_node_max": served_max,
            "requests_served_per_node_mean": 1.5}  # fmt: skip


class QuietHandler(BaseHTTPRequestHandler):
    def log_message(self, *_args):  # one line per request on the test's stderr otherwise
        pass


def test_picked_ports_are_distinct_free_and_outside_the_ephemeral_range_and_sglangs():
    """No port the kernel hands a client connection (or SGLang its own ports, 22000-29999) is picked, so
    none can be taken between the pick and the server's bind but by another explicit bind."""
    [taken] = free_loopback_ports(1)
    with socket.socket() as held:
        held.bind(("127.0.0.1", taken))
        ports = free_loopback_ports(16)
    ephemeral_low, ephemeral_high = ephemeral_port_range()
    assert len(set(ports)) == 16 and taken not in ports
    assert all(any(low <= port <= high for low, high in PICKED_PORT_RANGES) for port in ports), ports
    assert not any(ephemeral_low <= port <= ephemeral_high or 22000 <= port <= 30000 for port in ports), ports


def serve_in_thread(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, int]:
    """``handler`` served on a free loopback port from a daemon thread; the server and its port."""
    [port] = free_loopback_ports(1)
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, port


def test_the_aggregate_sums_counters_keeps_settings_once_and_skips_a_silent_worker():
    payload = aggregate(
        {
            "http://a": worker_stats(3, {"1": 2, "2": 1}, 2),
            "http://b": worker_stats(5, {"1": 4}, 1),
            "http://c": {"error": "timed out"},
        }
    )
    assert (payload["policy"], payload["budget"], payload["window"]) == ("lava", "0.25", 32)
    assert payload["workers_answering"] == 2 and [w["url"] for w in payload["workers"]] == ["http://a", "http://b", "http://c"]
    total = payload["total"]
    assert total["reuse_hits"] == 8 and total["kv_slots_total"] == 2000
    assert total["requests_served_per_node"] == {"1": 6, "2": 1} and total["requests_served_per_node_max"] == 2
    assert "requests_served_per_node_mean" not in total and "window" not in total


def test_the_stats_server_answers_the_route_and_nothing_else(tmp_path):
    [port] = free_loopback_ports(1)
    server = StatsServer("127.0.0.1", port, lambda: ["http://127.0.0.1:1"])  # nothing listens on port 1
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/kvevict/stats", timeout=30) as response:
            payload = json.loads(response.read())
        assert payload["workers_answering"] == 0 and "error" in payload["workers"][0]["stats"]
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30)
        assert error.value.code == 404
    finally:
        server.close()


def test_the_stats_port_asks_for_the_api_key_and_presents_it_to_the_workers():
    """A worker that answers only with the key (as an SGLang worker started with --api-key does)."""
    seen = []

    class Worker(QuietHandler):
        def do_GET(self):  # noqa: N802 (the standard library's name)
            seen.append(self.headers.get("Authorization"))
            allowed = self.headers.get("Authorization") == "Bearer s3cret"
            body = json.dumps(worker_stats(2, {}, 0) if allowed else {"error": "Unauthorized"}).encode()
            self.send_response(200 if allowed else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    worker, worker_port = serve_in_thread(Worker)
    [port] = free_loopback_ports(1)
    server = StatsServer("127.0.0.1", port, lambda: [f"http://127.0.0.1:{worker_port}"], key="s3cret")
    url = f"http://127.0.0.1:{port}/kvevict/stats"
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30)
            assert refused.value.code == 401
        assert seen == []  # nothing reached the workers
        request = urllib.request.Request(url, headers={"Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(request, timeout=30) as response:
            payload = json.loads(response.read())
        assert payload["workers_answering"] == 1 and payload["total"]["reuse_hits"] == 2
        assert seen == ["Bearer s3cret"]
    finally:
        server.close()
        worker.shutdown()
        worker.server_close()


def test_the_relay_passes_bytes_as_they_arrive_on_one_kept_alive_connection_and_refuses_once_closed(caplog):
    """Each answer's first half reaches the client while the target still holds back the second (a
    relay that waited for the whole answer would time the client out); both requests share one target
    connection; with the target gone a new connection ends at once; ``close`` ends an idle one quietly,
    and the port refuses from then on."""
    first_half_read = threading.Event()
    peers = set()

    class Target(QuietHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def do_POST(self):  # noqa: N802 (the standard library's name)
            peers.add(self.client_address)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(2 * len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            first_half_read.wait(60)
            self.wfile.write(body)

    target, target_port = serve_in_thread(Target)
    [port] = free_loopback_ports(1)
    relay = PortRelay("127.0.0.1", port, "127.0.0.1", target_port)
    idle = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for body in (b"a first request", b"a second request"):
            first_half_read.clear()
            client.request("POST", "/", body=body)
            response = client.getresponse()
            assert response.read(len(body)) == body
            first_half_read.set()
            assert response.read() == body
        client.close()
        assert len(peers) == 1, peers  # the request's connection; the idle one sent nothing
        target.shutdown()
        target.server_close()
        orphan = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        orphan.request("GET", "/")
        with pytest.raises(http.client.RemoteDisconnected):
            orphan.getresponse()
    finally:
        relay.close()
    assert idle.recv(1) == b"" and not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    idle.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=10)


def test_the_footprint_of_a_worker_follows_its_pool_dtype_and_weights(tmp_path):
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    footprint = worker_footprint(tmp_path, ["--max-total-tokens", "65536", "--dtype", "bfloat16"])
    assert footprint.kv_pool == 65536 * 30 * 3 * 64 * 2 * 2  # SmolLM2: 1.5 GB in bf16
    assert footprint.weights == 1000
    assert worker_footprint(tmp_path, ["--max-total-tokens", "10", "--kv-cache-dtype", "fp8_e4m3"]).kv_pool == 10 * 30 * 3 * 64 * 2
    assert worker_footprint(tmp_path, ["--mem-fraction-static", "0.5"]) is None


def test_capacity_refusals_are_one_line_with_the_numbers():
    footprint = WorkerFootprint(kv_pool=GIB, weights=GIB)
    check_host_memory(2, footprint, available=10 * GIB)
    with pytest.raises(StartupError, match=r"--workers 3 needs about 12\.0 GiB of host RAM \(3 x \(KV pool 1\.0 GiB .* 8\.0 GiB is"):
        check_host_memory(3, footprint, available=8 * GIB)
    with pytest.raises(StartupError, match="needs --max-total-tokens per worker"):
        check_host_memory(2, None, available=8 * GIB)
    check_gpus(2, [], visible=2)
    with pytest.raises(StartupError, match=r"needs GPUs 1\.\.2 \(1 per worker, --tp-size\) but 2 are visible"):
        check_gpus(2, ["--base-gpu-id", "1"], visible=2)
    check_gpus(2, ["--tp-size", "2"], visible=4)
    with pytest.raises(StartupError, match=r"needs GPUs 0\.\.5 \(2 per worker"):
        check_gpus(3, ["--tp-size", "2"], visible=4)
