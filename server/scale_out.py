"""``--workers N``: N plugin workers behind SGLang's cache-aware router, one launcher for all.

* Workers: N SGLang servers with the same flags (each its own process group, its own KV pool of
  ``--max-total-tokens``, its own stats socket) on free loopback ports, served model name
  ``--model`` unless given (so clients' ``"model"`` matches what the router lists).
* Router: ``sglang-router``'s Rust router (``router_entry``) on a free loopback port with the
  ``cache_aware`` policy: it keeps an approximate radix tree of the request texts it sent to each
  worker and sends a request to the worker whose tree shares the longest prefix with it (above 30%
  of the text; else the worker with the smallest tree). A compressed prefix lives on one worker
  only, so that affinity is what makes a conversation's later turns reuse it.
* Public port: ``--host``/``--port`` opens once the router routes to every worker, relayed to the
  router's port (``port_relay``: the router answers ``/health`` before it can route, a client must
  not see it then).
* Stats: the router does not forward ``/kvevict/stats``; the launcher serves the aggregate on
  ``--stats-port`` (``stats_aggregate``).
* Keys: ``--api-key`` goes to every worker, to the router (which then checks it on its routes and
  sends it to the workers) and to the stats port; ``--admin-api-key`` becomes the router's
  control-plane key (its worker management, ``/flush_cache``, ``/get_loads``). The workers do not
  get the admin key: the router reaches them with its one ``--api-key``, and a worker with an admin
  key would refuse the router's ``/flush_cache`` fan-out.
* Faults: the launcher polls its children every second. A worker that exits is reported and taken
  out of the router (``DELETE /workers/{id}``), so later requests go to the others; requests it was
  serving fail with the router's error (connection reset), they do not hang. The launcher exits
  when the router or the last worker exits, and on SIGINT/SIGTERM stops every group: each drains
  the requests in flight first (``processes.ChildGroup.stop``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sgl_kvevict.server.capacity import available_host_bytes, check_gpus, check_host_memory, worker_footprint
from sgl_kvevict.server.flags import LaunchConfig
from sgl_kvevict.server.port_relay import PortRelay
from sgl_kvevict.server.processes import (
    HEALTH_POLL_SECONDS,
    SHUTDOWN_GRACE_SECONDS,
    ChildGroup,
    StartupError,
    StopSignals,
    authorization,
    check_port_free,
    free_loopback_ports,
    freeze_gc,
    log,
    stop_all,
    wait_until_healthy,
)
from sgl_kvevict.server.sglang_args import flag_value, has_flag, tp_size
from sgl_kvevict.server.stats_aggregate import STATS_ROUTE, StatsServer
from sgl_kvevict.server.worker import server_env, sglang_args, sglang_command, stats_socket_address

ROUTER_PACKAGE = "sglang_router"
ROUTER_REQUIREMENT = "sglang-router==0.3.2"
LOOPBACK_HOST = "127.0.0.1"  # the workers, the router and its metrics: never exposed
SUPERVISE_SECONDS = 1.0
# The router's own settings, on top of its defaults (sglang_router/router_args.py):
ROUTER_FLAGS = (
    "--policy", "cache_aware",
    # It logs every request at info level.
    "--log-level", "warn",
    # Its default waits 180 s for in-flight requests on SIGTERM; it must be done before the launcher's
    # SIGKILL (SHUTDOWN_GRACE_SECONDS).
    "--shutdown-grace-period-secs", str(int(SHUTDOWN_GRACE_SECONDS) - 5),
)  # fmt: skip
# The router's control-plane key entry: id:name:role:key.
CONTROL_PLANE_KEY_ENTRY = "launcher:sgl-kvevict admin:admin:{key}"


@dataclass
class Worker:
    index: int
    url: str
    child: ChildGroup

    @property
    def name(self) -> str:
        return f"worker {self.index} ({self.url})"


def check_prerequisites(config: LaunchConfig) -> None:
    """Before the model resolves: the router is installed and the stats port is free."""
    if importlib.util.find_spec(ROUTER_PACKAGE) is None:
        raise StartupError(
            f"--workers {config.workers} needs SGLang's router: pip install {ROUTER_REQUIREMENT} (make setup does)"
        )
    check_port_free(config.host, config.stats_port)


def check_capacity(config: LaunchConfig, model_dir: Path, cpu_mode: bool) -> None:
    """N pools fit in host RAM (CPU), or N GPUs are visible (CUDA)."""
    if cpu_mode:
        footprint = worker_footprint(model_dir, sglang_args(config, cpu_mode))
        check_host_memory(config.workers, footprint, available_host_bytes())
    else:
        import torch

        check_gpus(config.workers, config.sglang_args, torch.cuda.device_count())


def worker_config(config: LaunchConfig, index: int, cpu_mode: bool) -> LaunchConfig:
    args = list(config.sglang_args)
    if not has_flag(args, "--served-model-name"):
        args += ["--served-model-name", config.model]
    if not cpu_mode:
        first_gpu = _base_gpu(config) + index * tp_size(args)  # a worker's TP ranks take consecutive GPUs
        args = [*_without_flag(args, "--base-gpu-id"), "--base-gpu-id", str(first_gpu)]
    return dataclasses.replace(config, sglang_args=args, admin_api_key=None)


def _base_gpu(config: LaunchConfig) -> int:
    return int(flag_value(config.sglang_args, "--base-gpu-id") or 0)


def _without_flag(args: list[str], flag: str) -> list[str]:
    """``args`` less ``flag`` and its value (both spellings)."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            kept.append(arg)
    return kept


