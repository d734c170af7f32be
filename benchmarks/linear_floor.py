"""How far a CPU decode step's linears are from reading their weights once: SGLang's bf16 ``F.linear``
(``UnquantizedLinearMethod.apply`` on CPU) on a model's decode shapes against streaming the same bytes.

    python -m benchmarks.linear_floor                  # SmolLM2-135M's shapes, batch 8, 2 threads
    python -m benchmarks.linear_floor --rows 1 --threads 1
    python -m benchmarks.linear_floor --model /path/to/hf-model   # another model's shapes (its config.json)

Random bf16 weights in the shapes the model's config.json gives: every layer's four linears (fused
QKV, output, fused gate/up, down), one tensor each per layer so that no layer finds another's in
cache, and the LM head; ``--rows`` query rows. It times one step's worth of ``F.linear`` calls and a bf16 sum over the same weights (what reading them
once costs on this machine), median of ``--repeats``. A decode step's model part cannot fall below
the second; docs/status.md compares the first with the server's profile (benchmarks.decode_step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from sgl_kvevict.models import ModelError, resolve_model


def linear_shapes(config: dict) -> tuple[tuple[tuple[int, int], ...], int, int, int]:
    """(out, in) of each layer's linears as SGLang fuses them (QKV, output, gate/up, down), the layer
    count, the vocabulary and the hidden size, from a parsed config.json (a multimodal one's text model)."""
    config = config.get("text_config", config)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    intermediate = config["intermediate_size"]
    shapes = (
        ((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * intermediate, hidden), (hidden, intermediate)
    )  # fmt: skip
    return shapes, config["num_hidden_layers"], config["vocab_size"], hidden


def median_ms(run: Callable[[], object], repeats: int) -> float:
    run()  # first touch: page faults and oneDNN's primitive cache
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.linear_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="bundled model name or HF folder whose shapes are timed (default smollm2)")
    parser.add_argument("--rows", type=int, default=8, help="query rows, the decode batch (default 8)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2, as a server on these machines)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repetitions, median reported (default 10)")
    args = parser.parse_args(argv)
    if min(args.rows, args.threads, args.repeats) < 1:
        parser.error("--rows, --threads and --repeats must be at least 1")
    try:
        model_dir = Path(resolve_model(args.model))
    except ModelError as error:
        parser.error(str(error))
    shapes, num_layers, vocab, hidden = linear_shapes(json.loads((model_dir / "config.json").read_text()))
    torch.set_num_threads(args.threads)
    layers = [[torch.randn(out, inp, dtype=torch.bfloat16) for out, inp in shapes] for _ in range(num_layers)]
    head = torch.randn(vocab, hidden, dtype=torch.bfloat16)
    inputs = [torch.randn(args.rows, inp, dtype=torch.bfloat16) for _, inp in shapes]
    weights = torch.cat([w.flatten() for layer in layers for w in layer] + [head.flatten()])
    megabytes = weights.numel() * weights.element_size() / 1e6

    def step():
        for layer in layers:
            for x, w in zip(inputs, layer):
                F.linear(x, w)
        F.linear(inputs[0], head)

    linear = median_ms(step, args.repeats)
    stream = median_ms(weights.sum, args.repeats)
    print(f"{num_layers} layers' linears + LM head, {args.rows} rows, {args.threads} threads, {megabytes:.0f} MB of bf16 weights")
    print(f"F.linear: {linear:.1f} ms ({megabytes / linear:.1f} GB/s)")
    print(f"reading the weights once (a bf16 sum): {stream:.1f} ms ({megabytes / stream:.1f} GB/s); F.linear x{linear / stream:.2f} of it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
