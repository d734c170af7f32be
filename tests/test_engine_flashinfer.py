"""The CUDA (FlashInfer) segment attention, on CPU against a fake of FlashInfer's documented API.

No GPU and no real ``flashinfer`` here (what has run on a GPU: docs/gpu.md#what-ran-on-a-gpu).
``fake_flashinfer`` implements the documented semantics of exactly the calls the backend makes
(base-2 LSEs, bottom-right causal alignment, strict argument checks; checked against the real
FlashInfer on an H100); these tests run the backend's compressed + dense attention on
mixed batches and compare it with the CPU backend and with a naive float64 attention, and check
that the arguments handed to FlashInfer have the documented types, shapes and devices.

``FlashInferAttnBackend.__init__`` needs a CUDA model runner, so the backend under test is created
without it and given the attributes its segment path reads (``make_flashinfer_backend``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import fake_flashinfer
from sgl_kvevict.compat import activate_cpu_mode

activate_cpu_mode()

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from sgl_kvevict.engine.attention import KVEvictTorchBackend  # noqa: E402
from sgl_kvevict.engine.batch import CellBatchCache, ForwardRequests, RequestSlice, SegmentMetadata  # noqa: E402
from sgl_kvevict.engine.cells import CellSpace  # noqa: E402
from sgl_kvevict.engine.segments import CompressedSegment, PathView, ranges_to_positions  # noqa: E402

NUM_LAYERS, HEAD_DIM, NUM_SLOTS = 2, 16, 256


@pytest.fixture
def flashinfer_module(monkeypatch):
    """``sgl_kvevict.engine.flashinfer_backend`` imported against the fake (and forgotten afterwards)."""
    fake = fake_flashinfer.install(monkeypatch)
    monkeypatch.delitem(sys.modules, "sgl_kvevict.engine.flashinfer_backend", raising=False)
    import sgl_kvevict.engine.flashinfer_backend as module

    yield SimpleNamespace(backend=module, fake=fake)
    sys.modules.pop("sgl_kvevict.engine.flashinfer_backend", None)


@dataclass(frozen=True)
class RequestSpec:
    """A request of the batch: ``spans`` ``((start, end, cells[layer][head]), ...)`` compressed (empty = plain).

    Cell counts are given for two KV heads and cycled over the scenario's heads."""

    seq_len: int
    num_queries: int
    spans: tuple = ()


# Heads without cells (request 0 layer 0 head 1; request 2 head 0 of its second span), a plain
# request between compressed ones, and a dense range between two compressed spans (request 2).
EXTEND = (
    RequestSpec(16, 4, ((0, 10, ((3, 0), (5, 2))),)),
    RequestSpec(9, 5),
    RequestSpec(18, 3, ((0, 6, ((2, 4), (1, 3))), (9, 13, ((0, 2), (2, 0))))),
)
DECODE = tuple(RequestSpec(spec.seq_len + 1, 1, spec.spans) for spec in EXTEND)


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
    segment = CompressedSegment(start, end - start, torch.tensor(counts), torch.cat(positions))
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
            for start, end, two_head_counts in spec.spans
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
        is_cross_attention=False,
    )  # fmt: skip


