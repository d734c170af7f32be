"""Batches of compressed and plain requests over a small KV pool, for the attention backends' tests.

A scenario is one forward (extend or decode) of a few requests, some with compressed segments on their
path (cells taken from slots no dense position uses, per-(layer, head) counts that differ, heads
without cells), over a pool whose placeholder slot 0 is NaN so that any read of it shows. Shared by
tests/test_engine_flashinfer.py and tests/test_engine_decode_graph.py.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import fake_flashinfer
import torch

from sgl_kvevict.compat import activate_cpu_mode

activate_cpu_mode()

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from sgl_kvevict.engine.adapter.attention import KVEvictTorchBackend  # noqa: E402
from sgl_kvevict.engine.batch import CellBatchCache, ForwardRequests, RequestSlice, SegmentMetadata  # noqa: E402
from sgl_kvevict.engine.cells import CellSpace  # noqa: E402
from sgl_kvevict.engine.segments import CompressedSegment, PathView, ranges_to_positions  # noqa: E402
from sgl_kvevict.sharding import RankCounts  # noqa: E402

NUM_LAYERS, HEAD_DIM, NUM_SLOTS = 2, 16, 256


@dataclass(frozen=True)
class RequestSpec:
    """A request of the batch: ``segments`` ``((start, end, cells[layer][head]), ...)`` compressed (empty = plain).

    Cell counts are given for two KV heads and cycled over the scenario's heads."""

    seq_len: int
    num_queries: int
    segments: tuple = ()


# Heads without cells (request 0 layer 0 head 1; request 2 head 0 of its second segment), a plain
# request between compressed ones, and a dense range between two compressed segments (request 2).
EXTEND = (
    RequestSpec(16, 4, ((0, 10, ((3, 0), (5, 2))),)),
    RequestSpec(9, 5),
    RequestSpec(18, 3, ((0, 6, ((2, 4), (1, 3))), (9, 13, ((0, 2), (2, 0))))),
)
DECODE = tuple(RequestSpec(spec.seq_len + 1, 1, spec.segments) for spec in EXTEND)


class KVPool:
    """The ``token_to_kv_pool`` surface the backends use: per-layer ``[slots, H_kv, D]`` buffers, views of one
    allocation as the engine's pool makes them (so compressed cells live in the same memory)."""

    def __init__(self, num_kv_heads: int, dtype: torch.dtype, generator: torch.Generator):
        storage = torch.randn(NUM_LAYERS, 2, NUM_SLOTS, num_kv_heads, HEAD_DIM, generator=generator).to(dtype)
        storage[:, :, 0] = float("nan")  # the placeholder slot of compressed positions: must never be read
        self.k_buffer = [storage[layer, 0] for layer in range(NUM_LAYERS)]
        self.v_buffer = [storage[layer, 1] for layer in range(NUM_LAYERS)]
        self.dtype = dtype

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer, loc, k, v):
        shape = (-1, *self.k_buffer[layer.layer_id].shape[1:])
        self.k_buffer[layer.layer_id][loc.loc] = k.view(shape)
        self.v_buffer[layer.layer_id][loc.loc] = v.view(shape)


@dataclass
class Scenario:
    segments: SegmentMetadata
    forward_batch: SimpleNamespace
    pool: KVPool
    space: CellSpace
    req_to_token: torch.Tensor
    specs: tuple
    q: torch.Tensor  # [N, H_q * D]
    k: torch.Tensor  # [N, H_kv * D]
    v: torch.Tensor


