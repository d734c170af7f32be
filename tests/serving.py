"""Start the real launcher (``python -m sgl_kvevict.server``) for a test and always stop it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import psutil

from sgl_kvevict.server.sglang_args import flag_value
from sgl_kvevict.server.processes import authorization

STARTUP_TIMEOUT_SECONDS = 300
STOP_TIMEOUT_SECONDS = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "sgl_kvevict.server", *args]


def error_lines(output: str) -> list[str]:
    """The launcher's error lines in its output."""
    return [line for line in output.splitlines() if "error:" in line]


@dataclass
class RunningServer:
    """api_key, admin_api_key: the keys the server was started with; requests present them."""

    base_url: str
    process: subprocess.Popen
    log_path: Path
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def headers(self, admin: bool = False) -> dict[str, str]:
        """JSON and the key of a normal route, or with ``admin`` of an admin route (SGLang's rule)."""
        key = (self.admin_api_key or self.api_key) if admin else self.api_key
        return {"Content-Type": "application/json", **authorization(key)}

    def post(self, path: str, payload: dict, timeout: float = 300) -> dict:
        request = urllib.request.Request(self.base_url + path, data=json.dumps(payload).encode(), headers=self.headers())
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def chat(self, messages: list[dict], max_tokens: int = 8) -> dict:
        return self.post(
            "/v1/chat/completions",
            {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0},
        )


def _wait_for_serving_line(process: subprocess.Popen, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "] serving " in log_path.read_text(errors="replace"):
            return
        if process.poll() is not None:
            raise RuntimeError(f"launcher exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.5)
    raise TimeoutError(f"server not serving after {timeout:.0f} s:\n{log_path.read_text()[-4000:]}")


def stop_launcher(process: subprocess.Popen) -> int:
    """SIGTERM the launcher (it stops SGLang), then check that every process it started is gone."""
    descendants = psutil.Process(process.pid).children(recursive=True) if process.poll() is None else []
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=STOP_TIMEOUT_SECONDS)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    _, alive = psutil.wait_procs(descendants, timeout=STOP_TIMEOUT_SECONDS)
    for leftover in alive:
        leftover.kill()
    if alive:
        raise AssertionError(f"processes left behind by the server: {[p.pid for p in alive]}")
    return code


@contextlib.contextmanager
def running_server(
    model: str | Path, tmp_path: Path, *extra: str, startup_timeout: float = STARTUP_TIMEOUT_SECONDS
) -> Iterator[RunningServer]:
    """The launcher in its own session (so a test can account for every process it started)."""
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            launcher_command("--model", str(model), "--port", str(port), *extra),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for_serving_line(process, log_path, startup_timeout)
        keys = flag_value(list(extra), "--api-key"), flag_value(list(extra), "--admin-api-key")
        yield RunningServer(f"http://127.0.0.1:{port}", process, log_path, *keys)
    finally:
        stop_launcher(process)