def make_flashinfer_backend(module, scenario: Scenario, num_kv_heads: int = 2, group: int = 2):
    """The backend without ``FlashInferAttnBackend.__init__`` (CUDA only): the attributes its segment path reads."""
    backend = module.backend.KVEvictFlashInferBackend.__new__(module.backend.KVEvictFlashInferBackend)
    backend.req_to_token_pool = SimpleNamespace(req_to_token=scenario.req_to_token)
    backend.token_to_kv_pool = scenario.pool
    workspace = torch.empty(1 << 20, dtype=torch.uint8)
    backend.prefill_wrappers_paged = [module.fake.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")]
    layer = layer_of(0, num_kv_heads, group)
    backend._shape = module.backend.AttentionShape(
        layer.tp_q_head_num, num_kv_heads, HEAD_DIM, HEAD_DIM, layer.scaling, scenario.pool.dtype, scenario.pool.dtype
    )
    backend.cell_rows = (scenario.space.k_rows, scenario.space.v_rows)
    backend._init_segment_metadata(scenario.forward_batch, scenario.segments)
    return backend


def run_backend(backend, scenario: Scenario, layer) -> torch.Tensor:
    backend.segments = scenario.segments
    forward = backend.forward_decode if scenario.forward_batch.forward_mode.is_decode() else backend.forward_extend
    return forward(scenario.q, scenario.k, scenario.v, layer, scenario.forward_batch)


def naive_attention(scenario: Scenario, layer) -> torch.Tensor:
    """float64, per request and query head: softmax over its KV head's cells (always visible) and its
    dense positions up to the query's (the forward's own K/V already written)."""
    num_q_heads, num_kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
    group = num_q_heads // num_kv_heads
    queries = scenario.q.view(-1, num_q_heads, HEAD_DIM).double()
    k_cache, v_cache = (buffer.double() for buffer in scenario.pool.get_kv_buffer(layer.layer_id))
    cells_k, cells_v = scenario.space.k_rows.double(), scenario.space.v_rows.double()
    out = torch.zeros_like(queries)
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
                    keys, values = torch.cat([cells_k[cells], keys]), torch.cat([cells_v[cells], values])
                probs = torch.softmax(keys @ queries[token, head] * layer.scaling, dim=0)
                out[token, head] = probs @ values
    return out.view(-1, num_q_heads * HEAD_DIM)


def torch_backend(scenario: Scenario) -> KVEvictTorchBackend:
    runner = SimpleNamespace(
        device=torch.device("cpu"),
        req_to_token_pool=SimpleNamespace(req_to_token=scenario.req_to_token),
        token_to_kv_pool=scenario.pool,
    )
    backend = KVEvictTorchBackend(runner)
    backend.cell_rows = (scenario.space.k_rows, scenario.space.v_rows)
    backend._init_segment_metadata(scenario.forward_batch, scenario.segments)
    return backend


GQA = [pytest.param(2, 2, id="kv2-g2"), pytest.param(1, 3, id="kv1-g3"), pytest.param(4, 1, id="kv4-g1")]


@pytest.mark.parametrize("num_kv_heads,group", GQA)
@pytest.mark.parametrize(
    "specs,mode", [(EXTEND, ForwardMode.EXTEND), (DECODE, ForwardMode.DECODE)], ids=["extend", "decode"]
)
def test_mixed_batch_matches_cpu_backend_and_naive_attention(flashinfer_module, specs, mode, num_kv_heads, group):
    flash = build_scenario(specs, mode, num_kv_heads, group)
    cpu = build_scenario(specs, mode, num_kv_heads, group)
    backend = make_flashinfer_backend(flashinfer_module, flash, num_kv_heads, group)
    cpu_backend = torch_backend(cpu)
    for layer_id in range(NUM_LAYERS):  # the layers keep different cells per head
        layer = layer_of(layer_id, num_kv_heads, group)
        out = run_backend(backend, flash, layer)
        expected = run_backend(cpu_backend, cpu, layer)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out.double(), naive_attention(flash, layer), atol=2e-5, rtol=1e-5)
    # one plan serves every layer (same softmax scale); each layer ran the dense wrapper once
    wrapper = backend.prefill_wrappers_paged[0]
    assert len(wrapper.plan_calls) == 1 and len(wrapper.run_calls) == NUM_LAYERS


def test_bf16_batch_matches_naive_attention(flashinfer_module):
    scenario = build_scenario(EXTEND, ForwardMode.EXTEND, 2, 2, dtype=torch.bfloat16)
    backend = make_flashinfer_backend(flashinfer_module, scenario)
    layer = layer_of(1, 2, 2)
    out = run_backend(backend, scenario, layer)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_attention(scenario, layer), atol=3e-2, rtol=3e-2)


def test_flashinfer_arguments_have_the_documented_types(flashinfer_module):
    scenario = build_scenario(EXTEND, ForwardMode.EXTEND, 2, 2)
    backend = make_flashinfer_backend(flashinfer_module, scenario)
    layer = layer_of(0, 2, 2)
    run_backend(backend, scenario, layer)
    wrapper = backend.prefill_wrappers_paged[0]
    (plan,) = wrapper.plan_calls
    kv_device = scenario.pool.k_buffer[0].device
    for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_last_page_len"):  # plan schedules on the host
        assert plan[name].dtype == torch.int32 and plan[name].device.type == "cpu", name
    assert plan["paged_kv_indices"].dtype == torch.int32 and plan["paged_kv_indices"].device == kv_device
    assert plan["qo_indptr"].tolist() == [0, 4, 9, 12]
    # dense positions only: request 0 keeps [10, 16), request 1 all 9, request 2 [6, 9) and [13, 18)
    assert plan["paged_kv_indptr"].tolist() == [0, 6, 15, 23]
    assert plan["paged_kv_last_page_len"].tolist() == [1, 1, 1]
    assert 0 not in plan["paged_kv_indices"].tolist()  # no placeholder slot of a compressed position
    expected = dict(
        num_qo_heads=4, num_kv_heads=2, head_dim_qk=HEAD_DIM, head_dim_vo=HEAD_DIM, page_size=1, causal=True,
        sm_scale=layer.scaling, q_data_type=torch.float32, kv_data_type=torch.float32,
    )  # fmt: skip
    assert {key: plan[key] for key in expected} == expected
    (run,) = wrapper.run_calls
    assert run["return_lse"] and run["k_cache"].shape == (NUM_SLOTS, 1, 2, HEAD_DIM)  # NHD, page size 1


