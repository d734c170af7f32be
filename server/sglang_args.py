"""SGLang's argument list as the launcher sees and extends it: reading a flag, and the flags the
launcher adds (CPU development mode, compression), each only when the user did not pass it.

The added flags are data (``CPU_MODE_DEFAULTS``, ``COMPRESSION_DEFAULTS``), so ``--help`` and the
flag table of docs/flags.md print exactly what the launcher passes.
"""

from __future__ import annotations

from typing import Optional

from sgl_kvevict.serving import RADIX_CACHE_BACKEND

# KV pool on CPU when the user sizes nothing: SGLang would otherwise take ~70% of free RAM (15 GB
# for SmolLM2 here, 45 s just to zero it). 65,536 tokens of SmolLM2 in bf16 are 1.5 GB.
CPU_DEFAULT_MAX_TOTAL_TOKENS = 65536
# SGLang derives this fraction by reserving activation memory for max_prefill_tokens, which on a CPU
# machine can exceed its RAM and make the fraction negative. On CPU --max-total-tokens sizes the pool;
# this only caps it.
CPU_MEM_FRACTION_STATIC = 0.5
# Prefill chunk on CPU: SGLang picks one from GPU memory on CUDA (2048 below 20 GB,
# arg_groups/memory_hook.py) and none on CPU. Measured on CPU (docs/results/chunked_prefill.md, 4K-token
# prompt, TTFT against one forward): stock's torch_native extend pads each chunk's queries to the whole
# prompt, so stock pays x1.26 at 2048 and x2.13 at 512 and keeps SGLang's 2048; the engine's backend does
# not pad (x1.14 at 512), and 512-token chunks let block scope serve a 7.5K-token prompt in a
# 3000-token pool (a block and a chunk are dense at once); KVzip's passes are fed in pieces of a chunk.
CPU_CHUNKED_PREFILL_SIZE = 2048
CPU_POLICY_CHUNKED_PREFILL_SIZE = 512
# SGLang runs a waiting prefill before any decode, so a chunked prompt's chunks run back to back and
# running requests still wait for the whole prefill; one decode round after each prefill forward
# bounds their wait by one chunk (measured: longest gap 5.9 s against 54 s unchunked for a 7K prompt).
CPU_PREFILL_DECODE_INTERVAL = 1

Defaults = tuple[tuple[str, tuple[str, ...]], ...]

CPU_MODE_DEFAULTS: Defaults = (
    ("--device", ("cpu",)),
    ("--attention-backend", ("torch_native",)),
    ("--cuda-graph-backend-decode", ("disabled",)),
    ("--cuda-graph-backend-prefill", ("disabled",)),
    ("--page-size", ("1",)),
    ("--skip-server-warmup", ()),
    ("--chunked-prefill-size", (str(CPU_CHUNKED_PREFILL_SIZE),)),
    ("--prefill-decode-interval", (str(CPU_PREFILL_DECODE_INTERVAL),)),
    # An idle scheduler polls its sockets in a busy loop: one core at 100% per idle server, half of a
    # 2-core machine taken from the server (or the client, or the other worker) that has work.
    ("--sleep-on-idle", ()),
)

# What compression needs (sgl_kvevict.limits), for the flags the user left unset; conflicting values
# are refused before this list is applied.
COMPRESSION_DEFAULTS: Defaults = (
    ("--page-size", ("1",)),
    ("--cuda-graph-backend-prefill", ("disabled",)),
)


# What a model with local layers (Gemma 3) needs with a policy on CUDA, for the flags the user left unset
# (limit "decode graphs with local layers"); in CPU mode decode graphs are off already.
LOCAL_LAYER_DEFAULTS: Defaults = (("--cuda-graph-backend-decode", ("disabled",)),)


# The SGLang flags that decide which kernels a forward runs and how it rounds: a stock server compared
# with a compressing one gets the compressing one's (sgl_kvevict.evaluate), so that `full` against stock
# measures the plugin's path, not another attention backend or prefill chunk.
NUMERICS_FLAGS = (
    "--attention-backend",
    "--chunked-prefill-size",
    "--page-size",
    "--cuda-graph-backend-prefill",
    "--cuda-graph-backend-decode",
    "--dtype",
)


def numerics_args(args: list[str]) -> list[str]:
    """The ``NUMERICS_FLAGS`` that ``args`` sets, with their values (``--flag value`` each)."""
    return [item for flag in NUMERICS_FLAGS if (value := flag_value(args, flag)) is not None for item in (flag, value)]