def compressed_segment(start: int, end: int, counts, free_cells: list[int], generator) -> CompressedSegment:
    """A segment keeping ``counts[layer][head]`` positions of ``[start, end)``, stored in cells taken from
    ``free_cells`` (cells of slots no dense position uses)."""
    positions = [
        start + torch.randperm(end - start, generator=generator)[:count].sort().values
        for layer_counts in counts
        for count in layer_counts
    ]  # kept positions per (layer, head), ascending (attention does not depend on them: RoPE is in the keys)
    kept = torch.cat(positions)
    per_position = torch.bincount(kept - start, minlength=end - start)[None]  # one rank keeps them all
    rank_counts = RankCounts.of_positions(start, per_position, entries_per_position=len(positions))
    segment = CompressedSegment(start, end - start, torch.tensor(counts), kept, rank_counts)
    segment.cells = torch.tensor([free_cells.pop() for _ in range(segment.num_cells)], dtype=torch.int64)
    return segment


def build_scenario(specs, mode: ForwardMode, num_kv_heads: int, group: int, dtype=torch.float32, seed=0) -> Scenario:
    generator = torch.Generator().manual_seed(seed)
    pool = KVPool(num_kv_heads, dtype, generator)
    space = CellSpace.of_buffers(pool.k_buffer, pool.v_buffer)
    slots = (torch.randperm(NUM_SLOTS - 1, generator=generator) + 1).tolist()
    free_slots, cell_slots = slots[: NUM_SLOTS // 2], torch.tensor(slots[NUM_SLOTS // 2 :])
    free_cells = space.cells_of_slots(cell_slots).flatten()[torch.randperm(len(cell_slots) * space.cells_per_slot, generator=generator)].tolist()
    req_to_token = torch.zeros(len(specs) + 1, 64, dtype=torch.int32)
    requests, q_start, out_cache_loc = [], 0, []
    for index, spec in enumerate(specs):
        row = index + 1  # row 0 unused: rows are not batch indices
        segments = [
            compressed_segment(start, end, [[heads[h % 2] for h in range(num_kv_heads)] for heads in two_head_counts], free_cells, generator)
            for start, end, two_head_counts in spec.segments
        ]  # fmt: skip
        view = PathView.of(segments, torch.device("cpu")) if segments else None
        request = RequestSlice(index, q_start, q_start + spec.num_queries, spec.seq_len, row, view)
        dense = ranges_to_positions(request.dense_ranges(), torch.device("cpu"))
        req_to_token[row, dense] = torch.tensor([free_slots.pop() for _ in range(len(dense))], dtype=torch.int32)
        out_cache_loc.append(req_to_token[row, spec.seq_len - spec.num_queries : spec.seq_len])
        requests.append(request)
        q_start += spec.num_queries
    num_tokens = q_start
    num_q_heads = num_kv_heads * group

    def tokens(heads):
        return torch.randn(num_tokens, heads * HEAD_DIM, generator=generator).to(dtype)

    seq_lens = torch.tensor([spec.seq_len for spec in specs])
    extend_lens = torch.tensor([spec.num_queries for spec in specs])
    forward_batch = SimpleNamespace(
        forward_mode=mode,
        rids=[f"request-{index}" for index in range(len(specs))],
        out_cache_loc=torch.cat(out_cache_loc).long(),
        req_pool_indices=torch.tensor([r.row for r in requests]),
        seq_lens=seq_lens,
        extend_prefix_lens=seq_lens - extend_lens,
        extend_seq_lens=extend_lens,
    )
    forward = ForwardRequests(mode.is_decode(), tuple(requests))
    segments = SegmentMetadata.of(forward, torch.device("cpu"), CellBatchCache())
    q, k, v = tokens(num_q_heads), tokens(num_kv_heads), tokens(num_kv_heads)
    return Scenario(segments, forward_batch, pool, space, req_to_token, specs, q, k, v)


def layer_of(layer_id: int, num_kv_heads: int, group: int):
    return SimpleNamespace(
        layer_id=layer_id, tp_q_head_num=num_kv_heads * group, tp_k_head_num=num_kv_heads, tp_v_head_num=num_kv_heads,
        qk_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, head_dim=HEAD_DIM, scaling=1 / math.sqrt(HEAD_DIM), logit_cap=0.0,
        is_cross_attention=False, sliding_window_size=-1,  # a global layer, as RadixAttention says it
    )  # fmt: skip


def run_backend(backend, scenario: Scenario, layer) -> torch.Tensor:
    backend.segments = scenario.segments
    forward = backend.forward_decode if scenario.forward_batch.forward_mode.is_decode() else backend.forward_extend
    return forward(scenario.q, scenario.k, scenario.v, layer, scenario.forward_batch)


def attention_by_entry(scenario: Scenario, layer, attend) -> torch.Tensor:
    """Per request, token and query head: ``attend(query [D], keys [n, D], values [n, D_v])`` over its KV
    head's cells (always visible) and its dense positions up to the query's (the forward's own K/V already
    written), the inputs in the pool's dtype. Returns ``[N, H_q * D]`` in ``attend``'s dtype."""
    num_q_heads, num_kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
    group = num_q_heads // num_kv_heads
    queries = scenario.q.view(-1, num_q_heads, HEAD_DIM)
    k_cache, v_cache = scenario.pool.get_kv_buffer(layer.layer_id)
    outputs = {}
    for request in scenario.segments.forward.requests:
        positions = ranges_to_positions(request.dense_ranges(), torch.device("cpu"))
        slots = scenario.req_to_token[request.row, positions].long()
        query_positions = torch.arange(request.first_query_position, request.seq_len)
        for token, query_position in zip(range(request.q_start, request.q_end), query_positions):
            visible = slots[positions <= query_position]
            for head in range(num_q_heads):
                kv_head = head // group
                keys, values = k_cache[visible, kv_head], v_cache[visible, kv_head]
                if request.view is not None:
                    view = request.view
                    layer_start = view.layer_offsets[layer.layer_id]
                    start = layer_start + int(view.counts[layer.layer_id, :kv_head].sum())
                    cells = view.cells[start : start + int(view.counts[layer.layer_id, kv_head])]
                    keys = torch.cat([scenario.space.k_rows[cells], keys])
                    values = torch.cat([scenario.space.v_rows[cells], values])
                outputs[token, head] = attend(queries[token, head], keys, values)
    out = torch.stack([torch.stack([outputs[token, head] for head in range(num_q_heads)]) for token in range(len(queries))])
    return out.view(-1, num_q_heads * HEAD_DIM)


def naive_attention(scenario: Scenario, layer) -> torch.Tensor:
    """float64 attention by the formula (``attention_by_entry``)."""

    def attend(query, keys, values):
        return torch.softmax(keys.double() @ query.double() * layer.scaling, dim=0) @ values.double()

    return attention_by_entry(scenario, layer, attend)


def torch_backend(scenario: Scenario) -> KVEvictTorchBackend:
    runner = SimpleNamespace(
        device=torch.device("cpu"),
        req_to_token_pool=SimpleNamespace(req_to_token=scenario.req_to_token),
        token_to_kv_pool=scenario.pool,
    )
    backend = KVEvictTorchBackend(runner)
    backend.cell_space = scenario.space  # no engine: the tests drive the metadata themselves
    backend._init_segment_metadata(scenario.forward_batch, scenario.segments)
    return backend


def flashinfer_against_fake(monkeypatch):
    """A fixture body: ``sgl_kvevict.engine.adapter.flashinfer_backend`` imported against ``fake_flashinfer`` (and
    forgotten afterwards), SGLang's FlashInfer backend creating its graph-mode decode wrappers from it."""
    fake = fake_flashinfer.install(monkeypatch)
    monkeypatch.delitem(sys.modules, "sgl_kvevict.engine.adapter.flashinfer_backend", raising=False)
    import sglang.srt.layers.attention.flashinfer_backend as stock

    monkeypatch.setattr(stock, "BatchDecodeWithPagedKVCacheWrapper", fake.BatchDecodeWithPagedKVCacheWrapper, raising=False)
    import sgl_kvevict.engine.adapter.flashinfer_backend as module

    yield SimpleNamespace(backend=module, fake=fake)
    sys.modules.pop("sgl_kvevict.engine.adapter.flashinfer_backend", None)
