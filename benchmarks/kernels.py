"""Kernel micro-benchmark: Triton kernels vs their torch twins, and a correctness check of each pair.

    python -m benchmarks.kernels            # on a CUDA machine: timings at serving shapes (bf16)
    python -m benchmarks.kernels            # without a GPU: "no GPU: correctness only", then a small
                                            # smoke run of the Triton kernels in the interpreter

Timings use ``triton.testing.do_bench`` (median of repeated launches, milliseconds). Shapes model
an 8-KV-head, 32-query-head, head-dim-128 model (Llama-3-8B-like) at 25% kept KV:

* window statistics of a plain request (8K dense keys, 32 window queries), of a request reusing a
  compressed prefix (16K positions compressed to 4K cells per KV head, then 2K dense keys), and of
  a KVzip reconstruction chunk (2K queries after an 8K context, ``attn_max``);
* compaction (one row copy);
* segment attention at decode, batch 1 and 32, 2K/8K/32K cells per (request, KV head): split-KV
  (``kv_splits``' choice from the cell bound) and unsplit; an extend of 256 tokens; the merge.

The "rel. diff" column is max |triton - torch| / max |torch| over finite entries (bf16 outputs:
~1e-2 expected; statistics are fp32: ~1e-5). docs/gpu.md says what to compare.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run only in the interpreter, which must be chosen before the
    # first `import triton` (sgl_kvevict/kernels/runtime.py); this script is that first import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sgl_kvevict.kernels.compaction import copy_kv_rows_torch, copy_kv_rows_triton  # noqa: E402
from sgl_kvevict.kernels.merge_states import merge_attention_states_torch, merge_attention_states_triton  # noqa: E402
from sgl_kvevict.kernels.segment_attention import (  # noqa: E402
    chosen_kv_splits,
    segment_attention_torch,
    segment_attention_triton,
)
from sgl_kvevict.kernels.window_scores import (  # noqa: E402
    CompressedCells,
    window_stats_torch,
    window_stats_triton,
)
from sgl_kvevict.scoring.window import StatsRequest, WindowStats  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    num_kv_heads: int
    group: int
    head_dim: int
    context_len: int  # plain window scoring: dense keys 0 .. L - 1; also the reconstruction's context
    window: int
    compressed_len: int  # a reused prefix [0, compressed_len) compressed to kept_per_head cells per head
    kept_per_head: int  # ... and the entries of one layer that compaction copies per head
    recent_len: int  # dense keys after the compressed prefix, the window among them
    reconstruction_window: int  # KVzip: queries of one reconstruction chunk
    decode_batches: tuple[int, ...]
    decode_cells: tuple[int, ...]  # cells per (request, KV head)
    extend_tokens: int  # query tokens of one request in an extend
    forced_splits: Optional[int]  # None: kv_splits' choice from the cell bound


SERVING = Sizes(
    num_kv_heads=8, group=4, head_dim=128, context_len=8192, window=32, compressed_len=16384, kept_per_head=4096,
    recent_len=2048, reconstruction_window=2048, decode_batches=(1, 32), decode_cells=(2048, 8192, 32768),
    extend_tokens=256, forced_splits=None,
)  # fmt: skip
SMOKE = Sizes(
    num_kv_heads=2, group=4, head_dim=64, context_len=80, window=8, compressed_len=100, kept_per_head=40,
    recent_len=30, reconstruction_window=40, decode_batches=(1, 3), decode_cells=(70,), extend_tokens=5,
    forced_splits=3,
)  # fmt: skip


@dataclass(frozen=True)
class Pair:
    """A Triton kernel, its torch twin and, for split-KV decode, the same kernel unsplit."""

    name: str
    run_triton: Callable[[], object]
    run_torch: Callable[[], object]
    compare: Callable[[object, object], float]  # relative difference of the results
    run_unsplit: Optional[Callable[[], object]] = None


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| over finite entries; inf if the infinities (empty sequences) differ."""
    if not torch.equal(a.isinf(), b.isinf()):
        return float("inf")
    finite = b.isfinite()
    if not finite.any():
        return 0.0
    return float((a[finite].float() - b[finite].float()).abs().max() / b[finite].float().abs().max().clamp(min=1e-30))


def stats_difference(a: WindowStats, b: WindowStats) -> float:
    computed = [f.name for f in fields(a) if isinstance(getattr(a, f.name), torch.Tensor)]
    return max(relative_difference(getattr(a, name), getattr(b, name)) for name in computed)


def attention_difference(a, b) -> float:
    return max(relative_difference(a[0], b[0]), relative_difference(a[1], b[1]))