def has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def flag_value(args: list[str], flag: str) -> Optional[str]:
    """The value of the last occurrence of ``flag`` (what argparse keeps); None for a switch or absent."""
    value = None
    for index, arg in enumerate(args):
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        elif arg == flag:
            following = args[index + 1] if index + 1 < len(args) else None
            # A negative number is a value (--chunked-prefill-size -1), another flag is not.
            value = None if following is None or following.startswith("--") else following
    return value


def int_flag_value(args: list[str], flag: str) -> Optional[int]:
    """``flag_value`` as an int; None where absent or not a number (SGLang's own parser reports that)."""
    value = flag_value(args, flag)
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def defaults_not_given(sglang_args: list[str], defaults: Defaults) -> list[str]:
    return [item for flag, values in defaults if not has_flag(sglang_args, flag) for item in (flag, *values)]


def render_defaults(defaults: Defaults) -> str:
    """``--device cpu --skip-server-warmup ...``: the flags as the launcher passes them."""
    return " ".join(" ".join((flag, *values)) for flag, values in defaults)


# CPU instructions that multiply bf16 natively. Without them torch emulates bf16 matmuls: measured on an
# Intel Xeon with AVX-512 but no AVX512_BF16 (one thread, [1024, 576] x [576, 1536]): fp32 124 GFLOP/s,
# bf16 26, fp16 1.4 (docs/cpu-mode.md, "dtype"). SGLang itself would pick fp16 for an fp32 checkpoint.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def host_cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this machine's CPU (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_dtype(cpu_flags: frozenset[str]) -> str:
    """CPU mode's ``--dtype``: bf16 where the CPU multiplies it natively, else fp32 (5x faster there)."""
    return "bfloat16" if cpu_flags & BF16_CPU_FLAGS else "float32"


def cpu_mode_args(sglang_args: list[str], cpu_flags: Optional[frozenset[str]] = None) -> list[str]:
    """The CPU development-mode defaults for flags the user did not set (``cpu_flags``: the CPU's
    instruction sets, this machine's when None)."""
    added = defaults_not_given(sglang_args, CPU_MODE_DEFAULTS)
    if not has_flag(sglang_args, "--dtype"):
        added += ["--dtype", cpu_dtype(host_cpu_flags() if cpu_flags is None else cpu_flags)]
    if not has_flag(sglang_args, "--max-total-tokens") and not has_flag(sglang_args, "--mem-fraction-static"):
        added += ["--max-total-tokens", str(CPU_DEFAULT_MAX_TOTAL_TOKENS)]
    if not has_flag(sglang_args, "--mem-fraction-static"):
        added += ["--mem-fraction-static", str(CPU_MEM_FRACTION_STATIC)]
    return added


def compression_args(sglang_args: list[str], cpu_mode: bool, block_size: Optional[int] = None) -> list[str]:
    """``sglang_args`` rewritten for a compressing server: our radix cache, the attention backend the
    engine wraps on this machine, what ``COMPRESSION_DEFAULTS`` needs and, in CPU mode, its chunk
    (``block_size``: of block scope, whose block and chunk must fit the pool together)."""
    backend = "torch_native" if cpu_mode else "flashinfer"
    defaults = (("--attention-backend", (backend,)), *COMPRESSION_DEFAULTS)
    if cpu_mode:
        chunk = policy_chunk_default(block_size, int_flag_value(sglang_args, "--max-total-tokens"))
        defaults += (("--chunked-prefill-size", (str(chunk),)),)
    return [*sglang_args, "--radix-cache-backend", RADIX_CACHE_BACKEND, *defaults_not_given(sglang_args, defaults)]


def policy_chunk_default(block_size: Optional[int], pool: Optional[int]) -> int:
    """``CPU_POLICY_CHUNKED_PREFILL_SIZE``, or less where a block and a chunk would not fit the pool
    together (a small pool then still serves what fits it, as it did before chunking)."""
    if block_size is None or pool is None:
        return CPU_POLICY_CHUNKED_PREFILL_SIZE
    return max(1, min(CPU_POLICY_CHUNKED_PREFILL_SIZE, largest_chunk_beside_block(block_size, pool)))


def largest_chunk_beside_block(block_size: int, pool: int) -> int:
    """The longest prefill chunk beside one dense block in a ``pool``-slot KV pool: block scope compresses
    a block at the chunk it ends in, so both are dense at once, and together they stay below the pool."""
    return pool - block_size - 1


def tp_size(args: list[str]) -> int:
    """SGLang's tensor-parallel size from its flags (both spellings; 1 when absent)."""
    return int_flag_value(args, "--tp-size") or int_flag_value(args, "--tensor-parallel-size") or 1
