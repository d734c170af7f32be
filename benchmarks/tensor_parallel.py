"""Compression under tensor parallelism: what the ranks exchange per compressed request, next to the
KV memory it frees, and the time to first token at ``--tp-size N`` against one rank.

    python -m benchmarks.tensor_parallel                           # SmolLM2, tp 1 and 2, stock and six methods
    python -m benchmarks.tensor_parallel --tp 1,2,3 --prompt-tokens 2000 --prompts 3
    python -m benchmarks.tensor_parallel --server-arg=--chunked-prefill-size=2048 --name tensor_parallel_chunk2048

Per TP size two servers, one at a time, with the same ``--max-total-tokens``: stock SGLang (``none``),
then SmolLM2 with ``--kv-evict-per-request``. For stock and each method (``name[:score]`` at
``--budget``) and each of ``--prompts`` fresh prompts of
``--prompt-tokens`` random token ids, after a ``/flush_cache``: one greedy ``/generate`` with one
new token, whose latency is its time to first token (the prefill, the scoring, the exchanges and the
compaction). ``/kvevict/stats`` before and after give what the request cost:

* sent: ``tp_bytes_sent``, the bytes each rank contributed to the all-gathers (each of the other
  R - 1 ranks receives them): the score summaries of the methods that weigh heads against each
  other, and every rank's kept entries per position (int32) for the cell reservations;
* freed: the K and V bytes the compression gave back, over every rank: (compressed tokens x layers
  x the model's KV heads - kept entries) x 2 x head dim x element bytes (CPU mode serves fp32).

Medians over the prompts; the TTFT ratios (tp N / tp 1 of the same method, and method / stock at the
same TP size) are within this run. With more ranks than
cores (tp 3 on 2 cores) the ranks share cores, so CPU TTFTs measure oversubscription more than TP.
Writes ``<name>.json`` and ``<name>.md`` into ``--out``.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.cli import add_output_args, benchmark_parser, log_folder
from benchmarks.load.report import provenance_line, run_meta, write_report
from sgl_kvevict.measure.servers import VANILLA_POLICY, ServerVariant, launched_server
from sgl_kvevict.models import resolve_model
from sgl_kvevict.request_options import REQUEST_OPTIONS_PREFIX

PER_REQUEST = ("--kv-evict-per-request", "--kv-evict-request-allow", "all")
DEFAULT_METHODS = ("snapkv", "pyramidkv", "ada-snapkv", "lava", "topk:learned", "dbudget")
FP32_BYTES = 4
SAMPLE_COUNTS = ("compressed_tokens", "kept_entries", "bytes_sent_per_rank", "exchanges", "kv_bytes_freed")


@dataclass(frozen=True)
class ModelKV:
    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model_dir: Path) -> "ModelKV":
        config = json.loads((model_dir / "config.json").read_text())
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return cls(config["num_hidden_layers"], config.get("num_key_value_heads", heads), head_dim)

    def entry_bytes(self) -> int:
        """K and V of one (layer, KV head, token) entry."""
        return 2 * self.head_dim * FP32_BYTES


def _post(base_url: str, path: str, payload: Optional[dict] = None) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(base_url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        body = response.read()
    return json.loads(body) if body.strip().startswith(b"{") else {}


def _stats(base_url: str) -> dict:
    with urllib.request.urlopen(base_url + "/kvevict/stats", timeout=60) as response:
        return json.loads(response.read())


def method_options(method: str, budget: str) -> str:
    name, _, score = method.partition(":")
    options = [f"policy={name}"] + ([f"score={score}"] if score else [])
    return ",".join(options + ([] if name == "dbudget" else [f"budget={budget}"]))


def measure(base_url: str, method: str, budget: str, prompt: list[int], kv: ModelKV) -> dict:
    """One request after a flush: its TTFT and what its compression sent and freed (``none``: a stock
    server, nothing compressed)."""
    _post(base_url, "/flush_cache")
    payload = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    if method == VANILLA_POLICY:
        started = time.perf_counter()
        _post(base_url, "/generate", payload)
        return dict(ttft_s=time.perf_counter() - started, **dict.fromkeys(SAMPLE_COUNTS, 0))
    before = _stats(base_url)
    payload["extra_key"] = REQUEST_OPTIONS_PREFIX + method_options(method, budget)
    started = time.perf_counter()
    _post(base_url, "/generate", payload)
    ttft = time.perf_counter() - started
    after = _stats(base_url)
    tokens = after["compressed_tokens"] - before["compressed_tokens"]
    kept = after["kept_entries"] - before["kept_entries"]
    return {
        "ttft_s": ttft,
        "compressed_tokens": tokens,
        "kept_entries": kept,
        "bytes_sent_per_rank": after["tp_bytes_sent"] - before["tp_bytes_sent"],
        "exchanges": after["tp_exchanges"] - before["tp_exchanges"],
        "kv_bytes_freed": (tokens * kv.layers * kv.kv_heads - kept) * kv.entry_bytes(),
    }


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def run(args) -> dict:
    model_dir = resolve_model(args.model)
    kv = ModelKV.of(model_dir)
    prompts = random_prompts(args.prompts, args.prompt_tokens, args.seed)
    logs = log_folder(args.log_dir, "tensor_parallel")
    rows = []
    for tp in args.tp:
        tp_flags = ("--tp-size", str(tp), *args.server_arg)
        servers = ((ServerVariant(VANILLA_POLICY, None, tp_flags, f"tp{tp}"), [VANILLA_POLICY]),
                   (ServerVariant("snapkv", args.budget, (*PER_REQUEST, *tp_flags), f"tp{tp}"), args.methods))  # fmt: skip
        for variant, methods in servers:
            with launched_server(args.model, variant, args.pool_tokens, logs) as server:
                _post(server.base_url, "/generate", {"input_ids": prompts[0][:64], "sampling_params": {"max_new_tokens": 1}})
                for method in methods:
                    samples = []
                    for index, prompt in enumerate(prompts):
                        samples.append(measure(server.base_url, method, args.budget, prompt, kv))
                        print(f"tp {tp} {method} prompt {index + 1}/{len(prompts)}: {samples[-1]}", flush=True)
                    rows.append({"tp": tp, "method": method, "samples": samples})
    return {"meta": run_meta("tensor_parallel", None, model=args.model, kv=kv.__dict__, prompt_tokens=args.prompt_tokens,
                             budget=args.budget, pool_tokens=args.pool_tokens, server_args=args.server_arg), "rows": rows}  # fmt: skip


def _median(samples: Sequence[dict], key: str) -> float:
    return statistics.median(sample[key] for sample in samples)


def markdown(report: dict) -> str:
    meta = report["meta"]
    ttft = {(row["tp"], row["method"]): _median(row["samples"], "ttft_s") for row in report["rows"]}
    lines = [
        "# Compression under tensor parallelism: bytes exchanged, KV freed, TTFT",
        "",
        f"{provenance_line(meta)} {meta['model']}, prompts of {meta['prompt_tokens']} "
        f"token ids, budget {meta['budget']} (dbudget decides its own), medians over the prompts. Sent: bytes each "
        "rank contributed to the all-gathers of one compressed request (each other rank receives them); freed: "
        "K and V bytes the compression gave back over every rank (fp32).",
        "",
        "| tp | method | exchanges | sent per rank (KiB) | KV freed (MiB) | sent / freed | TTFT (s) | TTFT / tp 1 "
        "| TTFT / stock |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        samples, method, tp = row["samples"], row["method"], row["tp"]
        sent, freed = (_median(samples, key) for key in ("bytes_sent_per_rank", "kv_bytes_freed"))
        ratio = f"{sent / freed:.2%}" if freed else "-"
        own = ttft[(tp, method)]
        versus_tp1 = f"{own / ttft[(1, method)]:.2f}" if (1, method) in ttft else "-"
        versus_stock = f"{own / ttft[(tp, VANILLA_POLICY)]:.2f}" if (tp, VANILLA_POLICY) in ttft else "-"
        lines.append(
            f"| {tp} | {method} | {_median(samples, 'exchanges'):.0f} | {sent / 1024:.1f} | {freed / 2**20:.1f} | "
            f"{ratio} | {own:.2f} | {versus_tp1} | {versus_stock} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = benchmark_parser("tensor_parallel", __doc__)
    parser.add_argument("--model", default="smollm2", help="bundled model name or HF folder (default smollm2)")
    parser.add_argument("--tp", type=lambda text: [int(v) for v in text.split(",")], default=[1, 2],
                        help="comma-separated TP sizes, 1 first for the TTFT ratios (default 1,2)")
    parser.add_argument("--methods", type=lambda text: text.split(","), default=list(DEFAULT_METHODS),
                        help=f"comma-separated name[:score] (default {','.join(DEFAULT_METHODS)})")
    parser.add_argument("--budget", default="0.25", help="kept fraction or tokens per (layer, KV head) (default 0.25)")
    parser.add_argument("--prompt-tokens", type=int, default=1500, help="prompt length in token ids (default 1500)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per method and TP size (default 3)")
    parser.add_argument("--pool-tokens", type=int, default=16384, help="--max-total-tokens of every server (default 16384)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    add_output_args(parser, "tensor_parallel", server_arg_for="every server")
    args = parser.parse_args(argv)
    if args.tp[0] != 1:
        parser.error("--tp must start with 1: the TTFT ratios are against one rank")
    if args.prompts < 1 or args.prompt_tokens < 100:
        parser.error("--prompts must be at least 1 and --prompt-tokens at least 100")
    report = run(args)
    write_report(args.out, args.name, report, markdown(report), print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