def router_command(config: LaunchConfig, worker_urls: list[str], port: int, metrics_port: int) -> list[str]:
    """The router on ``LOOPBACK_HOST:port``; clients reach it through the public port (``PortRelay``)."""
    keys = []
    if config.api_key is not None:
        keys += ["--api-key", config.api_key]
    if config.admin_api_key is not None:
        keys += ["--control-plane-api-keys", CONTROL_PLANE_KEY_ENTRY.format(key=config.admin_api_key)]
    return [
        sys.executable, "-m", "sgl_kvevict.server.router_entry", *ROUTER_FLAGS,
        "--host", LOOPBACK_HOST, "--port", str(port),
        # Its Prometheus exporter would take port 29000 on every interface; a free loopback port instead.
        "--prometheus-host", LOOPBACK_HOST, "--prometheus-port", str(metrics_port),
        *keys, "--worker-urls", *worker_urls,
    ]  # fmt: skip


def routed_workers(router_url: str, key: Optional[str]) -> dict[str, dict]:
    """The router's workers by URL (``GET /workers``, an admin route: ``key`` is the control key);
    empty while it does not answer."""
    try:
        request = urllib.request.Request(f"{router_url}/workers", headers=authorization(key))
        with urllib.request.urlopen(request, timeout=10) as response:
            return {worker["url"]: worker for worker in json.loads(response.read())["workers"]}
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return {}


def wait_until_routed(
    router: ChildGroup, router_url: str, worker_urls: list[str], key: Optional[str], timeout: float, stop
) -> None:
    """The router answers /health before it has registered its workers (a background job queue in
    0.3.2; requests meanwhile get 503): wait until it lists every worker as healthy. It marks a worker
    healthy last, after its routing policy took the worker in, so from then on it routes to each."""
    wait_until_healthy(router, router_url, timeout, stop)
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        listed = routed_workers(router_url, key)
        if all(listed.get(url, {}).get("is_healthy") for url in worker_urls):
            return
        if router.exit_code() is not None or time.monotonic() > deadline:
            raise StartupError(f"the router did not register every worker within {timeout:.0f} s: {sorted(listed)}")
        stop.wait(HEALTH_POLL_SECONDS)


def remove_from_router(router_url: str, worker_url: str, key: Optional[str]) -> None:
    """Take ``worker_url`` out of the router (its API names workers by the id ``GET /workers`` lists)."""
    listed = routed_workers(router_url, key)
    try:
        if worker_url in listed:
            request = urllib.request.Request(
                f"{router_url}/workers/{listed[worker_url]['id']}", method="DELETE", headers=authorization(key)
            )
            with urllib.request.urlopen(request, timeout=10):
                pass
    except (urllib.error.URLError, OSError) as error:
        log(f"could not remove {worker_url} from the router ({error}); its health checks will")


