"""Start the real launcher (``python -m sgl_kvevict.server``) for a test and always stop it."""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from sgl_kvevict.server.processes import ChildExited, LeftBehind, NotReady, authorization, free_port, serving_launcher
from sgl_kvevict.server.processes import launcher_command  # noqa: F401  (the tests run the launcher with it)
from sgl_kvevict.server.sglang_args import flag_value

STARTUP_TIMEOUT_SECONDS = 300
STOP_TIMEOUT_SECONDS = 60


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


@contextlib.contextmanager
def running_server(
    model: str | Path,
    tmp_path: Path,
    *extra: str,
    startup_timeout: float = STARTUP_TIMEOUT_SECONDS,
    port: Optional[int] = None,
) -> Iterator[RunningServer]:
    """The launcher in its own session (``serving_launcher``: a test accounts for every process it
    started) on ``port`` (a free one by default); a failed start raises with the end of its log."""
    port = port or free_port()
    log_path = tmp_path / f"server-{port}.log"
    argv = ["--model", str(model), "--port", str(port), *extra]
    try:
        with serving_launcher(argv, log_path, startup_timeout, STOP_TIMEOUT_SECONDS) as child:
            keys = flag_value(list(extra), "--api-key"), flag_value(list(extra), "--admin-api-key")
            yield RunningServer(f"http://127.0.0.1:{port}", child.process, log_path, *keys)
        if child.killed:
            raise AssertionError(f"the launcher did not exit within {STOP_TIMEOUT_SECONDS} s of SIGTERM")
    except ChildExited as exited:
        raise RuntimeError(f"launcher exited with {exited.code}:\n{log_path.read_text()[-4000:]}") from None
    except NotReady:
        raise TimeoutError(f"server not serving after {startup_timeout:.0f} s:\n{log_path.read_text()[-4000:]}") from None
    except LeftBehind as left:
        raise AssertionError(str(left)) from None
