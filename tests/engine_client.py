"""HTTP helpers of the engine tests: raw-token generation, /kvevict/stats, and the memory check after a flush."""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest
import torch

from serving import RunningServer, running_server
from sgl_kvevict.engine.plan_dump import PLAN_DUMP_ENV
from sgl_kvevict.request_options import REQUEST_OPTIONS_PREFIX
from sgl_kvevict.server.processes import authorization

# With a policy the launcher passes SGLang a shrunk --max-total-tokens, from which SGLang's CPU memory
# profiling derives a negative --mem-fraction-static and refuses to start; an explicit one avoids it.
MEMORY_FLAGS = ("--mem-fraction-static", "0.3")
# Parity needs the reference's fp32 numerics.
TINY_SERVER_FLAGS = ("--dtype", "float32", *MEMORY_FLAGS)
# The real Gemma 3 270M (1.5 GB of fp32 weights) under fp32: SGLang's CPU profile counts as the weights' what
# every process loading at the same moment takes (the other test worker's servers, or the stock server a test
# starts beside it), and under 0.3 it found no room left for the pool; --max-total-tokens sizes the pool anyway.
GEMMA3_SERVER_FLAGS = ("--dtype", "float32", "--mem-fraction-static", "0.6")
# A test server whose requests choose any eviction options (the tests are trusted clients).
ANY_REQUEST_OPTIONS = ("--kv-evict-per-request", "--kv-evict-request-allow", "all")


def random_prompt(length: int, seed: int) -> list[int]:
    """Token ids of the tiny model's vocabulary, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(5, 250) for _ in range(length)]


def get(server: RunningServer, path: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(server.base_url + path, headers=server.headers()), timeout=60) as response:
        return json.loads(response.read())


def reply_of(url: str, method: str = "GET", key: str | None = None, payload: dict | None = None) -> tuple[int, str]:
    """The HTTP status and body ``url`` answers ``method`` with (an error status included), presenting
    ``key`` (or none)."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json", **authorization(key)})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def status_of(url: str, method: str = "GET", key: str | None = None, payload: dict | None = None) -> int:
    """The HTTP status ``url`` answers ``method`` with, presenting ``key`` (or none)."""
    return reply_of(url, method, key, payload)[0]


def post_status(server: RunningServer, payload: dict, path: str = "/generate") -> tuple[int, str]:
    """POST ``payload`` with the server's key; the HTTP status and body, an error status included."""
    return reply_of(server.base_url + path, "POST", server.api_key, payload)


def stats(server: RunningServer) -> dict:
    return get(server, "/kvevict/stats")


def generate(
    server: RunningServer, input_ids: list[int] | list[list[int]], max_new_tokens: int, rid: str | list[str] | None = None,
    options: str | None = None,
) -> dict | list[dict]:
    """Greedy ``/generate`` (a batch: prompts and rids as lists, one reply each); ``options``: the request's own
    eviction options (``--kv-evict-per-request``)."""
    payload = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    if rid is not None:
        payload["rid"] = rid
    if options is not None:
        payload["extra_key"] = REQUEST_OPTIONS_PREFIX + options
    return server.post("/generate", payload)


def request_options(config) -> str:
    """The ``extra_key`` options that make a ``--kv-evict-per-request`` server serve ``config``: every
    option that differs from the policy's defaults, as ``--kv-evict-*`` option strings."""
    from sgl_kvevict.config import EvictionConfig

    defaults = EvictionConfig.for_policy(config.policy, score=config.score).option_values()
    changed = [f"{name}={value}" for name, value in config.option_values().items() if value != defaults[name]]
    return ",".join([f"policy={config.policy}", f"score={config.score}", *changed])


def abort(server: RunningServer, rid: str) -> None:
    request = urllib.request.Request(
        server.base_url + "/abort_request", data=json.dumps({"rid": rid}).encode(), headers=server.headers(admin=True)
    )
    with urllib.request.urlopen(request, timeout=60):
        pass


