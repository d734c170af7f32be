"""The launcher: validate, resolve the model, start SGLang in its own process group, wait until it is
healthy, and take the whole group down on SIGINT/SIGTERM. With ``--workers N`` above 1 it starts N
such servers behind SGLang's cache-aware router instead (``scale_out``).

SGLang runs as a child (``sgl_kvevict.server.sglang_entry``) rather than in this process so that
shutdown is one ``killpg`` of a session this process owns, whatever state SGLang's own processes
are in, and so that bad flags and a missing model are reported before any of SGLang is imported.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from sgl_kvevict.architectures import local_attention_layers
from sgl_kvevict.limits import UnsupportedVersion, check_sglang_version
from sgl_kvevict.models import ModelError, model_kv_heads, resolve_model
from sgl_kvevict.scoring.learned import resolve_learned_weights
from sgl_kvevict.server import scale_out
from sgl_kvevict.server.flags import LaunchConfig, parse_args
from sgl_kvevict.server.processes import (
    ChildGroup,
    StartupError,
    StopSignals,
    check_port_free,
    freeze_gc,
    log,
    wait_until_healthy,
)
from sgl_kvevict.server.refusals import (
    FlagError,
    check_chunked_prefill,
    check_cpu_graphs,
    check_environment,
    check_local_layers,
    check_model_architecture,
    check_tensor_parallel,
)
from sgl_kvevict.server.sglang_args import LOCAL_LAYER_DEFAULTS, defaults_not_given, flag_value, tp_size
from sgl_kvevict.server.worker import (
    THREADS_BIND_ENV_VAR,
    server_env,
    sglang_args,
    sglang_command,
    stats_socket_address,
    threads_bind,
)
from sgl_kvevict.serving import ServingConfig
from sgl_kvevict.settings import ConfigError


def run_single(config: LaunchConfig, model_dir: Path, cpu_mode: bool, signals: StopSignals) -> int:
    base_url = f"http://{config.host}:{config.port}"
    command = sglang_command(config, str(model_dir), cpu_mode)
    with stats_socket_address(config.serving.enabled) as stats_address:
        server = ChildGroup("SGLang", command, server_env(config, cpu_mode, stats_address))
        try:
            wait_until_healthy(server, base_url, config.startup_timeout, signals.event)
            if not signals.event.is_set():
                freeze_gc(base_url, config.control_key)
                log(f"serving {config.model} at {base_url} (OpenAI API at {base_url}/v1, {config.serving.describe()})")
            while not signals.event.is_set() and server.exit_code() is None:
                signals.event.wait(1.0)
            if not signals.event.is_set():
                code = server.exit_code()
                log(f"SGLang exited with code {code}{exit_reason(code)}")
                return code or 1
            log(f"received {signals.name}, shutting down")
            return 0
        finally:
            server.stop()
            log("stopped")


def exit_reason(code: int) -> str:
    """Why SGLang's main process went, where its exit code alone does not say."""
    if code >= 0:
        return ""
    return (
        f" (killed by signal {-code}: SGLang ends all its processes when one fails, a scheduler or TP rank"
        " for instance; the failure is in the log above)"
    )


def with_learned_weights(config: LaunchConfig, model_dir: Path) -> LaunchConfig:
    """A learned score needs weights for this model: the bundled ones (found by the model's fingerprint)
    or the given ones, checked against it here, before SGLang starts; the engine gets the path."""
    eviction = config.serving.eviction
    if eviction is None:
        return config
    try:
        weights = resolve_learned_weights(eviction.score_knobs, model_dir)
    except ConfigError as error:
        raise FlagError(f"--kv-evict-score learned: {error}") from None
    if weights is None:
        return config
    options = {**config.serving.eviction_options, "learned_weights": str(weights)}
    return dataclasses.replace(config, serving=dataclasses.replace(config.serving, eviction_options=options))


def advise_block_size(serving: ServingConfig, model_dir: Path) -> None:
    """Gemma 3's local layers keep the last ``sliding_window`` positions of every block (``local_layers.py``):
    a block not much longer than that saves nothing there, so say which size would."""
    local = local_attention_layers(model_dir)
    block_size = getattr(serving.scope, "block_size", None)
    if local is not None and block_size is not None and block_size < 2 * local[1]:
        log(
            f"--kv-evict-block-size {block_size}: this model's local layers keep the last {local[1]} positions of "
            f"each block, so they save little at this size; --kv-evict-block-size {4 * local[1]} keeps a quarter there"
        )


def with_local_layer_defaults(config: LaunchConfig, model_dir: Path, cpu_mode: bool) -> LaunchConfig:
    """A model with local layers served with a policy on CUDA: ``LOCAL_LAYER_DEFAULTS`` for the flags the user
    left unset, said in the log (``check_local_layers`` refused other values)."""
    if cpu_mode or local_attention_layers(model_dir) is None:
        return config
    added = defaults_not_given(config.sglang_args, LOCAL_LAYER_DEFAULTS)
    if added:
        log(f"{' '.join(added)}: this model's local attention layers are windowed eagerly (no decode CUDA graphs)")
    return dataclasses.replace(config, sglang_args=[*config.sglang_args, *added])


def run(config: LaunchConfig) -> int:
    from sgl_kvevict.compat import cpu_mode_needed  # imports torch

    check_sglang_version()
    check_port_free(config.host, config.port)
    cpu_mode = cpu_mode_needed()
    # Every flag SGLang will get (with_learned_weights below changes eviction options, not these).
    launched_args = sglang_args(config, cpu_mode)
    if config.serving.enabled:
        # Again with the flags this machine adds: CPU mode chooses the chunk when the user did not.
        check_chunked_prefill(config.serving, launched_args)
        check_cpu_graphs(config.serving, launched_args, cpu_mode)
        check_environment(config.serving, os.environ)
    if config.workers > 1:
        scale_out.check_prerequisites(config)
    model_dir = resolve_model(config.model, log=log)
    tp = tp_size(launched_args)
    if config.serving.enabled:
        check_model_architecture(model_dir)
        check_local_layers(model_dir, launched_args)
        config = with_local_layer_defaults(config, model_dir, cpu_mode)
        check_tensor_parallel(tp, model_kv_heads(model_dir), cpu_mode)
        advise_block_size(config.serving, model_dir)
    config = with_learned_weights(config, model_dir)
    if config.workers > 1:
        scale_out.check_capacity(config, model_dir, cpu_mode)
    if cpu_mode:
        dtype = flag_value(launched_args, "--dtype")
        log(f"no CUDA device: CPU development mode (torch_native attention, sgl_kernel stand-in, --dtype {dtype})")
    bind = threads_bind(config, cpu_mode)
    if bind is not None:
        log(f"--tp-size {tp} on CPU: {THREADS_BIND_ENV_VAR}={bind} (the cores of each rank, '|' between ranks)")
    signals = StopSignals()
    if config.workers > 1:
        return scale_out.run(config, model_dir, cpu_mode, signals)
    return run_single(config, model_dir, cpu_mode, signals)


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
        return run(config)
    except (FlagError, ModelError, StartupError, UnsupportedVersion) as error:
        log(f"error: {error}")
        return 2
