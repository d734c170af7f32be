"""Kernel micro-benchmark: Triton kernels vs their torch twins, and a correctness check of each pair.

    python benchmarks/kernels.py            # on a CUDA machine: timings at serving shapes (bf16)
    python benchmarks/kernels.py            # without a GPU: "no GPU: correctness only", then a small
                                            # smoke run of the Triton kernels in the interpreter

Timings use ``triton.testing.do_bench`` (median of repeated launches, milliseconds). Shapes model
an 8-KV-head, 32-query-head, head-dim-128 model (Llama-3-8B-like) at 25% kept KV.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields
from typing import Callable

import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run only in the interpreter, which must be chosen before the
    # first `import triton` (sgl_kvevict/kernels/runtime.py); this script is that first import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sgl_kvevict.kernels import ArenaCellMap  # noqa: E402
from sgl_kvevict.kernels.compaction import copy_kv_rows_torch, copy_kv_rows_triton, kv_buffer_rows  # noqa: E402
from sgl_kvevict.kernels.merge_states import merge_attention_states_torch, merge_attention_states_triton  # noqa: E402
from sgl_kvevict.kernels.segment_attention import segment_attention_torch, segment_attention_triton  # noqa: E402
from sgl_kvevict.kernels.window_scores import window_stats_torch, window_stats_triton  # noqa: E402
from sgl_kvevict.scoring.window import StatsRequest, WindowStats  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    num_kv_heads: int
    group: int
    head_dim: int
    context_len: int  # window scoring
    window: int
    kept_per_head: int  # compaction and segment attention
    decode_batch: int
    extend_tokens: int  # query tokens of one request in an extend


SERVING = Sizes(num_kv_heads=8, group=4, head_dim=128, context_len=8192, window=32, kept_per_head=2048,
                decode_batch=32, extend_tokens=256)  # fmt: skip
SMOKE = Sizes(num_kv_heads=2, group=4, head_dim=64, context_len=80, window=8, kept_per_head=40,
              decode_batch=3, extend_tokens=5)  # fmt: skip


@dataclass(frozen=True)
class Pair:
    name: str
    run_triton: Callable[[], object]
    run_torch: Callable[[], object]
    compare: Callable[[object, object], float]  # relative difference of the results


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| over finite entries; inf if the infinities (empty sequences) differ."""
    if not torch.equal(a.isinf(), b.isinf()):
        return float("inf")
    finite = b.isfinite()
    if not finite.any():
        return 0.0
    return float((a[finite].float() - b[finite].float()).abs().max() / b[finite].float().abs().max().clamp(min=1e-30))


def computed(stats: WindowStats) -> list[torch.Tensor]:
    return [getattr(stats, f.name) for f in fields(stats) if isinstance(getattr(stats, f.name), torch.Tensor)]


