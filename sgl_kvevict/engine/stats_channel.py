"""Side channel that carries the compressed tree's statistics from the scheduler process (the tree
lives there) to the HTTP process, which serves them as ``GET /kvevict/stats``.

SGLang's own scheduler <-> tokenizer-manager channels carry a closed set of request types, so the
stats travel over one extra ZeroMQ REQ/REP pair on an ``ipc://`` socket. The launcher picks the
address (a socket file in a private temporary directory it removes at shutdown) and passes it in
``KVEVICT_STATS_ADDRESS``; spawned SGLang processes inherit it.

* Scheduler process: the engine calls ``serve_stats(provider)`` once. A daemon thread binds the REP
  socket and answers each request with ``provider()``. The provider runs on that thread, beside the
  scheduler's loop: it must be cheap and read-only (plain counters); fields read a few microseconds
  apart may straddle one scheduler step, which is fine for monitoring.
* HTTP process: ``fetch_stats(timeout_s)`` asks over a REQ socket and raises ``StatsUnavailable`` if
  no answer comes in time (the REQ socket is then replaced: a REQ socket that sent without receiving
  cannot send again). It asks the scheduler at most once per ``MIN_FETCH_INTERVAL_S``: every answer
  is a snapshot taken after its request arrived, but requests that arrive while one is being taken
  share the next one, and a request arriving sooner than the interval after the last answer waits. A
  client polling in a tight loop therefore costs the scheduler at most 20 snapshots a second: each
  takes the scheduler process's GIL from the scheduler thread, and unthrottled (about 240 a second)
  they doubled decode's inter-token latency p99 (docs/deployment.md#signals-and-faults).

The provider returns a JSON-serialisable dict (the factory's ``snapshot``; docs/monitoring.md lists
every field). The ones monitoring needs most:

    policy, budget, score, scope  the server's configuration (budget null for policies that decide it)
    compressed_nodes         compressed radix-tree nodes currently cached
    compressed_tokens        logical tokens those nodes cover
    kept_cells               cells they hold (one cell = one (layer, KV head) K and V of one token)
    kv_slots_total           SGLang's token-slot pool, the only KV memory there is
    kv_slots_free            slots free now (back to the total after /flush_cache)
    arena_slots_borrowed     slots the compressed cells live in (0 after /flush_cache)
    arena_cells_used/free    cells used and free inside those slots
    reuse_hits               prefix matches that reused at least one compressed node
    *_evicted                evictions by kind (dense and compressed nodes, slots, cells)

With ``--kv-evict-policy none`` there is no compressed tree and nobody serves the channel; the route
answers ``{"policy": "none"}`` without contacting the scheduler (SGLang's own ``/metrics`` and
``/get_server_info`` report the dense pool).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Callable, Optional

import zmq

ADDRESS_ENV_VAR = "KVEVICT_STATS_ADDRESS"
REQUEST = b"stats"
MIN_FETCH_INTERVAL_S = 0.05
# How often the serving thread wakes to see whether it was closed.
POLL_INTERVAL_MS = 200

StatsProvider = Callable[[], dict]
logger = logging.getLogger(__name__)


class StatsUnavailable(RuntimeError):
    """The scheduler did not answer, or its provider failed; the message says which."""


class StatsServer:
    """The REP side: answers every request with ``provider()`` on a daemon thread."""

    def __init__(self, provider: StatsProvider, address: str):
        self._provider = provider
        self._socket = zmq.Context.instance().socket(zmq.REP)
        # Bound here, on the caller's thread, so a bad address fails the caller at startup; the socket
        # is then used only by the serving thread (a ZeroMQ socket may move threads across a barrier
        # such as Thread.start, never be shared).
        self._socket.bind(address)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvevict-stats", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            if self._socket.poll(POLL_INTERVAL_MS, zmq.POLLIN):
                self._socket.recv()
                self._socket.send(self._reply())
        self._socket.close(linger=0)

    def _reply(self) -> bytes:
        try:
            return json.dumps({"stats": self._provider()}).encode()
        except Exception as error:  # the channel outlives a provider bug; the caller sees the reason
            logger.exception("kvevict stats provider failed")
            return json.dumps({"error": f"the stats provider failed: {type(error).__name__}: {error}"}).encode()

    def close(self) -> None:
        self._closed.set()
        self._thread.join()


class StatsClient:
    """The REQ side; thread-safe (HTTP handlers run on a thread pool). ``min_interval_s``: the least time
    between two snapshots asked of the scheduler (module docstring)."""

    def __init__(self, address: str, min_interval_s: float = MIN_FETCH_INTERVAL_S):
        self._address = address
        self._min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._socket: Optional[zmq.Socket] = None
        # (when the last snapshot was asked for, when its answer arrived, it)
        self._last: Optional[tuple[float, float, dict]] = None

    def fetch(self, timeout_s: float) -> dict:
        """A snapshot the scheduler took after this call began."""
        arrived = time.monotonic()
        with self._lock:
            if self._last is not None:
                asked, answered, stats = self._last
                if asked >= arrived:  # asked for while this call waited for the lock: fresh enough
                    return stats
                # Counted from the last answer, not the last request: the scheduler took that snapshot
                # before its answer arrived, so the next one is at least the interval later however
                # long the last request took to get there (counted from the request, a slow first
                # delivery let two snapshots come 41 ms apart).
                time.sleep(max(0.0, answered + self._min_interval_s - time.monotonic()))
            asked = time.monotonic()
            stats = self._ask(timeout_s)
            self._last = (asked, time.monotonic(), stats)
            return stats

    def _ask(self, timeout_s: float) -> dict:
        """One round trip to the scheduler; the caller holds the lock."""
        if self._socket is None:
            self._socket = zmq.Context.instance().socket(zmq.REQ)
            self._socket.connect(self._address)
        # Connecting never waits for the peer: the request is queued until the REP side binds.
        self._socket.send(REQUEST)
        if not self._socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            self._discard_socket()
            raise StatsUnavailable(
                f"the scheduler did not answer within {timeout_s:g} s (is the sgl_kvevict engine loaded?)"
            )
        reply = json.loads(self._socket.recv())
        if "error" in reply:
            raise StatsUnavailable(reply["error"])
        return reply["stats"]

    def _discard_socket(self) -> None:
        # linger=0 drops the unanswered request; a late reply to it goes to a peer that no longer exists.
        self._socket.close(linger=0)
        self._socket = None

    def close(self) -> None:
        with self._lock:
            if self._socket is not None:
                self._discard_socket()


_server: Optional[StatsServer] = None
_client: Optional[StatsClient] = None
_client_lock = threading.Lock()


def serve_stats(provider: StatsProvider) -> None:
    """Serve ``provider()`` to ``fetch_stats`` callers; call once, in the scheduler process."""
    global _server
    if _server is not None:
        raise RuntimeError("serve_stats was already called in this process")
    address = os.environ.get(ADDRESS_ENV_VAR)
    if not address:
        logger.warning("no /kvevict/stats: %s is not set (not started by the sgl-kvevict launcher)", ADDRESS_ENV_VAR)
        return
    _server = StatsServer(provider, address)


def fetch_stats(timeout_s: float) -> dict:
    """The scheduler's ``provider()``; raises ``StatsUnavailable`` with the reason when it cannot."""
    global _client
    with _client_lock:
        if _client is None:
            address = os.environ.get(ADDRESS_ENV_VAR)
            if not address:
                raise StatsUnavailable(
                    f"{ADDRESS_ENV_VAR} is not set: the server was not started by the sgl-kvevict launcher"
                )
            _client = StatsClient(address)
    return _client.fetch(timeout_s)
