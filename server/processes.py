"""Child processes of the launcher: each in its own process group, health polling, signal handling.

Every child (an SGLang server, the router) runs in a session of its own, so stopping it ends with one
``killpg`` of a group this process owns, whatever state the child's own processes are in. Before
that, the child's main process alone gets SIGTERM and the grace period to drain: SGLang's HTTP
process finishes the requests in flight, then stops its scheduler and detokenizer; the router waits
for the requests it forwarded. A SIGTERM to the whole group would kill SGLang's scheduler at once
and fail every request in flight.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Optional

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


def free_loopback_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (the kernel's picks; held open together so they
    differ). Another process could take one before its server binds it: that server then fails to
    start and the launcher reports it."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def authorization(key: Optional[str]) -> dict[str, str]:
    """The request headers that present ``key`` (none without one)."""
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def freeze_gc(base_url: str, key: Optional[str]) -> None:
    """Ask a healthy SGLang server to freeze its processes' garbage collectors (``POST /freeze_gc``, an
    admin route: ``key`` is the admin key or the API key). SGLang asks this of itself after its warm-up,
    but with ``--skip-server-warmup`` (the CPU default) it asks before its HTTP server listens and the
    call often fails; unfrozen, every full collection walks the whole heap, and at shutdown the HTTP
    process took 10-20 s to exit instead of 1-2 (docs/deployment.md)."""
    request = urllib.request.Request(f"{base_url}/freeze_gc", data=b"", method="POST", headers=authorization(key))
    try:
        with urllib.request.urlopen(request, timeout=30):
            pass
    except (urllib.error.URLError, OSError) as error:
        log(f"could not freeze the garbage collector of {base_url} ({error}); serving anyway")


def is_healthy(base_url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class ChildGroup:
    """A child process in its own session; ``name`` says what it is in the launcher's log."""

    def __init__(self, name: str, command: list[str], env: Optional[dict[str, str]] = None):
        self.name = name
        self.process = subprocess.Popen(command, env=env, start_new_session=True)
        self._terminated = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_code(self) -> Optional[int]:
        return self.process.poll()

    def terminate(self) -> None:
        """SIGTERM to the main process only (once): it drains, then stops its own children."""
        if not self._terminated and self.process.poll() is None:
            self._terminated = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """``terminate``, then SIGKILL to whatever is left of the group once the main process exited or
        the grace period ran out."""
        self.terminate()
        try:
            self.process.wait(timeout=SHUTDOWN_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            log(f"{self.name} did not exit within {SHUTDOWN_GRACE_SECONDS:.0f} s of SIGTERM; killing it")
        # An SGLang server's scheduler and detokenizer may outlive its main process: clear the group.
        self.signal_group(signal.SIGKILL)
        self.process.wait()

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


def stop_all(children: list[ChildGroup]) -> None:
    """SIGTERM every child at once (the router and the workers drain together: every request the router
    waits for is one a worker finishes), then stop each in turn."""
    for child in children:
        child.terminate()
    for child in children:
        child.stop()


def wait_until_healthy(child: ChildGroup, base_url: str, timeout: float, stop: threading.Event) -> None:
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        code = child.exit_code()
        if code is not None:
            raise StartupError(f"{child.name} exited with code {code} before becoming healthy (its log is above)")
        if is_healthy(base_url):
            return
        if time.monotonic() > deadline:
            raise StartupError(f"{child.name} was not healthy after {timeout:.0f} s (--startup-timeout)")
        stop.wait(HEALTH_POLL_SECONDS)


class StopSignals:
    """SIGINT/SIGTERM set ``event``; ``name`` is the first signal's name once one arrived."""

    def __init__(self):
        self.event = threading.Event()
        self.received: list[int] = []
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.received.append(signum)
        self.event.set()

    @property
    def name(self) -> str:
        return signal.Signals(self.received[0]).name