def supervise(workers: list[Worker], router: ChildGroup, router_url: str, key: Optional[str], signals: StopSignals) -> int:
    """Until a signal, the router's exit or the last worker's: report dead workers, take them out."""
    while not signals.event.wait(SUPERVISE_SECONDS):
        if router.exit_code() is not None:
            log(f"the router exited with code {router.exit_code()}")
            return router.exit_code() or 1
        for worker in [w for w in workers if w.child.exit_code() is not None]:
            log(f"{worker.name} exited with code {worker.child.exit_code()}; the router no longer sends it requests")
            remove_from_router(router_url, worker.url, key)
            workers.remove(worker)
        if not workers:
            log("no worker is left")
            return 1
    log(f"received {signals.name}, shutting down")
    return 0


def start_workers(
    config: LaunchConfig, model_dir: Path, cpu_mode: bool, resources: contextlib.ExitStack, children: list[ChildGroup]
) -> list[Worker]:
    """Every worker's process group, started at once (each loads while the others do); each joins
    ``children`` as soon as it runs, so a failure half-way still stops the ones started."""
    workers = []
    for index, port in enumerate(free_loopback_ports(config.workers)):
        worker = worker_config(config, index, cpu_mode)
        address = resources.enter_context(stats_socket_address(config.serving.enabled))
        command = sglang_command(worker, str(model_dir), cpu_mode, LOOPBACK_HOST, port)
        child = ChildGroup(f"worker {index}", command, server_env(worker, cpu_mode, address))
        children.append(child)
        workers.append(Worker(index, f"http://{LOOPBACK_HOST}:{port}", child))
    return workers


def open_public_port(config: LaunchConfig, router_port: int) -> PortRelay:
    try:
        return PortRelay(config.host, config.port, LOOPBACK_HOST, router_port)
    except OSError as error:  # taken since the launcher looked
        raise StartupError(f"cannot listen on {config.host}:{config.port}: {error.strerror}") from None


def serve_stats(config: LaunchConfig, workers: list[Worker]) -> StatsServer:
    try:
        return StatsServer(config.host, config.stats_port, lambda: [w.url for w in workers], config.api_key)
    except OSError as error:  # taken since check_prerequisites looked
        raise StartupError(f"cannot serve {STATS_ROUTE} on {config.host}:{config.stats_port}: {error.strerror}") from None


def run(config: LaunchConfig, model_dir: Path, cpu_mode: bool, signals: StopSignals) -> int:
    children: list[ChildGroup] = []
    with contextlib.ExitStack() as resources:
        try:
            workers = start_workers(config, model_dir, cpu_mode, resources, children)
            for worker in workers:
                wait_until_healthy(worker.child, worker.url, config.startup_timeout, signals.event)
            if signals.event.is_set():
                return 0
            for worker in workers:
                freeze_gc(worker.url, config.api_key)  # the workers' admin routes take the API key
            router_port, metrics_port = free_loopback_ports(2)
            router_url = f"http://{LOOPBACK_HOST}:{router_port}"
            urls = [w.url for w in workers]
            router = ChildGroup("the router", router_command(config, urls, router_port, metrics_port))
            children.append(router)
            wait_until_routed(router, router_url, urls, config.control_key, config.startup_timeout, signals.event)
            if signals.event.is_set():
                return 0
            # Closed after stop_all (below), so the requests in flight drain through it.
            resources.callback(open_public_port(config, router_port).close)
            resources.callback(serve_stats(config, workers).close)
            log_serving(config, workers, metrics_port)
            return supervise(workers, router, router_url, config.control_key, signals)
        finally:
            stop_all(children)
            log("stopped")


def log_serving(config: LaunchConfig, workers: list[Worker], metrics_port: int) -> None:
    router_url = f"http://{config.host}:{config.port}"
    for worker in workers:
        log(f"{worker.name}: {STATS_ROUTE} at {worker.url}{STATS_ROUTE}")
    log(
        f"serving {config.model} with {len(workers)} workers behind the cache-aware router at {router_url} "
        f"(OpenAI API at {router_url}/v1, {config.serving.describe()}; all workers' {STATS_ROUTE} at "
        f"http://{config.host}:{config.stats_port}{STATS_ROUTE}; router metrics at "
        f"http://{LOOPBACK_HOST}:{metrics_port}/metrics)"
    )
