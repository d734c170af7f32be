"""Start the real launcher (``python -m sgl_kvevict.server``) for one benchmark run, and stop it
with proof that nothing is left: every process it started has exited and its port is free again.

Servers run one at a time on 127.0.0.1: two SGLang servers on a 2-core machine would measure each
other. Server variants are checked with the launcher's own flag validation before anything starts,
so a policy the launcher does not serve yet is refused with the launcher's message, not after a
half-finished comparison.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from sgl_kvevict.engine.deferred import COMPRESS_WHEN, PREFILL, PRESSURE
from sgl_kvevict.server.flags import FlagError, LaunchConfig, parse_args
from sgl_kvevict.server.processes import (
    ChildExited,
    ChildGroup,
    LeftBehind,
    NotReady,
    free_port,
    port_is_free,
    serving_launcher,
)

VANILLA_POLICY = "none"
# The plugin's path with nothing evicted: every speed comparison with stock serves it too, so a policy's
# ratio splits into what eviction buys (policy / full) and what the path costs (full / stock).
FULL_POLICY = "full"
WHEN_FLAG = "--kv-evict-when"
STOP_TIMEOUT_SECONDS = 90.0  # the launcher's own SIGTERM grace is 30 s, SGLang needs ~10 s
# What SGLang's idle self-check logs (as a warning, unless strict mode is on) when a pool leaks.
LEAK_LOG_PATTERN = re.compile(r"memory leak detected|use-after-free")


class ServerError(RuntimeError):
    """A server could not be started, or did not stop cleanly; the message says which and why."""


@dataclass(frozen=True)
class ServerVariant:
    """What the server runs: ``policy`` none is vanilla SGLang; otherwise ``name[:score]`` at ``budget``
    (``topk:kvzip`` is ``--kv-evict-policy topk --kv-evict-score kvzip``), plus ``extra`` launcher flags
    of this variant only (e.g. ``--kv-evict-scope block --kv-evict-block-size 256``), named by ``tag``."""

    policy: str
    budget: Optional[str] = None
    extra: tuple[str, ...] = ()
    tag: str = ""

    @property
    def is_vanilla(self) -> bool:
        return self.policy == VANILLA_POLICY

    @property
    def is_full(self) -> bool:
        return self.policy == FULL_POLICY

    @property
    def full_counterpart(self) -> "ServerVariant":
        """``full`` with this variant's scope, schedule and other flags: its reference with nothing evicted
        (whenever it compresses: ``full`` evicts nothing, so it is the same server under pressure)."""
        extra = list(self.extra)
        if WHEN_FLAG in extra:
            at = extra.index(WHEN_FLAG)
            del extra[at : at + 2]
        tag = " ".join(word for word in self.tag.split() if word != PRESSURE)
        return ServerVariant(FULL_POLICY, None, tuple(extra), tag)

    @property
    def label(self) -> str:
        base = "vanilla" if self.is_vanilla else f"{self.policy}@{self.budget}" if self.budget else self.policy
        return f"{base} {self.tag}" if self.tag else base

    def launcher_flags(self) -> list[str]:
        name, _, score = self.policy.partition(":")
        flags = ["--kv-evict-policy", name] + (["--kv-evict-score", score] if score else [])
        return flags + (["--kv-evict-budget", self.budget] if self.budget is not None else []) + list(self.extra)

    @classmethod
    def from_json(cls, fields: dict) -> "ServerVariant":
        """A variant as a result file holds it (``asdict``: ``extra`` a list)."""
        return cls(**{**fields, "extra": tuple(fields.get("extra", ()))})

    @classmethod
    def from_flags(cls, label: str, flags: Sequence[str]) -> "ServerVariant":
        """A variant given as launcher flags (``--kv-evict-policy`` among them, or stock), named ``label``."""
        flags = list(flags)
        if "--kv-evict-policy" not in flags:
            return cls(VANILLA_POLICY, None, tuple(flags), label)
        at = flags.index("--kv-evict-policy")
        return cls(flags[at + 1], None, tuple(flags[:at] + flags[at + 2 :]), label)

    @classmethod
    def block_scope(cls, policy: str, budget: Optional[str], block_size: Optional[int]) -> "ServerVariant":
        """``policy`` in block scope (the launcher's default block size when ``block_size`` is None)."""
        size = [] if block_size is None else ["--kv-evict-block-size", str(block_size)]
        tag = "block" if block_size is None else f"block {block_size}"
        return cls(policy, budget, ("--kv-evict-scope", "block", *size), tag)


SCOPES = ("request", "block")


def check_lineup(
    labels: Sequence[str], starts_with_baseline: bool, error: Callable[[str], Exception], not_first: str, repeated: str
) -> None:
    """The servers of a comparison: the baseline first (``not_first`` otherwise: ratios are against it),
    no label twice (``repeated: [labels]``)."""
    if not starts_with_baseline:
        raise error(not_first)
    if len(set(labels)) != len(labels):
        raise error(f"{repeated}: {list(labels)}")


def server_variants(
    policies: Sequence[str], budgets: Sequence[str], scopes: Sequence[str] = ("request",), block_size: Optional[int] = None,
    whens: Sequence[str] = (PREFILL,),
) -> tuple[ServerVariant, ...]:  # fmt: skip
    """Vanilla, then every policy (``name[:score]``) at every budget in every scope, compressing at every
    ``whens`` (``--kv-evict-when``: under ``pressure`` tagged so)."""
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown or not scopes:
        raise ServerError(f"scopes {list(scopes)}: choose from {', '.join(SCOPES)}")
    if block_size is not None and "block" not in scopes:
        raise ServerError("a block size applies to block scope only: add the block scope")
    unknown = [when for when in whens if when not in COMPRESS_WHEN]
    if unknown or not whens:
        raise ServerError(f"compress when {list(whens)}: choose from {', '.join(COMPRESS_WHEN)}")
    chosen = [
        _compressing(ServerVariant(policy, budget) if scope == "request" else ServerVariant.block_scope(policy, budget, block_size), when)
        for policy in policies
        if policy != VANILLA_POLICY
        for budget in budgets
        for scope in scopes
        for when in whens
    ]
    return (ServerVariant(VANILLA_POLICY),) + tuple(chosen)


def _compressing(variant: ServerVariant, when: str) -> ServerVariant:
    if when == PREFILL:
        return variant
    return ServerVariant(variant.policy, variant.budget, (*variant.extra, WHEN_FLAG, when), f"{variant.tag} {when}".strip())


def attributed_variants(
    policies: Sequence[str], budgets: Sequence[str], scopes: Sequence[str] = ("request",), block_size: Optional[int] = None,
    whens: Sequence[str] = (PREFILL,),
) -> tuple[ServerVariant, ...]:  # fmt: skip
    """``server_variants`` with ``full`` (no budget) in every scope after vanilla, where any policy is
    compared; ``full`` among ``policies`` is that same server, not a second one (nor under pressure: it
    evicts nothing)."""
    chosen = server_variants([p for p in policies if p != FULL_POLICY], budgets, scopes, block_size, whens)
    if len(chosen) == 1 and FULL_POLICY not in policies:  # ``full`` alone: stock vs full in every scope
        return chosen
    return chosen[:1] + server_variants([FULL_POLICY], [None], scopes, block_size)[1:] + chosen[1:]


# SGLang's schedules: its default overlaps a batch's result processing with the next batch's launch.
SCHEDULES = ("overlap", "serial")
SERIAL_SCHEDULE_FLAG = "--disable-overlap-schedule"


def under_schedules(variants: Sequence[ServerVariant], schedules: Sequence[str]) -> tuple[ServerVariant, ...]:
    """Every variant under every schedule, in turn (``serial``: SGLang's ``--disable-overlap-schedule``,
    tagged ``serial``)."""
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown or not schedules:
        raise ServerError(f"schedules {list(schedules)}: choose from {', '.join(SCHEDULES)}")
    return tuple(
        variant if schedule == "overlap"
        else ServerVariant(variant.policy, variant.budget, (*variant.extra, SERIAL_SCHEDULE_FLAG), f"{variant.tag} serial".strip())
        for variant in variants
        for schedule in schedules
    )  # fmt: skip


def launcher_argv(model: str, port: int, variant: ServerVariant, pool_tokens: int, extra: tuple[str, ...]) -> list[str]:
    return [
        "--model", model, "--port", str(port), "--host", "127.0.0.1",
        *variant.launcher_flags(), "--max-total-tokens", str(pool_tokens), *extra,
    ]  # fmt: skip


def check_launcher_accepts(model: str, variant: ServerVariant, pool_tokens: int, extra: tuple[str, ...]) -> LaunchConfig:
    """Run the launcher's own flag validation; raises ServerError with its message."""
    try:
        return parse_args(launcher_argv(model, 1, variant, pool_tokens, extra))
    except FlagError as error:
        raise ServerError(f"the launcher refuses {variant.label}: {error}") from None


@dataclass
class LaunchedServer:
    base_url: str
    child: ChildGroup

    @property
    def process(self) -> subprocess.Popen:
        return self.child.process

    @property
    def log_path(self) -> Path:
        return self.child.log_path

    @property
    def descendants(self) -> list:
        """psutil.Process: every process the launcher ran once it served."""
        return self.child.descendants

    def log_tail(self, chars: int = 3000) -> str:
        return self.child.log_tail(chars)

    def leak_warnings(self) -> list[str]:
        return [line for line in self.child.output().splitlines() if LEAK_LOG_PATTERN.search(line)]

    def is_running(self) -> bool:
        return self.child.exit_code() is None


def _failure_lines(log_path: Path) -> str:
    """The launcher's own error line and the last exception line SGLang logged, if any."""
    lines = log_path.read_text(errors="replace").splitlines()
    launcher = [line for line in lines if line.startswith("[sgl-kvevict] error:")]
    exceptions = [line for line in lines if re.match(r"^\w+(Error|Exception): ", line)]
    return " / ".join(launcher[-1:] + exceptions[-1:]) or "no error line in the log"


def _wait_until_port_free(port: int) -> None:
    deadline = time.monotonic() + 10
    while not port_is_free(port):
        if time.monotonic() > deadline:
            raise ServerError(f"port {port} still taken after the server stopped")
        time.sleep(0.5)


@contextlib.contextmanager
def launched_server(
    model: str,
    variant: ServerVariant,
    pool_tokens: int,
    log_dir: Path,
    extra: tuple[str, ...] = (),
    startup_timeout: float = 600.0,
) -> Iterator[LaunchedServer]:
    """The launcher in its own session (``serving_launcher``), serving until the block ends; always
    stopped and checked (nothing left, its port free again), also when the benchmark gets SIGTERM
    (``sigterm_raises``)."""
    check_launcher_accepts(model, variant, pool_tokens, extra)
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{variant.label.replace(' ', '-')}-{pool_tokens}-{port}.log"
    argv = launcher_argv(model, port, variant, pool_tokens, extra)
    with sigterm_raises():
        try:
            with serving_launcher(argv, log_path, startup_timeout, STOP_TIMEOUT_SECONDS) as child:
                yield LaunchedServer(f"http://127.0.0.1:{port}", child)
        except ChildExited as exited:
            raise ServerError(
                f"the launcher exited with code {exited.code} before serving: {_failure_lines(log_path)} (log: {log_path})"
            ) from None
        except NotReady:
            raise ServerError(f"server not serving after {startup_timeout:.0f} s (log: {log_path})") from None
        except LeftBehind as left:
            raise ServerError(f"processes left behind by the server on port {port}: {left.pids}") from None
        finally:
            _wait_until_port_free(port)


def run_on_server(
    model: str, variant: ServerVariant, pool_tokens: int, log_dir: Path, extra: tuple[str, ...], label: str,
    measure: Callable[[str], dict], fields: dict, describe: Callable[[dict], str], log: Callable[[str], None],
) -> dict:  # fmt: skip
    """A fresh server for ``variant`` (``label`` in the log), ``measure(base_url)`` on it, then stopped;
    the run: the variant, ``fields`` and the figures (``describe`` says them in the log)."""
    log(f"{label}: starting")
    with launched_server(model, variant, pool_tokens, log_dir, extra=extra) as server:
        figures = measure(server.base_url)
    log(f"{label}: {describe(figures)}")
    return {"server": variant.label, "vanilla": variant.is_vanilla, **fields, **figures}


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises ``SystemExit`` inside the block (main thread only; the previous handler after it).

    Python's default SIGTERM ends the process without unwinding, so a ``kill`` of a benchmark left its
    launcher and SGLang running in their own session; raising lets the caller's ``finally`` stop them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_exit(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def sglang_argv(model: str, variant: ServerVariant, pool_tokens: int, extra: tuple[str, ...], cpu_mode: bool) -> list[str]:
    """Every SGLang flag the launcher gives ``variant``'s server (its additions included; not host,
    port, model): what the server runs with, as the launcher would start it on this machine."""
    from sgl_kvevict.models import resolve_model
    from sgl_kvevict.server.launcher import with_local_layer_defaults
    from sgl_kvevict.server.worker import sglang_args

    config = check_launcher_accepts(model, variant, pool_tokens, extra)
    if config.serving.enabled:
        config = with_local_layer_defaults(config, resolve_model(model, log=lambda message: None), cpu_mode)
    return sglang_args(config, cpu_mode)


def check_model_takes(model: str, variant: ServerVariant, pool_tokens: int, extra: tuple[str, ...]) -> None:
    """What the launcher checks of the model before it starts SGLang, for a server with a policy: its
    architecture (sliding-window, MLA, state-space layers are refused), how its local layers can be
    served (Gemma 3: without decode CUDA graphs) and,
    with a learned score, that the weights fit it; raises ServerError with the launcher's message."""
    from sgl_kvevict.compat import cpu_mode_needed
    from sgl_kvevict.models import ModelError, resolve_model
    from sgl_kvevict.server.launcher import with_learned_weights
    from sgl_kvevict.server.refusals import check_local_layers, check_model_architecture
    from sgl_kvevict.server.worker import sglang_args

    config = check_launcher_accepts(model, variant, pool_tokens, extra)
    if not config.serving.enabled:
        return
    try:
        model_dir = resolve_model(model, log=lambda message: None)
        check_model_architecture(model_dir)
        check_local_layers(model_dir, sglang_args(config, cpu_mode_needed()))
        with_learned_weights(config, model_dir)
    except (FlagError, ModelError) as error:
        raise ServerError(f"the launcher refuses {variant.label} for model {model}: {error}") from None
