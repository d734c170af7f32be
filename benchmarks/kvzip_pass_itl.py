"""Decode while a KVzip pass runs: the gaps between a streamed request's tokens while another prompt is
prefilled and scored by KVzip's reconstruction passes, for the server of any checkout.

    python -m benchmarks.kvzip_pass_itl --label after --server-arg=--dtype=float32
    python -m benchmarks.kvzip_pass_itl --label before --tree /tmp/old --server-arg=--dtype=float32

One server (``topk:kvzip`` at ``--budget``, the real launcher) serves ``--rounds`` rounds of
``benchmarks.chunked_prefill``'s decode measurement: a chat request streams ``--stream-tokens`` tokens
and, once 20 are out, a ``--arrival-tokens`` prompt of random ids arrives, is prefilled, its KVzip pass
runs and it decodes ``--arrival-output-tokens`` tokens. ``--tree`` starts the server from another checkout (its folder first on the server's
``PYTHONPATH``; this process measures with this checkout's code), e.g. a ``git worktree`` of the
commit before the passes were scheduled between batches. That checkout needs ``sgl_kvevict/server``
and ``sgl_kvevict/kernels`` linked to its ``server``/``kernels`` folders, as the editable install maps
them here. Writes ``<out>/<name>-<label>.json`` (every gap of every round) and prints one line a round:
the largest gap, p99, and the seconds of gaps over 1 s (the stream's stall).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.chunked_prefill import ChunkedConfig, measure
from benchmarks.cli import add_output_args, benchmark_parser, log_folder
from benchmarks.load.report import run_meta
from sgl_kvevict.measure.servers import ServerVariant, launched_server

STALL_GAP_SECONDS = 1.0


def build_parser():
    parser = benchmark_parser("kvzip_pass_itl", __doc__)
    parser.add_argument("--label", required=True, help="name of this server in the output (e.g. before, after)")
    parser.add_argument("--tree", type=Path, help="checkout whose server runs (default: this one)")
    parser.add_argument("--budget", default="0.25", help="--kv-evict-budget (default 0.25)")
    parser.add_argument("--rounds", type=int, default=3, help="streams measured (default 3)")
    parser.add_argument("--arrival-tokens", type=int, default=3000, help="the prompt that arrives (default 3000)")
    parser.add_argument(
        "--arrival-output-tokens", type=int, default=32,
        help="tokens the arriving prompt decodes: its KVzip pass runs between batches while it does; what is "
        "left of the pass when it finishes runs at once (default 32)",
    )  # fmt: skip
    parser.add_argument("--stream-tokens", type=int, default=160, help="tokens the streamed request decodes (default 160)")
    parser.add_argument("--pool-tokens", type=int, default=16000, help="--max-total-tokens (default 16000)")
    add_output_args(parser, "kvzip_pass_itl", server_arg_for="the server")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    config = ChunkedConfig(
        model="smollm2", chunk_sizes=(-1,), prompt_tokens=64, samples=1, arrival_tokens=args.arrival_tokens,
        stream_tokens=args.stream_tokens, arrive_after=20, pool_tokens=args.pool_tokens,
        arrival_output_tokens=args.arrival_output_tokens,
    )  # fmt: skip
    if args.tree:
        os.environ["PYTHONPATH"] = str(args.tree.resolve())  # the server's processes only: imports here are done
    variant = ServerVariant("topk:kvzip", args.budget, tuple(args.server_arg))
    rounds = []
    with launched_server("smollm2", variant, args.pool_tokens, log_folder(args.log_dir, "kvzip-pass-itl")) as server:
        for index in range(args.rounds):
            figures = asyncio.run(measure(server.base_url, config, seed=100 * index + 7))
            stalls = [gap for gap in figures["itl_gaps"] if gap > STALL_GAP_SECONDS]
            print(
                f"{args.label} round {index}: arrival answered after {figures['arrival_prefill_seconds']:.1f} s; "
                f"ITL p50 {figures['itl_p50']:.3f} s, p99 {figures['itl_p99']:.3f} s, max {figures['itl_max']:.2f} s; "
                f"{len(stalls)} gaps over {STALL_GAP_SECONDS:.0f} s, {sum(stalls):.1f} s in all",
                flush=True,
            )
            rounds.append(figures)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}-{args.label}.json"
    meta = run_meta(
        "kvzip_pass_itl", argv,
        label=args.label, tree=str(args.tree or "."), server=variant.label, server_args=args.server_arg,
        arrival_tokens=args.arrival_tokens, arrival_output_tokens=args.arrival_output_tokens, stream_tokens=args.stream_tokens, pool_tokens=args.pool_tokens,
    )  # fmt: skip
    path.write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