def stream(
    server: RunningServer, payload: dict, abort_after: Optional[int] = None, on_chunk: Optional[Callable[[], None]] = None
) -> int:
    """Stream ``/generate`` of ``payload``; with ``abort_after``, abort the request (its ``rid``) once that
    many chunks arrived; ``on_chunk`` is called at every chunk. Returns the chunks received."""
    request = urllib.request.Request(
        server.base_url + "/generate", data=json.dumps({**payload, "stream": True}).encode(), headers=server.headers()
    )
    chunks = 0
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                chunks += 1
                if on_chunk is not None:
                    on_chunk()
                if chunks == abort_after:
                    abort(server, payload["rid"])
    return chunks


def flush(server: RunningServer, attempts: int = 60) -> None:
    """``/flush_cache``, retried while aborted requests are still draining (SGLang refuses it then)."""
    for _ in range(attempts):
        request = urllib.request.Request(
            server.base_url + "/flush_cache", data=b"", method="POST", headers=server.headers(admin=True)
        )
        try:
            with urllib.request.urlopen(request, timeout=60):
                return
        except urllib.error.HTTPError:  # 400 while requests are pending
            time.sleep(0.5)
    raise AssertionError("the server never became idle enough to flush")


def assert_no_leak_after_flush(server: RunningServer) -> dict:
    """Flush, then the arena holds nothing and every KV slot is free again; returns the stats."""
    flush(server)
    after = stats(server)
    assert after["arena_cells_used"] == after["arena_slots_borrowed"] == 0, after
    assert after["compressed_nodes"] == after["kept_cells"] == after["compressed_tokens"] == 0, after
    assert after["deferred_nodes"] == after["deferred_plan_bytes"] == 0, after  # --kv-evict-when pressure's plans
    assert after["kv_slots_free"] == after["kv_slots_total"], after
    return after


def assert_strict_idle_check_passed(server: RunningServer) -> None:
    """SGLang's idle-time memory invariant check is on (its default) and never fired: a failure raises
    in the scheduler and takes the server down."""
    assert os.environ.get("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "true").lower() not in ("0", "false")
    assert server.process.poll() is None, server.log()[-4000:]
    log = server.log()
    for marker in ("KV double free", "use-after-free", "memory leak", "token_to_kv_pool_allocator memory leak"):
        assert marker not in log, marker
    with urllib.request.urlopen(server.base_url + "/health", timeout=60) as response:  # open to probes
        assert response.status == 200


def assert_same_plan(server_plan: dict, reference_plan) -> None:
    """A plan the server dumped (``KVEVICT_PLAN_DUMP_DIR``) equals the reference engine's ``CompressionPlan``:
    its segment, its number of layers, and per layer its kept counts per KV head and kept positions."""
    assert (server_plan["segment_start"], server_plan["segment_end"]) == (
        reference_plan.segment_start,
        reference_plan.segment_end,
    )
    assert len(server_plan["layers"]) == len(reference_plan.layers), "the plans have different numbers of layers"
    for layer, ((kept_positions, head_indptr), expected) in enumerate(zip(server_plan["layers"], reference_plan.layers)):
        assert torch.equal(head_indptr, expected.head_indptr), f"layer {layer}: kept counts per KV head differ"
        assert torch.equal(kept_positions, expected.kept_positions), f"layer {layer}: kept positions differ"


@contextlib.contextmanager
def checked_server(
    model, log_dir: Path, *flags: str, dump_dir: Optional[Path] = None, idle_check: bool = True
) -> Iterator[RunningServer]:
    """The launcher with ``flags``; with ``dump_dir``, saving every plan it hands its tree there
    (``engine.plan_dump``); with ``idle_check``, SGLang's strict idle check must have passed when the
    test is done with it."""
    with pytest.MonkeyPatch.context() as patch:
        if dump_dir is not None:
            patch.setenv(PLAN_DUMP_ENV, str(dump_dir))
        with running_server(model, log_dir, *flags) as running:
            yield running
            if idle_check:
                assert_strict_idle_check_passed(running)


def module_server(name: str, *flags: str):
    """A module-scoped ``server`` fixture: the tiny model served with ``flags``, checked when the module
    is done (``checked_server``)."""

    @pytest.fixture(scope="module")
    def server(tiny_llama_dir, tmp_path_factory):
        with checked_server(tiny_llama_dir, tmp_path_factory.mktemp(name), *flags) as running:
            yield running

    return server
