"""A decode step's attention in CUDA graphs: the ``segments`` graph's body against dense FlashInfer decode.

    python -m benchmarks.decode_graph                 # CUDA + flashinfer: the table (docs/gpu.md, section 2b)
    python -m benchmarks.decode_graph --output docs/results/decode_graph_gpu.md
    python -m benchmarks.decode_graph --check         # anywhere: the body against the formula, small shapes

Runs without SGLang (the GPU machine cannot hold its CUDA stack): the parts of a decode step that the
CUDA backend's graphs run (``engine/adapter/flashinfer_backend.py``) on a synthetic batch over a page-size-1
pool, bf16. Per model shape (SmolLM2-135M: 30 layers, 3 KV heads, 9 query heads, head dim 64;
Llama-3-8B: 32 layers, 8 KV heads, 32 query heads, head dim 128), batch 1 and 8, history 2K and 8K
tokens:

* **dense**: FlashInfer's graph-mode decode wrapper over each request's whole history, one ``plan``
  per step, then every layer (stock SGLang's decode attention);
* **25% kept**: the history but its last ``RECENT`` tokens compressed, each (layer, KV head) keeping
  about a quarter of those positions (the count varies per head, as Ada-KV and LAVa make it): the
  same wrapper over the dense part, then ``DecodeGraphState.attend_with_dense`` (the ``segments``
  graph's body: compressed part and merge).

Each runs eagerly (the layers' launches after the plan) and captured in one CUDA graph per step (the
plan and fill outside it, as SGLang replays); the metadata (plan, fill) is timed apart, on the host.
Reported in milliseconds (``triton.testing.do_bench`` medians) with the ratios issue 21 asks for, and
the graphed output's largest difference to a float32 formula over the union of dense and kept keys.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from sgl_kvevict.engine.batch import ForwardRequests, RequestSlice
from sgl_kvevict.engine.cells import CellSpace
from sgl_kvevict.engine.decode_graph import (
    FITS,
    DecodeGraphState,
    GraphCapacity,
    longest_sequence,
    segment_graph_limits,
    segments_limit,
)
from sgl_kvevict.engine.segments import PathView
from sgl_kvevict.kernels import segment_attention

RECENT = 64  # the dense tail of every history (the observation window and the tokens since)
KEPT = 0.25
BF16_TOLERANCE = 3e-2


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int


SHAPES = (ModelShape("SmolLM2-135M", 30, 3, 9, 64), ModelShape("Llama-3-8B", 32, 8, 32, 128))
BATCHES, HISTORIES = (1, 8), (2048, 8192)
CHECK_SHAPE = ModelShape("check", 2, 2, 4, 64)  # head dim 64: one FlashInfer builds for


@dataclass
class Layer:
    layer_id: int
    scaling: float


class DecodeBatch:
    """``batch`` requests of ``history`` tokens each plus the new one, over one pool.

    dense_slots: per request, int64 slots of its whole context (the dense baseline reads them all);
    forward: the engine's view of the compressed batch (``PathView`` per request: kept positions of
    ``[0, history - RECENT)`` as cells of the pool, their rows in ``CellSpace``); its dense part is the
    last ``RECENT + 1`` slots of each request.
    """

    def __init__(self, shape: ModelShape, batch: int, history: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.shape, self.batch, self.history = shape, batch, history
        context = history + 1
        slots_total = batch * context + 1  # slot 0: SGLang's padding slot
        # Drawn on the device: at Llama shapes, batch 8 and 8K history, the pool is 4.3G values.
        storage = torch.empty(shape.num_layers, 2, slots_total, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype)
        storage.normal_(generator=torch.Generator(device=device).manual_seed(seed))
        self.k_buffers = [storage[layer, 0] for layer in range(shape.num_layers)]
        self.v_buffers = [storage[layer, 1] for layer in range(shape.num_layers)]
        self.space = CellSpace.of_buffers(self.k_buffers, self.v_buffers)
        order = torch.randperm(slots_total - 1, generator=generator) + 1
        self.dense_slots = [order[r * context : (r + 1) * context].to(device) for r in range(batch)]
        compressed_len = history - RECENT
        requests = []
        for index, slots in enumerate(self.dense_slots):
            view = self._view(slots, compressed_len, generator)
            requests.append(RequestSlice(index, index, index + 1, context, index, view))
        self.forward = ForwardRequests(True, tuple(requests))
        self.compressed_len = compressed_len
        self.layers = [Layer(layer, 1 / math.sqrt(shape.head_dim)) for layer in range(shape.num_layers)]
        self.queries = [
            torch.randn(batch, shape.num_q_heads, shape.head_dim, generator=generator).to(device=device, dtype=dtype)
            for _ in range(shape.num_layers)
        ]

    def _view(self, slots: torch.Tensor, compressed_len: int, generator) -> PathView:
        """Each (layer, KV head) keeps 15-35% of ``[0, compressed_len)`` (25% on average)."""
        shape, device = self.shape, slots.device
        counts = torch.empty(shape.num_layers, shape.num_kv_heads, dtype=torch.int64)
        cells, positions = [], []
        for layer in range(shape.num_layers):
            for head in range(shape.num_kv_heads):
                share = KEPT + (torch.rand((), generator=generator).item() - 0.5) * 0.2
                count = max(1, round(share * compressed_len))
                kept = torch.randperm(compressed_len, generator=generator)[:count].sort().values.to(device)
                counts[layer, head] = count
                rows = self.space.entry_rows(torch.full_like(kept, layer), slots[kept], torch.full_like(kept, head))
                cells.append(rows)
                positions.append(kept)
        cells = torch.cat(cells)
        return PathView.of_entries(((0, compressed_len),), counts, cells, torch.cat(positions), len(cells))

    def dense_part(self, compressed: bool) -> list[torch.Tensor]:
        """Per request, the slots the dense attention reads: all, or the tail after the compressed segment."""
        return [slots[self.compressed_len :] if compressed else slots for slots in self.dense_slots]

    def reference(self, compressed: bool) -> list[torch.Tensor]:
        """float32 attention per layer ``[B, H_q, D]`` over each request's dense part and, compressed, its
        kept cells: the formula, request by request."""
        shape = self.shape
        group = shape.num_q_heads // shape.num_kv_heads
        outputs = []
        for layer, queries in zip(self.layers, self.queries):
            out = torch.empty(self.batch, shape.num_q_heads, shape.head_dim, device=queries.device)
            for request, slots in zip(self.forward.requests, self.dense_part(compressed)):
                for head in range(shape.num_kv_heads):
                    keys = self.k_buffers[layer.layer_id][slots, head].float()
                    values = self.v_buffers[layer.layer_id][slots, head].float()
                    if compressed:
                        view = request.view
                        start = view.layer_offsets[layer.layer_id] + int(view.counts[layer.layer_id, :head].sum())
                        rows = view.cells[start : start + int(view.counts[layer.layer_id, head])]
                        keys = torch.cat([self.space.k_rows[rows].float(), keys])
                        values = torch.cat([self.space.v_rows[rows].float(), values])
                    q = queries[request.index, head * group : (head + 1) * group].float()
                    probs = torch.softmax(q @ keys.T * layer.scaling, dim=-1)
                    out[request.index, head * group : (head + 1) * group] = probs @ values
            outputs.append(out)
        return outputs


def dense_layout(part: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's paged layout (page size 1) of ``part``: host indptr, device indices, host last-page lengths."""
    indptr = torch.zeros(len(part) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor([len(slots) for slots in part]), 0)
    return indptr, torch.cat(part).to(torch.int32), torch.ones(len(part), dtype=torch.int32)


