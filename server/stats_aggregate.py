"""``GET /kvevict/stats`` for a scale-out launch: every worker's own payload and their sum.

The router forwards only the routes it knows (``/kvevict/stats`` answers 404 there), so the launcher
serves this aggregate on ``--stats-port`` from a thread of its own process (standard library only).
Each worker's route stays reachable at its own URL, listed in the payload. With ``--api-key`` the
port checks it as SGLang checks its own routes (``Authorization: Bearer KEY``, compared in constant
time, 401 otherwise) and passes it on to the workers.
"""

from __future__ import annotations

import json
import secrets
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from sgl_kvevict.server.processes import authorization

STATS_ROUTE = "/kvevict/stats"
WORKER_TIMEOUT_SECONDS = 10.0
# Settings, the same on every worker: reported once, never summed.
SETTING_FIELDS = ("policy", "budget", "score", "window", "scope", "block_size", "arena_cells_per_slot")


def presents_key(header: Optional[str], key: Optional[str]) -> bool:
    """Whether an ``Authorization`` header value carries ``key`` (always, without a key): SGLang's rule."""
    if key is None:
        return True
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def fetch_worker_stats(url: str, key: Optional[str] = None, timeout: float = WORKER_TIMEOUT_SECONDS) -> dict:
    """One worker's ``/kvevict/stats``, or ``{"error": ...}`` when it does not answer."""
    try:
        request = urllib.request.Request(url + STATS_ROUTE, headers=authorization(key))
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        return {"error": f"HTTP {error.code}: {error.read().decode(errors='replace')[:200]}"}
    except (urllib.error.URLError, OSError, ValueError) as error:
        return {"error": str(getattr(error, "reason", error))}


def add_counters(total: dict, stats: dict) -> None:
    """Add one worker's counters into ``total``: numbers are summed, ``*_max`` take the maximum,
    histograms (dicts of counts) add bucket by bucket; means and kept shares are left out (not additive)."""
    for name, value in stats.items():
        if name in SETTING_FIELDS or name.endswith("_mean") or name.startswith("kept_share") or isinstance(value, bool):
            continue
        if isinstance(value, dict):
            buckets = total.setdefault(name, {})
            for bucket, count in value.items():
                buckets[bucket] = buckets.get(bucket, 0) + count
        elif isinstance(value, (int, float)):
            combine = max if name.endswith("_max") else lambda a, b: a + b
            total[name] = combine(total[name], value) if name in total else value


def aggregate(workers: dict[str, dict]) -> dict:
    """``workers``: URL -> that worker's stats payload. The sum covers the workers that answered."""
    answered = [stats for stats in workers.values() if "error" not in stats]
    total: dict = {}
    for stats in answered:
        add_counters(total, stats)
    settings = {name: answered[0][name] for name in SETTING_FIELDS if answered and name in answered[0]}
    return {
        **settings,
        "workers": [{"url": url, "stats": stats} for url, stats in workers.items()],
        "workers_answering": len(answered),
        "total": total,
    }


class StatsServer:
    """The aggregate on ``host:port``, served from a daemon thread until ``close``; ``key``: the
    ``--api-key`` a client must present, and the workers' key."""

    def __init__(self, host: str, port: int, worker_urls: Callable[[], list[str]], key: Optional[str] = None):
        handler = _handler(lambda: aggregate({url: fetch_worker_stats(url, key) for url in worker_urls()}), key)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread: Optional[threading.Thread] = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(payload: Callable[[], dict], key: Optional[str]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the standard library's name)
            if not presents_key(self.headers.get("Authorization"), key):
                self._reply(401, {"error": "Unauthorized"})
                return
            if self.path.split("?", 1)[0] != STATS_ROUTE:
                self._reply(404, {"error": f"only GET {STATS_ROUTE} is served here; the API is on the router"})
                return
            self._reply(200, payload())

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_args):  # one line per request would drown the servers' logs
            pass

    return Handler
