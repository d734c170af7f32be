"""Child processes of the launcher: each in its own process group, health polling, signal handling.

Every child (an SGLang server, the router) runs in a session of its own, so stopping it ends with one
``killpg`` of a group this process owns, whatever state the child's own processes are in. Before
that, the child's main process alone gets SIGTERM and the grace period to drain: SGLang's HTTP
process finishes the requests in flight, then stops its scheduler and detokenizer; the router waits
for the requests it forwarded. A SIGTERM to the whole group would kill SGLang's scheduler at once
and fail every request in flight.

The same helpers start the launcher itself as a child (``serving_launcher``): the benchmarks and the
tests run it that way, its output in a log file, and check that nothing it started outlives it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

HEALTH_POLL_SECONDS = 0.5
SHUTDOWN_GRACE_SECONDS = 30.0
# The launcher logs this (``[sgl-kvevict] serving ...``) once its server answers ``/health``.
SERVING_LINE = "] serving "


def log(message: str) -> None:
    print(f"[sgl-kvevict] {message}", file=sys.stderr, flush=True)


class StartupError(RuntimeError):
    """The server cannot start; the message is one line."""


class ChildExited(StartupError):
    """The child exited before it was ready; ``code`` is its exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class NotReady(StartupError):
    """The child was still not ready when the start-up timeout ran out."""


class LeftBehind(RuntimeError):
    """Processes a child started were still alive after it stopped (they are killed); ``pids`` says which."""

    def __init__(self, message: str, pids: list[int]):
        super().__init__(message)
        self.pids = pids


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        # The same option uvicorn sets, so a port in TIME_WAIT is not reported as taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            raise StartupError(f"cannot listen on {host}:{port}: {error.strerror}") from None


# Ports are picked below the kernel's ephemeral range, from which bind(0) and every outgoing connection
# take theirs: a port the kernel handed out (the first version of this function) could become a
# client connection's local port before its server bound it, and uvicorn then failed with "address
# already in use" (seen once in a test run). SGLang picks its own internal ports in 22000-29999
# (``get_free_port_below_ephemeral``) and ``make serve`` listens on 30000: both are left out.
PICKED_PORT_RANGES = ((10000, 21999), (30001, 32767))


def ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _loopback_socket_bound_to(port: int) -> Optional[socket.socket]:
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def free_loopback_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (held open together so they differ), drawn at
    random from ``PICKED_PORT_RANGES`` outside the kernel's ephemeral range; the kernel's own picks
    where no draw binds. Another process could still bind one before its server does: that server
    then fails to start and the launcher reports it."""
    ephemeral_low, ephemeral_high = ephemeral_port_range()
    candidates = [port for low, high in PICKED_PORT_RANGES for port in range(low, high + 1)
                  if not ephemeral_low <= port <= ephemeral_high]  # fmt: skip
    # SystemRandom: processes forked from one parent share the ``random`` module's state.
    draws = random.SystemRandom().sample(candidates, min(len(candidates), 64 * count))
    sockets: list[socket.socket] = []
    try:
        for port in draws:
            if len(sockets) == count:
                break
            sock = _loopback_socket_bound_to(port)
            if sock is not None:
                sockets.append(sock)
        while len(sockets) < count:
            sock = socket.socket()
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    """A port free on 127.0.0.1 now (``free_loopback_ports`` of one)."""
    return free_loopback_ports(1)[0]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    try:
        check_port_free(host, port)
    except StartupError:
        return False
    return True


def authorization(key: Optional[str]) -> dict[str, str]:
    """The request headers that present ``key`` (none without one)."""
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def freeze_gc(base_url: str, key: Optional[str]) -> None:
    """Ask a healthy SGLang server to freeze its processes' garbage collectors (``POST /freeze_gc``, an
    admin route: ``key`` is the admin key or the API key). SGLang asks this of itself after its warm-up;
    with ``--skip-server-warmup`` (the CPU default) it would ask before its HTTP server listens, so that
    call is skipped (``engine/adapter/http.py``) and this is the only freeze. Unfrozen, every full
    collection walks the whole heap, and at shutdown the HTTP process took 10-20 s to exit instead of
    1-2 (docs/deployment.md)."""
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
    """A child process in its own session; ``name`` says what it is in the launcher's log. With
    ``log_path`` its stdout and stderr go to that file (created anew), otherwise to ours."""

    def __init__(
        self, name: str, command: list[str], env: Optional[dict[str, str]] = None, log_path: Optional[Path] = None
    ):
        self.name = name
        self.log_path = log_path
        if log_path is None:
            self.process = subprocess.Popen(command, env=env, start_new_session=True)
        else:
            with open(log_path, "wb") as log_file:
                self.process = subprocess.Popen(
                    command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
                )
        self._terminated = False
        # Set by ``stop`` when the main process outlived the grace period and was killed.
        self.killed = False
        self.descendants: list = []  # psutil.Process: what ``remember_descendants`` saw

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_code(self) -> Optional[int]:
        return self.process.poll()

    def output(self) -> str:
        """Its log file so far (empty without one)."""
        return "" if self.log_path is None else self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 3000) -> str:
        return self.output()[-chars:]

    def where_log_is(self) -> str:
        return "its log is above" if self.log_path is None else f"log: {self.log_path}"

    def remember_descendants(self) -> None:
        """Add every process the child runs now to ``descendants`` (``left_behind`` checks them)."""
        import psutil  # SGLang's dependency, not ours: only the benchmarks and the tests call this

        with contextlib.suppress(psutil.NoSuchProcess):
            known = {process.pid for process in self.descendants}
            found = psutil.Process(self.process.pid).children(recursive=True)
            self.descendants += [process for process in found if process.pid not in known]

    def terminate(self) -> None:
        """SIGTERM to the main process only (once): it drains, then stops its own children."""
        if not self._terminated and self.process.poll() is None:
            self._terminated = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self, grace: float = SHUTDOWN_GRACE_SECONDS, quiet: bool = False) -> int:
        """``terminate``, then SIGKILL to whatever is left of the group once the main process exited or
        the ``grace`` period ran out (said in the launcher's log unless ``quiet``); the exit code."""
        self.terminate()
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.killed = True
            if not quiet:
                log(f"{self.name} did not exit within {grace:.0f} s of SIGTERM; killing it")
        # An SGLang server's scheduler and detokenizer may outlive its main process: clear the group.
        self.signal_group(signal.SIGKILL)
        return self.process.wait()

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def left_behind(self, timeout: float) -> list[int]:
        """After ``stop``: the remembered descendants still alive ``timeout`` seconds on (killed now)."""
        import psutil

        _, alive = psutil.wait_procs(self.descendants, timeout=timeout)
        for leftover in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                leftover.kill()
        return [process.pid for process in alive]


def stop_all(children: list[ChildGroup]) -> None:
    """SIGTERM every child at once (the router and the workers drain together: every request the router
    waits for is one a worker finishes), then stop each in turn."""
    for child in children:
        child.terminate()
    for child in children:
        child.stop()


def wait_until_ready(
    child: ChildGroup, ready: Callable[[], bool], timeout: float, stop: Optional[threading.Event] = None
) -> None:
    """Poll ``ready`` until it holds (or ``stop`` is set); ChildExited if the child exits first,
    NotReady once ``timeout`` seconds passed."""
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        code = child.exit_code()
        if code is not None:
            raise ChildExited(f"{child.name} exited with code {code} before becoming healthy ({child.where_log_is()})", code)
        if ready():
            return
        if time.monotonic() > deadline:
            raise NotReady(f"{child.name} was not healthy after {timeout:.0f} s")
        stop.wait(HEALTH_POLL_SECONDS)


def wait_until_healthy(child: ChildGroup, base_url: str, timeout: float, stop: threading.Event) -> None:
    """``wait_until_ready`` for ``base_url``'s ``/health``."""
    try:
        wait_until_ready(child, lambda: is_healthy(base_url), timeout, stop)
    except NotReady as late:
        raise NotReady(f"{late} (--startup-timeout)") from None


def launcher_command(*args: str) -> list[str]:
    """The launcher (``python -m sgl_kvevict.server``) with ``args``, in this Python."""
    return [sys.executable, "-m", "sgl_kvevict.server", *args]


@contextlib.contextmanager
def serving_launcher(
    args: Sequence[str], log_path: Path, startup_timeout: float, stop_timeout: float
) -> Iterator[ChildGroup]:
    """The launcher with ``args`` as a child in its own session, its output in ``log_path``, from the
    moment it logs that it serves (ChildExited, NotReady otherwise) to the end of the block. Then it
    gets SIGTERM and ``stop_timeout`` seconds to stop SGLang, and every process it started must be
    gone ``stop_timeout`` seconds later: LeftBehind (after killing them) if one is not."""
    child = ChildGroup("the launcher", launcher_command(*args), log_path=log_path)
    try:
        wait_until_ready(child, lambda: SERVING_LINE in child.output(), startup_timeout)
        # Everything SGLang started is up by now; remembered so that the stop can prove it all exited.
        child.remember_descendants()
        yield child
    finally:
        if child.exit_code() is None:
            child.remember_descendants()
        child.stop(stop_timeout, quiet=True)
        pids = child.left_behind(stop_timeout)
        if pids:
            raise LeftBehind(f"processes left behind by the server: {pids}", pids)


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
