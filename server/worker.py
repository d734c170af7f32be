"""One SGLang server as the launcher starts it: its command line (the user's SGLang flags plus the
launcher's additions) and its environment (the serving config, the stats socket, CPU threads)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from typing import Iterator, Optional

from sgl_kvevict.engine.stats_channel import ADDRESS_ENV_VAR as STATS_ADDRESS_ENV_VAR
from sgl_kvevict.server.flags import LaunchConfig
from sgl_kvevict.server.sglang_args import compression_args, cpu_mode_args, has_flag, tp_size
from sgl_kvevict.serving import ENV_VAR as SERVING_ENV_VAR

THREADS_BIND_ENV_VAR = "SGLANG_CPU_OMP_THREADS_BIND"


def sglang_args(config: LaunchConfig, cpu_mode: bool) -> list[str]:
    """Every SGLang flag one server gets, the launcher's additions included (not host, port, model)."""
    args = list(config.sglang_args)
    if config.serving.enabled:
        args = compression_args(args, cpu_mode, getattr(config.serving.scope, "block_size", None))
    if cpu_mode:
        args += cpu_mode_args(args)
    if not has_flag(args, "--enable-cache-report"):
        args.append("--enable-cache-report")
    for flag, key in (("--api-key", config.api_key), ("--admin-api-key", config.admin_api_key)):
        if key is not None:
            args += [flag, key]
    return args


def sglang_command(
    config: LaunchConfig, model_dir: str, cpu_mode: bool, host: Optional[str] = None, port: Optional[int] = None
) -> list[str]:
    """The SGLang server's command line, on ``host``/``port`` (default: the launcher's own)."""
    return [
        sys.executable, "-m", "sgl_kvevict.server.sglang_entry", "--model-path", model_dir,
        "--host", host or config.host, "--port", str(port or config.port), *sglang_args(config, cpu_mode),
    ]  # fmt: skip


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


def threads_bind(config: LaunchConfig, cpu_mode: bool) -> Optional[str]:
    """CPU mode with several TP ranks: the cores of each rank, ``SGLANG_CPU_OMP_THREADS_BIND`` (SGLang
    refuses more ranks than NUMA nodes without it). The user's own value wins; else this process's
    cores in ``--tp-size`` contiguous groups, shared round-robin when ranks outnumber cores."""
    tp = tp_size(config.sglang_args)
    if not cpu_mode or tp == 1:
        return None
    if os.environ.get(THREADS_BIND_ENV_VAR):
        return os.environ[THREADS_BIND_ENV_VAR]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        groups = [[cores[rank % len(cores)]] for rank in range(tp)]
    else:
        size = len(cores) // tp
        groups = [cores[rank * size : (rank + 1) * size] for rank in range(tp)]
    return "|".join(",".join(str(core) for core in group) for group in groups)


def server_env(config: LaunchConfig, cpu_mode: bool, stats_address: Optional[str]) -> dict[str, str]:
    env = dict(os.environ)
    if cpu_mode:
        # With two threads and the other core busy, decode fell from 7 to 0.7 tokens/s here.
        env.setdefault("OMP_NUM_THREADS", "1")
    bind = threads_bind(config, cpu_mode)
    if bind is not None:
        env[THREADS_BIND_ENV_VAR] = bind
    env[SERVING_ENV_VAR] = config.serving.to_env()
    env.pop(STATS_ADDRESS_ENV_VAR, None)
    if stats_address is not None:
        env[STATS_ADDRESS_ENV_VAR] = stats_address
    return env