class DenseDecode:
    """The dense part of a step: FlashInfer's graph-mode decode wrapper on CUDA (planned per step, run per
    layer: out and natural-log lse); elsewhere (``--check``) ``kernels.segment_attention`` over each
    (request, KV head)'s dense slots read as rows ``slot * H_kv + head`` of the layer's cache."""

    def __init__(self, batch: DecodeBatch, compressed: bool):
        self.batch, self.compressed = batch, compressed
        shape, device = batch.shape, batch.k_buffers[0].device
        self.wrapper = None
        if device.type == "cuda":
            from flashinfer import BatchDecodeWithPagedKVCacheWrapper

            capacity = sum(len(slots) for slots in batch.dense_slots)
            self.wrapper = BatchDecodeWithPagedKVCacheWrapper(
                torch.empty(128 << 20, dtype=torch.uint8, device=device), "NHD", use_cuda_graph=True,
                use_tensor_cores=shape.num_q_heads // shape.num_kv_heads >= 4,
                paged_kv_indptr_buffer=torch.zeros(batch.batch + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.zeros(capacity, dtype=torch.int32, device=device),
                paged_kv_last_page_len_buffer=torch.ones(batch.batch, dtype=torch.int32, device=device),
            )  # fmt: skip

    def plan(self) -> None:
        shape, dtype = self.batch.shape, self.batch.k_buffers[0].dtype
        part = self.batch.dense_part(self.compressed)
        if self.wrapper is None:
            heads = torch.arange(shape.num_kv_heads)
            rows = torch.cat([(slots[None, :] * shape.num_kv_heads + heads[:, None]).flatten() for slots in part])
            counts = torch.tensor([len(slots) for slots in part]).repeat_interleave(shape.num_kv_heads)
            self.rows = (torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0)), rows, max(len(slots) for slots in part))
            return
        indptr, indices, last = dense_layout(part)
        self.wrapper.plan(
            indptr, indices, last, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, 1,
            q_data_type=dtype, kv_data_type=dtype, sm_scale=1 / math.sqrt(shape.head_dim),
        )  # fmt: skip

    def __call__(self, layer: Layer, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch
        k_cache, v_cache = batch.k_buffers[layer.layer_id], batch.v_buffers[layer.layer_id]
        if self.wrapper is not None:
            out, lse_base2 = self.wrapper.run(queries, (k_cache.unsqueeze(1), v_cache.unsqueeze(1)), return_lse=True)
            return out, lse_base2 * math.log(2.0)
        kv_indptr, rows, longest = self.rows
        head_dim = batch.shape.head_dim
        return segment_attention(
            queries, k_cache.view(-1, head_dim), v_cache.view(-1, head_dim), torch.arange(batch.batch + 1), kv_indptr,
            rows, batch.shape.num_kv_heads, layer.scaling, 1, longest,
        )  # fmt: skip


class Step:
    """One decode step's attention over every layer, dense or with 25% kept."""

    def __init__(self, batch: DecodeBatch, compressed: bool):
        self.batch, self.compressed = batch, compressed
        self.dense = DenseDecode(batch, compressed)
        self.state = None
        if compressed:
            rows = len(batch.space.k_rows)
            capacity = GraphCapacity(batch.batch, rows, batch.history + 1)
            self.state = DecodeGraphState(capacity, batch.shape.num_layers, batch.shape.num_kv_heads, batch.space.device, rows)
            # The bound of the segments graph the server replays for this batch (its split count).
            limits = segment_graph_limits(capacity.cells_per_sequence)
            self.cells_per_sequence = segments_limit(limits, longest_sequence(batch.forward))[1]

    def prepare(self) -> None:
        """The metadata, outside any graph: the dense part's plan, the compressed part's fill."""
        self.dense.plan()
        if self.state is not None:
            assert self.state.fill(self.batch.forward, self.batch.batch) == FITS

    def attend(self) -> list[torch.Tensor]:
        batch, outputs = self.batch, []
        for layer, queries in zip(batch.layers, batch.queries):
            out, lse = self.dense(layer, queries)
            if self.state is not None:
                out = self.state.attend_with_dense(
                    queries, layer, batch.space.k_rows, batch.space.v_rows, self.cells_per_sequence, out, lse
                )
            outputs.append(out)
        return outputs


def captured(body: Callable[[], list[torch.Tensor]]) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """``body`` captured in one CUDA graph after a warm-up on a side stream; the graph and its outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = body()
    return graph, outputs


def largest_difference(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """max |actual - expected| / max |expected| over the layers' outputs (inf where one is not finite)."""
    differences = [(a.float() - e).abs().max() / e.abs().max().clamp(min=1e-30) for a, e in zip(actual, expected)]
    return float(torch.stack(differences).nan_to_num(nan=float("inf")).max())


@dataclass(frozen=True)
class Row:
    shape: str
    batch: int
    history: int
    dense_eager: float
    dense_graphed: float
    kept_eager: float
    kept_graphed: float
    dense_metadata: float
    kept_metadata: float
    difference: float  # graphed 25% output vs the formula (relative to its largest magnitude)
    graph_vs_eager: float  # graphed vs eager 25% output


def host_ms(function: Callable[[], None], repeats: int = 20) -> float:
    """Median wall-clock milliseconds of ``function`` with the device synchronised around each call."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def measure(shape: ModelShape, batch_size: int, history: int) -> Row:
    from triton.testing import do_bench

    batch = DecodeBatch(shape, batch_size, history, torch.bfloat16, torch.device("cuda"))
    timings = {}
    for compressed in (False, True):
        step = Step(batch, compressed)
        step.prepare()
        eager_out = step.attend()
        graph, graphed_out = captured(step.attend)
        step.prepare()
        graph.replay()
        torch.cuda.synchronize()
        timings[compressed] = (do_bench(step.attend), do_bench(graph.replay), host_ms(step.prepare))
        if compressed:
            difference = largest_difference(graphed_out, batch.reference(True))
            graph_vs_eager = largest_difference(graphed_out, [out.float() for out in eager_out])
    (dense_eager, dense_graphed, dense_meta), (kept_eager, kept_graphed, kept_meta) = timings[False], timings[True]
    return Row(shape.name, batch_size, history, dense_eager, dense_graphed, kept_eager, kept_graphed, dense_meta,
               kept_meta, difference, graph_vs_eager)  # fmt: skip


def table(rows: list[Row], device: str) -> str:
    lines = [
        f"Decode-step attention, every layer, bf16, on {device} (`python -m benchmarks.decode_graph`); milliseconds "
        "(median of `triton.testing.do_bench`; metadata: host wall clock of plan + fill).",
        "",
        "| shape | batch | history | dense eager | dense graphed | 25% eager | 25% graphed | 25% graphed / dense graphed "
        "| dense / 25% (graphed) | metadata dense / 25% | 25% vs formula | graphed vs eager |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.shape} | {r.batch} | {r.history} | {r.dense_eager:.3f} | {r.dense_graphed:.3f} | {r.kept_eager:.3f} "
            f"| {r.kept_graphed:.3f} | {r.kept_graphed / r.dense_graphed:.2f}x | {r.dense_graphed / r.kept_graphed:.2f}x "
            f"| {r.dense_metadata:.3f} / {r.kept_metadata:.3f} | {r.difference:.1e} | {r.graph_vs_eager:.1e} |"
        )
    return "\n".join(lines) + "\n"


def check() -> int:
    """The step's body (torch twins on CPU, the kernels on CUDA) against the formula at a small shape,
    fp32, dense and 25% kept, batch 1 and 3; returns the failures."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # FlashInfer takes fp16/bf16
    tolerance = BF16_TOLERANCE if dtype == torch.bfloat16 else 1e-5
    failures = 0
    for batch_size in (1, 3):
        batch = DecodeBatch(CHECK_SHAPE, batch_size, RECENT + 40, dtype, device, seed=batch_size)
        for compressed in (False, True):
            step = Step(batch, compressed)
            step.prepare()
            difference = largest_difference(step.attend(), batch.reference(compressed))
            ok = difference <= tolerance
            failures += not ok
            kind = "25% kept" if compressed else "dense"
            print(f"  {'ok  ' if ok else 'FAIL'} batch {batch_size} {kind:<8} rel. diff {difference:.2e}")
    return failures


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="correctness at a small shape only (runs without a GPU)")
    parser.add_argument("--output", type=Path, help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    if args.check or not torch.cuda.is_available():
        if not args.check:
            print("no GPU: correctness only (the body against the formula at a small shape, no timings)")
        failures = check()
        return 1 if failures else 0
    rows = []
    for shape in SHAPES:
        for batch_size in BATCHES:
            for history in HISTORIES:
                rows.append(measure(shape, batch_size, history))
                print(f"  {shape.name} batch {batch_size} history {history}: done", flush=True)
    report = table(rows, torch.cuda.get_device_name())
    print(report)
    if args.output is not None:
        args.output.write_text("# Decode graphs on a GPU\n\n" + report)
    worst = max(max(r.difference for r in rows), max(r.graph_vs_eager for r in rows))
    return 0 if worst <= BF16_TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