def test_merge_splits_heads_beyond_one_launch(flashinfer_module):
    module = flashinfer_module.backend
    assert module.merge_state_heads_per_launch(64, 128, 2) == 64  # 16 threads per head: 64 heads fit
    assert module.merge_state_heads_per_launch(96, 128, 2) == 48
    assert module.merge_state_heads_per_launch(7, 64, 4) == 7
    generator = torch.Generator().manual_seed(1)
    out_a, out_b = (torch.randn(3, 96, 128, generator=generator) for _ in range(2))
    lse_a, lse_b = (torch.randn(3, 96, generator=generator) for _ in range(2))
    lse_a[0, 5] = float("-inf")  # a KV head without cells
    out, lse = module.merge_states_base2(out_a, lse_a, out_b, lse_b)
    expected_out, expected_lse = fake_flashinfer.merge_state(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)
    torch.testing.assert_close(out[0, 5], out_b[0, 5])


# ---- the fake itself: documented semantics and strictness -----------------------------------------


def test_fake_returns_base2_lse_and_bottom_right_causal_attention():
    generator = torch.Generator().manual_seed(2)
    k_cache, v_cache = (torch.randn(10, 1, 2, 8, generator=generator) for _ in range(2))
    q = torch.randn(3, 4, 8, generator=generator)
    wrapper = fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    int32 = dict(dtype=torch.int32)
    wrapper.plan(
        torch.tensor([0, 3], **int32), torch.tensor([0, 5], **int32), torch.tensor([4, 2, 7, 1, 9], **int32),
        torch.tensor([1], **int32), 4, 2, 8, 1, causal=True, sm_scale=0.3, q_data_type=torch.float32,
    )  # fmt: skip
    out, lse = wrapper.run(q, (k_cache, v_cache), return_lse=True)
    keys, values = k_cache[[4, 2, 7, 1, 9], 0], v_cache[[4, 2, 7, 1, 9], 0]
    for token in range(3):
        visible = token + 3  # kv_len 5, qo_len 3: query t sees keys 0 .. t + 2
        for head in range(4):
            logits = keys[:visible, head // 2] @ q[token, head] * 0.3
            torch.testing.assert_close(lse[token, head], torch.logsumexp(logits, 0) / math.log(2))
            torch.testing.assert_close(out[token, head], torch.softmax(logits, 0) @ values[:visible, head // 2])


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(qo_indptr=torch.tensor([0, 1], dtype=torch.int64)), "int32"),
        (
            dict(
                paged_kv_indptr=torch.tensor([0, 0], dtype=torch.int32),
                paged_kv_indices=torch.zeros(0, dtype=torch.int32),
            ),
            "kv_len = 0",
        ),
        (dict(paged_kv_indices=torch.tensor([1, 2, 5], dtype=torch.int32)), "entries"),
        (dict(num_qo_heads=3), "multiple"),
        (dict(qo_indptr=torch.tensor([0, 3], dtype=torch.int32), causal=True), "qo_len > kv_len"),
        (dict(paged_kv_last_page_len=torch.tensor([0], dtype=torch.int32)), "last_page_len"),
    ],
    ids=["int64-indptr", "empty-kv", "indices-length", "gqa-ratio", "masked-rows", "last-page-len"],
)
def test_fake_plan_refuses_what_the_documentation_does_not_define(change, message):
    int32 = dict(dtype=torch.int32)
    arguments = dict(
        qo_indptr=torch.tensor([0, 1], **int32), paged_kv_indptr=torch.tensor([0, 2], **int32),
        paged_kv_indices=torch.tensor([3, 4], **int32), paged_kv_last_page_len=torch.tensor([1], **int32),
        num_qo_heads=4, num_kv_heads=2, head_dim_qk=8, page_size=1,
    )  # fmt: skip
    wrapper = fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    with pytest.raises(fake_flashinfer.FakeFlashInferError, match=message):
        wrapper.plan(**{**arguments, **change})
