"""Whether a machine can hold N workers, checked before any model loads.

On CPU every worker's KV pool, weights and processes live in host RAM, and SGLang zeroes its whole
pool at start-up: N pools that do not fit end with the kernel killing a worker minutes later. The
estimate is deliberately simple: the KV pool (``--max-total-tokens`` x layers x KV heads x head
dim x K and V x element size), the weight files, and a measured per-worker process overhead.
On CUDA each worker needs a GPU of its own (``--base-gpu-id`` i for worker i).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sgl_kvevict.server.processes import StartupError
from sgl_kvevict.server.sglang_args import flag_value, tp_size

GIB = 1 << 30
# Resident memory of one CPU worker's three SGLang processes (HTTP server, scheduler, detokenizer)
# besides its KV pool and weights: imports, tokenizer, buffers. Measured with the tiny test model:
# about 1.9 GiB; rounded up.
WORKER_PROCESS_BYTES = 2 * GIB
ELEMENT_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class WorkerFootprint:
    """Host bytes one CPU worker needs."""

    kv_pool: int
    weights: int
    processes: int = WORKER_PROCESS_BYTES

    @property
    def total(self) -> int:
        return self.kv_pool + self.weights + self.processes

    def describe(self) -> str:
        return (
            f"KV pool {self.kv_pool / GIB:.1f} GiB + weights {self.weights / GIB:.1f} GiB + processes "
            f"{self.processes / GIB:.1f} GiB"
        )


def kv_element_bytes(sglang_args: list[str], model_config: dict) -> int:
    """Bytes of one K or V element: --kv-cache-dtype, else --dtype, else the checkpoint's dtype."""
    for flag in ("--kv-cache-dtype", "--dtype"):
        value = flag_value(sglang_args, flag)
        if value is not None and value != "auto":
            return ELEMENT_BYTES.get(value, 2)
    return ELEMENT_BYTES.get(str(model_config.get("torch_dtype", model_config.get("dtype", "bfloat16"))), 2)


def worker_footprint(model_dir: Path, sglang_args: list[str]) -> Optional[WorkerFootprint]:
    """The footprint of one worker started with ``sglang_args`` (the launcher's additions included);
    None when the pool is not sized by --max-total-tokens (SGLang then sizes it from free memory)."""
    tokens = flag_value(sglang_args, "--max-total-tokens")
    if tokens is None:
        return None
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_token = config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * 2
    weights = sum(path.stat().st_size for pattern in ("*.safetensors", "*.bin") for path in model_dir.glob(pattern))
    return WorkerFootprint(kv_pool=int(tokens) * per_token * kv_element_bytes(sglang_args, config), weights=weights)


def available_host_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise StartupError("cannot read MemAvailable from /proc/meminfo")


def check_host_memory(workers: int, footprint: Optional[WorkerFootprint], available: int) -> None:
    if footprint is None:
        raise StartupError(
            f"--workers {workers} on CPU needs --max-total-tokens per worker (or the launcher's default): "
            "with only --mem-fraction-static every worker would size its pool from the same free RAM"
        )
    needed = workers * footprint.total
    if needed > available:
        raise StartupError(
            f"--workers {workers} needs about {needed / GIB:.1f} GiB of host RAM ({workers} x "
            f"({footprint.describe()})) but {available / GIB:.1f} GiB is available; lower --workers or "
            "--max-total-tokens (it is per worker)"
        )


def check_gpus(workers: int, sglang_args: list[str], visible: int) -> None:
    """Worker i runs on GPUs base + i * tp onwards, one per TP rank (``scale_out`` passes --base-gpu-id):
    they must exist."""
    base = int(flag_value(sglang_args, "--base-gpu-id") or 0)
    tp = tp_size(sglang_args)
    if base + workers * tp > visible:
        raise StartupError(
            f"--workers {workers} needs GPUs {base}..{base + workers * tp - 1} ({tp} per worker, --tp-size) but "
            f"{visible} are visible"
        )
