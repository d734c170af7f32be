"""The launcher: validate, resolve the model, start SGLang in its own process group, wait until it is
healthy, and take the whole group down on SIGINT/SIGTERM.

SGLang runs as a child (``sgl_kvevict.server.sglang_entry``) rather than in this process so that
shutdown is one ``killpg`` of a session this process owns, whatever state SGLang's own processes
are in, and so that bad flags and a missing model are reported before any of SGLang is imported.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Iterator, Optional

from sgl_kvevict.engine.stats_channel import ADDRESS_ENV_VAR as STATS_ADDRESS_ENV_VAR
from sgl_kvevict.models import ModelError, resolve_model
from sgl_kvevict.serving import ENV_VAR as SERVING_ENV_VAR
from sgl_kvevict.server.flags import (
    FlagError,
    LaunchConfig,
    check_attention_backend,
    compression_args,
    cpu_mode_args,
    has_flag,
    parse_args,
)

HEALTH_POLL_SECONDS = 0.5
SHUTDOWN_GRACE_SECONDS = 30.0


def log(message: str) -> None:
    print(f"[sgl-kvevict] {message}", file=sys.stderr, flush=True)


class StartupError(RuntimeError):
    """The server cannot start; the message is one line."""


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        # The same option uvicorn sets, so a port in TIME_WAIT is not reported as taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            raise StartupError(f"cannot listen on {host}:{port}: {error.strerror}") from None


def sglang_command(config: LaunchConfig, model_dir: str, cpu_mode: bool) -> list[str]:
    args = list(config.sglang_args)
    if config.serving.enabled:
        args = compression_args(args, cpu_mode)
    if cpu_mode:
        args += cpu_mode_args(args)
    if not has_flag(args, "--enable-cache-report"):
        args.append("--enable-cache-report")
    return [
        sys.executable, "-m", "sgl_kvevict.server.sglang_entry",
        "--model-path", model_dir, "--host", config.host, "--port", str(config.port), *args,
    ]  # fmt: skip


def is_healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class ServerProcess:
    """The SGLang child and its process group."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.process = subprocess.Popen(command, env=env, start_new_session=True)

    def exit_code(self):
        return self.process.poll()

    def stop(self) -> None:
        """SIGTERM to the whole group, then SIGKILL to whatever is left after the grace period."""
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout=SHUTDOWN_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            log(f"SGLang did not exit within {SHUTDOWN_GRACE_SECONDS:.0f} s of SIGTERM; killing it")
        # Scheduler and detokenizer may outlive the main SGLang process: clear the group either way.
        self._signal_group(signal.SIGKILL)
        self.process.wait()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


def wait_until_healthy(server: ServerProcess, base_url: str, timeout: float, stop: threading.Event) -> None:
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        code = server.exit_code()
        if code is not None:
            raise StartupError(f"SGLang exited with code {code} before becoming healthy (its log is above)")
        if is_healthy(base_url):
            return
        if time.monotonic() > deadline:
            raise StartupError(f"SGLang was not healthy after {timeout:.0f} s (--startup-timeout)")
        stop.wait(HEALTH_POLL_SECONDS)


@contextlib.contextmanager
def stats_socket_address(enabled: bool) -> Iterator[Optional[str]]:
    """An ``ipc://`` address in a private directory that exists while the server runs (None without a
    policy: nothing serves stats then). The scheduler binds it; the directory goes at shutdown, with
    the socket file a killed scheduler leaves behind."""
    if not enabled:
        yield None
        return
    directory = tempfile.mkdtemp(prefix="sgl-kvevict-")
    try:
        yield f"ipc://{directory}/stats.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def server_env(config: LaunchConfig, cpu_mode: bool, stats_address: Optional[str]) -> dict[str, str]:
    env = dict(os.environ)
    if cpu_mode:
        # With two threads and the other core busy, decode fell from 7 to 0.7 tokens/s here.
        env.setdefault("OMP_NUM_THREADS", "1")
    env[SERVING_ENV_VAR] = config.serving.to_env()
    env.pop(STATS_ADDRESS_ENV_VAR, None)
    if stats_address is not None:
        env[STATS_ADDRESS_ENV_VAR] = stats_address
    return env


def run(config: LaunchConfig) -> int:
    from sgl_kvevict.compat import cpu_mode_needed

    check_port_free(config.host, config.port)
    cpu_mode = cpu_mode_needed()
    if config.serving.enabled:
        check_attention_backend(config.sglang_args, cpu_mode)
    model_dir = resolve_model(config.model, log=log)
    if cpu_mode:
        log("no CUDA device: CPU development mode (torch_native attention, sgl_kernel stand-in)")

    stop = threading.Event()
    received: list[int] = []

    def request_stop(signum, _frame):
        received.append(signum)
        stop.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)

    base_url = f"http://{config.host}:{config.port}"
    command = sglang_command(config, str(model_dir), cpu_mode)
    with stats_socket_address(config.serving.enabled) as stats_address:
        server = ServerProcess(command, server_env(config, cpu_mode, stats_address))
        try:
            wait_until_healthy(server, base_url, config.startup_timeout, stop)
            if not stop.is_set():
                log(f"serving {config.model} at {base_url} (OpenAI API at {base_url}/v1, {config.serving.describe()})")
            while not stop.is_set() and server.exit_code() is None:
                stop.wait(1.0)
            if not stop.is_set():
                code = server.exit_code()
                log(f"SGLang exited with code {code}")
                return code or 1
            log(f"received {signal.Signals(received[0]).name}, shutting down")
            return 0
        finally:
            server.stop()
            log("stopped")


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
        return run(config)
    except (FlagError, ModelError, StartupError) as error:
        log(f"error: {error}")
        return 2
