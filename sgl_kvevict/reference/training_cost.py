"""What a ``train_scorer`` run will cost, estimated before it starts: time and peak memory.

Per document of ``n`` tokens the reference engine runs the prefill (``n`` tokens), then KVzip's
reconstruction passes (the ``n`` tokens again, in chunks of ``c = min(n, 2048)`` after a short
instruction) over the cache, capturing each pass's attention statistics in fp32:

* **work**: ``4 P n`` in the linear layers (``P``: parameters outside the embeddings and the output
  head; 2 FLOPs per parameter per token, for the prefill and the passes) and ``10 L H_q D n^2`` in
  attention (the causal prefill's QK^T and AV, ``2 L H_q D n^2``; the passes' over the context,
  ``4 L H_q D n^2``, and as much again for their statistics);
* **memory**: the fp32 weights; the cache of the prefill and a pass, ``2 L H_kv D (n + c)`` floats;
  what the statistics of a pass materialise per layer, ``ATTENTION_COPIES`` fp32 tensors
  ``[H_q, c, n + c]``; one document's features and targets, ``L n (d + H_kv)`` floats; the
  regression's float64 ``X^T X`` of every layer for the train, validation and test documents,
  ``3 L d^2`` doubles; and ``PROCESS_BYTES``.

Time is the work over a rate. On a CPU, ``CPU_RATE``: fitted to CPU seconds measured with SmolLM2-135M
on this project's 2-core CI machine with one thread (``docs/compatibility.md``), multiplied by
``--threads`` (optimistic: threads rarely scale linearly); it is CPU time, and a loaded machine takes
longer on the clock. On a GPU the rate is an assumption, not a measurement (the project's CI has no
GPU): ``GPU_RATE``, a fifth of an H100's fp32 peak, since the statistics are unfused element-wise work
that memory bandwidth bounds. The first document's real time, printed as it ends, corrects either.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from safetensors import safe_open

from sgl_kvevict.scoring.kvzip import DEFAULT_CHUNK_SIZE
from sgl_kvevict.scoring.learned import ModelShape

# FLOP/s of the reference engine's training work on one CPU thread: fitted to the CPU seconds of
# SmolLM2-135M documents of 1K, 2K, 4K and 7K tokens on this project's (shared, loaded) 2-core CI
# machine, within 30% of each (docs/compatibility.md).
CPU_RATE = 30e9
# Assumed, not measured: an H100 runs fp32 at about 60 TFLOP/s at best.
GPU_RATE = 12e12
# fp32 tensors of a pass's [H_q, c, n + c] attention alive at once at the peak: fitted, with
# PROCESS_BYTES, to the same runs' peak memory (within 15%).
ATTENTION_COPIES = 1
# Python, torch, transformers, the tokenizer and the first forward's own allocations, besides the weights.
PROCESS_BYTES = 1100 << 20


@dataclass(frozen=True)
class ModelSize:
    """What the cost depends on: the model's shape, its parameters (all, and those of the decoder
    blocks) and its attention's query heads and head size."""

    shape: ModelShape
    parameters: int
    block_parameters: int
    num_q_heads: int
    head_dim: int

    @classmethod
    def of(cls, model_dir: Path) -> "ModelSize":
        shape = ModelShape.of(model_dir)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        parameters = 0
        for weights_file in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(weights_file), framework="pt") as tensors:
                parameters += sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())
        embeddings = config["vocab_size"] * shape.hidden_size * (1 if config.get("tie_word_embeddings") else 2)
        num_q_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or shape.hidden_size // num_q_heads
        return cls(shape, parameters, max(parameters - embeddings, 0), num_q_heads, head_dim)


@dataclass(frozen=True)
class TrainingCost:
    """seconds: the whole run; device_bytes: the model, its cache and a pass's statistics at the largest
    document (RAM on a CPU, GPU memory on a GPU); host_bytes: the process, one document's features and
    the regression (RAM); rate: the FLOP/s assumed."""

    seconds: float
    device_bytes: int
    host_bytes: int
    rate: float
    device: str
    threads: int = 1

    @classmethod
    def estimate(cls, size: ModelSize, document_tokens: Sequence[int], device: str, threads: int = 1) -> "TrainingCost":
        """For documents of these token counts on ``device`` (``cpu`` with ``threads``, or a GPU)."""
        rate = CPU_RATE * threads if device == "cpu" else GPU_RATE
        layers, hidden, kv_heads = size.shape.num_layers, size.shape.hidden_size, size.shape.num_kv_heads
        attention = layers * size.num_q_heads * size.head_dim
        work = sum(4 * size.block_parameters * n + 10 * attention * n * n for n in document_tokens)
        n = max(document_tokens)
        c = min(n, DEFAULT_CHUNK_SIZE)
        cache = 2 * layers * kv_heads * size.head_dim * (n + c)
        model = 4 * (size.parameters + cache + ATTENTION_COPIES * size.num_q_heads * c * (n + c))
        features = 4 * layers * n * (hidden + kv_heads)
        regression = 8 * 3 * layers * (hidden + 1) ** 2
        return cls(work / rate, model, PROCESS_BYTES + features + regression, rate, device, threads)

    def describe(self) -> str:
        if self.device == "cpu":
            where = f"{self.threads} CPU thread{'s' if self.threads > 1 else ''}"
            memory = f"{(self.device_bytes + self.host_bytes) / 2**30:.1f} GiB of RAM"
            how = (
                f"{self.rate / self.threads / 1e9:.0f} GFLOP/s per thread, fitted to CPU seconds measured on this "
                "project's CI machine; threads rarely scale fully, and a loaded machine takes longer"
            )
        else:
            where = self.device
            memory = f"{self.device_bytes / 2**30:.1f} GiB on {self.device} and {self.host_bytes / 2**30:.1f} GiB of RAM"
            how = f"an assumed {self.rate / 1e12:.0f} TFLOP/s: not measured, no GPU was available to this project"
        return f"about {_duration(self.seconds)} on {where} and {memory} (at {how})"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