def build_pairs(sizes: Sizes, dtype: torch.dtype, device: torch.device) -> list[Pair]:
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    num_q_heads = sizes.num_kv_heads * sizes.group
    num_slots = 2 * sizes.context_len
    k_buffer = randn(num_slots, sizes.num_kv_heads, sizes.head_dim)
    v_buffer = randn(num_slots, sizes.num_kv_heads, sizes.head_dim)
    kv_indices = torch.randperm(num_slots - 1, generator=generator, device=device)[: sizes.context_len].int() + 1
    q_window = randn(num_q_heads, sizes.window, sizes.head_dim)
    scaling = sizes.head_dim**-0.5

    def window_pair(label: str, request: StatsRequest) -> Pair:
        args = (q_window, k_buffer, v_buffer, kv_indices, scaling, request)
        return Pair(
            f"window stats {label} (L={sizes.context_len})",
            lambda: window_stats_triton(*args),
            lambda: window_stats_torch(*args),
            lambda a, b: max(relative_difference(x, y) for x, y in zip(computed(a), computed(b))),
        )

    num_cells = sizes.num_kv_heads * sizes.kept_per_head
    cells = ArenaCellMap(
        cell_ids=torch.randperm(num_cells, generator=generator, device=device),
        slots=kv_indices[: sizes.kept_per_head].long().repeat(sizes.num_kv_heads),
        head_ids=torch.arange(sizes.num_kv_heads, device=device).repeat_interleave(sizes.kept_per_head),
    )
    buffer_k, buffer_v = kv_buffer_rows(k_buffer, v_buffer)
    arenas = {
        impl: (randn(num_cells, sizes.head_dim), randn(num_cells, sizes.head_dim)) for impl in ("triton", "torch")
    }
    rows = (cells.buffer_rows(sizes.num_kv_heads), cells.cell_ids)

    def compaction(copy, impl: str):
        def run():
            copy(buffer_k, buffer_v, *arenas[impl], *rows)
            return arenas[impl][0]

        return run

    arena_k, arena_v = arenas["torch"]

    def attention_pair(label: str, q_lens: list[int]) -> Pair:
        qo_indptr = torch.tensor([0, *q_lens], device=device).cumsum(0).int()
        num_sequences = len(q_lens) * sizes.num_kv_heads
        kv_indptr = torch.arange(num_sequences + 1, device=device).int() * sizes.kept_per_head
        num_entries = num_sequences * sizes.kept_per_head
        kv_cells = torch.randint(0, num_cells, (num_entries,), generator=generator, device=device).int()
        q = randn(sum(q_lens), num_q_heads, sizes.head_dim)
        args = (q, arena_k, arena_v, qo_indptr, kv_indptr, kv_cells, sizes.num_kv_heads, scaling, max(q_lens))
        return Pair(
            f"segment attention {label}",
            lambda: segment_attention_triton(*args),
            lambda: segment_attention_torch(*args),
            lambda a, b: max(relative_difference(a[0], b[0]), relative_difference(a[1], b[1])),
        )

    cells_per_head = f"{sizes.kept_per_head} cells/head"
    num_tokens = sizes.decode_batch * 8
    states = (randn(num_tokens, num_q_heads, sizes.head_dim), torch.randn(num_tokens, num_q_heads, device=device))
    return [
        window_pair("attn_sum", StatsRequest(attn_sum=True)),
        window_pair("attn_sum+OBC key/joint", StatsRequest(attn_sum=True, obc_key=True, obc_joint=True)),
        Pair(
            f"compaction ({num_cells} cells)",
            compaction(copy_kv_rows_triton, "triton"),
            compaction(copy_kv_rows_torch, "torch"),
            relative_difference,
        ),
        attention_pair(f"decode (B={sizes.decode_batch}, {cells_per_head})", [1] * sizes.decode_batch),
        attention_pair(f"extend ({sizes.extend_tokens} tokens, {cells_per_head})", [sizes.extend_tokens]),
        Pair(
            "merge states",
            lambda: merge_attention_states_triton(*states, *states),
            lambda: merge_attention_states_torch(*states, *states),
            lambda a, b: max(relative_difference(a[0], b[0]), relative_difference(a[1], b[1])),
        ),
    ]


def main() -> int:
    if torch.cuda.is_available():
        from triton.testing import do_bench

        print(f"{torch.cuda.get_device_name()}, bf16; milliseconds (median)")
        print(f"{'kernel':<62} {'torch':>9} {'triton':>9} {'speed-up':>9} {'rel. diff':>11}")
        for pair in build_pairs(SERVING, torch.bfloat16, torch.device("cuda")):
            difference = pair.compare(pair.run_triton(), pair.run_torch())
            torch_ms, triton_ms = do_bench(pair.run_torch), do_bench(pair.run_triton)
            print(f"{pair.name:<62} {torch_ms:9.3f} {triton_ms:9.3f} {torch_ms / triton_ms:8.1f}x {difference:11.2e}")
        return 0

    print("no GPU: correctness only (Triton kernels in the interpreter at small shapes, no timings)")
    failures = 0
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        for pair in build_pairs(SMOKE, dtype, torch.device("cpu")):
            difference = pair.compare(pair.run_triton(), pair.run_torch())
            ok = difference <= tolerance
            failures += not ok
            print(f"  {'ok  ' if ok else 'FAIL'} {str(dtype):<15} {pair.name:<58} rel. diff {difference:.2e}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
