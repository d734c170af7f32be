"""What decides the numbers of a CPU benchmark run, recorded so that two runs can be told apart.

Greedy answers through a compressed cache flip on the last bit of a bf16 matmul, so "same command"
is not enough to reproduce a quality cell: the kernels torch dispatches to must be the same too. On
x86 CPUs those depend on the instruction sets of the machine (oneDNN runs bf16 GEMMs with AVX512-BF16
or AMX where the CPU has them and converts to fp32 elsewhere; ATen's vectorised kernels use AVX512 or
AVX2 lanes), and can be capped by environment variables. Measured on this project's machines
(``docs/results/quality.md``): the thread count and other processes loading the CPU do not change a
single answer, capping the instruction set does.

``numerics_environment()`` records every such input; ``numerics_probe()`` hashes the logits of one
fixed forward, so equal probes mean the model computes bit-identical logits, and a run on a machine
whose kernels differ is recognised (``quality_merge`` and ``--resume`` refuse to mix them).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

# Environment variables that change which kernels run or how many threads they use.
NUMERICS_ENV_VARS = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_DYNAMIC", "MKL_DYNAMIC", "MKL_CBWR", "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE", "TORCH_MKLDNN_MATMUL_MIN_DIM",
)  # fmt: skip
# The CPU flags (from /proc/cpuinfo) that select different bf16/fp32 kernels.
KERNEL_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_tile")
PROBE_TOKENS = 512


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def numerics_environment(dtype: str) -> dict:
    """Everything that fixes the arithmetic of a CPU run of the reference engine."""
    model, flags = _cpuinfo()
    onednn = re.search(r"(?:oneDNN|MKL-DNN) v([\d.]+)", torch.__config__.show())
    return {
        "dtype": dtype,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "cpu_model": model,
        "cpu_kernel_flags": sorted(flag for flag in KERNEL_CPU_FLAGS if flag in flags),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn": onednn.group(1) if onednn else None,
        "mkldnn_enabled": torch.backends.mkldnn.enabled,
        "intra_op_threads": torch.get_num_threads(),
        "inter_op_threads": torch.get_num_interop_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "env": {name: os.environ[name] for name in NUMERICS_ENV_VARS if name in os.environ},
    }


def tasks_fingerprint(prompts: Sequence[Sequence[int]]) -> str:
    """sha256 over every prompt's token ids: equal fingerprints mean the same inputs."""
    digest = hashlib.sha256()
    for ids in prompts:
        digest.update(",".join(map(str, ids)).encode() + b";")
    return digest.hexdigest()[:16]


def numerics_probe(logits_of: Callable[[list[int]], torch.Tensor], vocab_size: int) -> str:
    """sha256 of the fp32 logits ``logits_of(ids)`` returns for a fixed spread of ``PROBE_TOKENS`` token
    ids (the same for every grid, so runs of different lengths or tasks can be compared)."""
    ids = [(7919 * i + 13) % vocab_size for i in range(PROBE_TOKENS)]
    logits = logits_of(ids).detach().to(torch.float32).contiguous()
    return hashlib.sha256(logits.numpy().tobytes()).hexdigest()[:16]