class Builder:
    """Random inputs at ``sizes`` on ``device``; each method returns the pairs of one kernel."""

    def __init__(self, sizes: Sizes, dtype: torch.dtype, device: torch.device):
        self.sizes, self.dtype, self.device = sizes, dtype, device
        self.generator = torch.Generator(device=device).manual_seed(0)
        self.num_q_heads = sizes.num_kv_heads * sizes.group
        self.scaling = sizes.head_dim**-0.5

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, device=self.device).to(self.dtype)

    def randperm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.generator, device=self.device)

    def kv_buffer(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_slots, self.sizes.num_kv_heads, self.sizes.head_dim)
        return self.randn(*shape), self.randn(*shape)

    def window_pair(self, label: str, window: int, request: StatsRequest, num_keys: int, **cell_kwargs) -> Pair:
        k_buffer, v_buffer = self.kv_buffer(2 * num_keys)
        kv_indices = (self.randperm(2 * num_keys - 1)[:num_keys] + 1).int()
        args = (self.randn(self.num_q_heads, window, self.sizes.head_dim), k_buffer, v_buffer, kv_indices)
        args = (*args, self.scaling, request)
        return Pair(
            f"window stats {label}",
            lambda: window_stats_triton(*args, **cell_kwargs),
            lambda: window_stats_torch(*args, **cell_kwargs),
            stats_difference,
        )

    def window_pairs(self) -> list[Pair]:
        sizes = self.sizes
        plain = f"(L={sizes.context_len}, w={sizes.window})"
        reconstruction_len = sizes.context_len + sizes.reconstruction_window
        return [
            self.window_pair(f"attn_sum {plain}", sizes.window, StatsRequest(attn_sum=True), sizes.context_len),
            self.window_pair(
                f"attn_sum+OBC key/joint {plain}", sizes.window,
                StatsRequest(attn_sum=True, obc_key=True, obc_joint=True), sizes.context_len,
            ),  # fmt: skip
            self.compressed_prefix_pair(),
            self.window_pair(
                f"KVzip attn_max (L={reconstruction_len}, w={sizes.reconstruction_window})",
                sizes.reconstruction_window, StatsRequest(attn_max=True), reconstruction_len,
            ),  # fmt: skip
        ]

    def compressed_prefix_pair(self) -> Pair:
        """LAVa's statistics over a reused prefix: cells of ``[0, compressed_len)`` per head, then dense keys."""
        sizes = self.sizes
        num_kv_heads, kept = sizes.num_kv_heads, sizes.kept_per_head
        cell_k, cell_v = (self.randn(2 * num_kv_heads * kept, sizes.head_dim) for _ in range(2))
        order = torch.rand(num_kv_heads, sizes.compressed_len, generator=self.generator, device=self.device).argsort(1)
        cells = CompressedCells(
            cell_k, cell_v, self.randperm(cell_k.shape[0])[: num_kv_heads * kept],
            order[:, :kept].sort(1).values.flatten().int(),
            torch.arange(num_kv_heads + 1, device=self.device, dtype=torch.int32) * kept,
        )  # fmt: skip
        context_len = sizes.compressed_len + sizes.recent_len
        positions = torch.arange(sizes.compressed_len, context_len, device=self.device)
        label = f"attn_sum+value_l1, {kept} cells/head + {sizes.recent_len} dense (L={context_len}, w={sizes.window})"
        return self.window_pair(
            label, sizes.window, StatsRequest(attn_sum=True, value_l1=True), sizes.recent_len,
            key_positions=positions, context_length=context_len, cells=cells,
        )  # fmt: skip

    def compaction_pair(self) -> Pair:
        sizes = self.sizes
        num_rows = sizes.num_kv_heads * sizes.kept_per_head
        source = self.kv_buffer(4 * sizes.kept_per_head)
        source_rows = self.randperm(source[0].numel() // sizes.head_dim)[:num_rows]
        destinations = {impl: tuple(self.randn(num_rows, sizes.head_dim) for _ in range(2)) for impl in ("triton", "torch")}
        flat_source = tuple(t.view(-1, sizes.head_dim) for t in source)
        cell_rows = self.randperm(num_rows)

        def copy(copy_rows, impl: str):
            def run():
                copy_rows(*flat_source, *destinations[impl], source_rows, cell_rows)
                return destinations[impl][0]

            return run

        return Pair(
            f"compaction ({num_rows} rows)", copy(copy_kv_rows_triton, "triton"), copy(copy_kv_rows_torch, "torch"),
            relative_difference,
        )  # fmt: skip

    def attention_pair(self, label: str, q_lens: list[int], cells_per_sequence: int) -> Pair:
        sizes = self.sizes
        num_sequences = len(q_lens) * sizes.num_kv_heads
        num_cells = num_sequences * cells_per_sequence
        k_rows, v_rows = self.randn(num_cells, sizes.head_dim), self.randn(num_cells, sizes.head_dim)
        qo_indptr = torch.tensor([0, *q_lens], device=self.device).cumsum(0).int()
        kv_indptr = torch.arange(num_sequences + 1, device=self.device).int() * cells_per_sequence
        q = self.randn(sum(q_lens), self.num_q_heads, sizes.head_dim)
        kv_indices = self.randperm(num_cells).int()
        args = (q, k_rows, v_rows, qo_indptr, kv_indptr, kv_indices, sizes.num_kv_heads, self.scaling)
        max_q_len = max(q_lens)
        splits = sizes.forced_splits or chosen_kv_splits(
            len(q_lens), sizes.num_kv_heads, sizes.group, max_q_len, cells_per_sequence
        )
        return Pair(
            f"segment attention {label}, {cells_per_sequence} cells/head (S={splits})",
            lambda: segment_attention_triton(*args, max_q_len, num_kv_splits=splits),
            lambda: segment_attention_torch(*args),
            attention_difference,
            run_unsplit=lambda: segment_attention_triton(*args, max_q_len, num_kv_splits=1),
        )

    def attention_pairs(self) -> list[Pair]:
        sizes = self.sizes
        decode = [
            self.attention_pair(f"decode B={batch}", [1] * batch, cells)
            for cells in sizes.decode_cells
            for batch in sizes.decode_batches
        ]
        extend_tokens = sizes.extend_tokens
        extend = self.attention_pair(f"extend {extend_tokens} tokens", [extend_tokens], sizes.decode_cells[0])
        num_tokens = max(sizes.decode_batches) * 8
        out = self.randn(num_tokens, self.num_q_heads, sizes.head_dim)
        states = (out, torch.randn(num_tokens, self.num_q_heads, device=self.device))
        merge = Pair(
            "merge states",
            lambda: merge_attention_states_triton(*states, *states),
            lambda: merge_attention_states_torch(*states, *states),
            attention_difference,
        )
        return [*decode, extend, merge]

    def pairs(self) -> list[Pair]:
        return [*self.window_pairs(), self.compaction_pair(), *self.attention_pairs()]


def timed_rows(pairs: list[Pair]) -> None:
    from triton.testing import do_bench

    print(f"{torch.cuda.get_device_name()}, bf16; milliseconds (median of do_bench)")
    columns = ("torch", "triton", "vs torch", "unsplit", "split gain", "rel. diff")
    print(f"{'kernel':<92}" + "".join(f" {column:>10}" for column in columns))
    for pair in pairs:
        difference = pair.compare(pair.run_triton(), pair.run_torch())
        torch_ms, triton_ms = do_bench(pair.run_torch), do_bench(pair.run_triton)
        unsplit = ""
        if pair.run_unsplit is not None:
            difference = max(difference, pair.compare(pair.run_unsplit(), pair.run_torch()))
            unsplit_ms = do_bench(pair.run_unsplit)
            unsplit = f"{unsplit_ms:10.3f} {unsplit_ms / triton_ms:9.2f}x"
        times = f"{torch_ms:10.3f} {triton_ms:10.3f} {torch_ms / triton_ms:9.1f}x"
        print(f"{pair.name:<92} {times} {unsplit:>21} {difference:10.2e}")


def smoke_rows() -> int:
    """The Triton kernels in the interpreter at SMOKE sizes against their twins; returns the failures."""
    failures = 0
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        for pair in Builder(SMOKE, dtype, torch.device("cpu")).pairs():
            reference = pair.run_torch()
            difference = pair.compare(pair.run_triton(), reference)
            if pair.run_unsplit is not None:
                difference = max(difference, pair.compare(pair.run_unsplit(), reference))
            ok = difference <= tolerance
            failures += not ok
            print(f"  {'ok  ' if ok else 'FAIL'} {str(dtype):<15} {pair.name:<84} rel. diff {difference:.2e}")
    return failures


def main() -> int:
    if torch.cuda.is_available():
        timed_rows(Builder(SERVING, torch.bfloat16, torch.device("cuda")).pairs())
        return 0
    print("no GPU: correctness only (Triton kernels in the interpreter at small shapes, no timings)")
    return 1 if smoke_rows() else 0


if __name__ == "__main__":
    sys.exit(main())
