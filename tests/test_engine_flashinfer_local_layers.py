"""Gemma 3's local layers on the FlashInfer path, on CPU against the fake's documented window contract.

No GPU and no real ``flashinfer`` here: ``fake_flashinfer`` implements ``window_left`` as FlashInfer's
mask does (``variants.cuh``). A Gemma 3-shaped pool (``local_layer_batch``: three local layers with a
16-token window whose compressed nodes keep their last window, then a global one) is attended by the
CUDA backend built without ``FlashInferAttnBackend.__init__`` (CUDA only), with SGLang's two wrapper sets
for a sliding-window model. Over decode steps past the window, with windows that start inside compressed
nodes, a node compressed between steps, a split, requests leaving and joining, and over extends of
several queries, each local layer's output equals the float64 windowed formula over the dense keys and
the torch backend's; the global layer's equals the torch backend's (dense part + cells). The plans: one
per wrapper per forward, the local one with ``window_left`` = SGLang's ``sliding_window_size``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from local_layer_batch import GROUP, HEAD_DIM, KV_HEADS, LOCAL, NUM_LAYERS, WINDOW, Batch, change_path, gemma_batch, local_layer
from segment_scenarios import flashinfer_against_fake, layer_of
from sglang.srt.layers.attention.flashinfer_backend import WrapperDispatch

import fake_flashinfer
from sgl_kvevict.engine.adapter.attention import KVEvictTorchBackend
from sgl_kvevict.engine.batch import CellBatchCache, SegmentMetadata, WindowKeysCache

GLOBAL_LAYER = layer_of(NUM_LAYERS - 1, KV_HEADS, GROUP)
LOCAL_WRAPPER, GLOBAL_WRAPPER = 0, 1  # SGLang's indices for a sliding-window model (``_get_wrapper_idx``)


@pytest.fixture
def backends(monkeypatch):
    """``build(batch)``: the FlashInfer backend (against the fake) and the torch backend over ``batch``, both
    with an engine whose local layers are ``LOCAL``."""
    module = next(flashinfer_against_fake(monkeypatch))
    engine = property(lambda self: SimpleNamespace(local_layers=LOCAL))
    flash_class = module.backend.KVEvictFlashInferBackend
    monkeypatch.setattr(flash_class, "engine", engine)
    monkeypatch.setattr(KVEvictTorchBackend, "engine", engine)

    def build(batch: Batch):
        flash = flash_class.__new__(flash_class)
        flash.req_to_token_pool = SimpleNamespace(req_to_token=batch.req_to_token)
        flash.token_to_kv_pool = batch.pool
        workspace = torch.empty(1 << 20, dtype=torch.uint8)
        flash.prefill_wrappers_paged = [module.fake.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD") for _ in range(2)]
        flash.num_wrappers, flash.dispatch_reason = 2, WrapperDispatch.SLIDING_WINDOW
        flash._shape = module.backend.AttentionShape(
            KV_HEADS * GROUP, KV_HEADS, HEAD_DIM, HEAD_DIM, GLOBAL_LAYER.scaling, torch.float32, torch.float32
        )
        flash.cell_space = batch.space
        flash._window_keys, flash._cell_batches = WindowKeysCache(), CellBatchCache()
        runner = SimpleNamespace(
            device=torch.device("cpu"), req_to_token_pool=flash.req_to_token_pool, token_to_kv_pool=batch.pool
        )
        torch_backend = KVEvictTorchBackend(runner)
        torch_backend.cell_space = batch.space
        return flash, torch_backend

    return build


def forward_step(batch: Batch, backends_, new_tokens=None):
    """The next forward of ``batch`` given to both backends; returns it, its forward batch and the queries."""
    forward, forward_batch = batch.step(new_tokens)
    for backend in backends_:
        segments = SegmentMetadata.of(forward, torch.device("cpu"), backend._cell_batches)
        backend._init_segment_metadata(forward_batch, segments)
        backend.segments = segments
    queries = torch.randn(forward_batch.out_cache_loc.shape[0], KV_HEADS * GROUP * HEAD_DIM, generator=batch.generator)
    return forward, forward_batch, queries


def attend(backend, layer, forward_batch, queries) -> torch.Tensor:
    run = backend.forward_decode if forward_batch.forward_mode.is_decode() else backend.forward_extend
    return run(queries, None, None, layer, forward_batch, save_kv_cache=False)


def assert_layers_match(batch: Batch, flash, torch_backend, forward, forward_batch, queries) -> None:
    for layer_id in LOCAL.layers:
        layer = local_layer(layer_id)
        out = attend(flash, layer, forward_batch, queries)
        assert torch.isfinite(out).all()
        expected = batch.windowed_formula(layer, queries.view(-1, KV_HEADS * GROUP, HEAD_DIM), forward)
        torch.testing.assert_close(out.view_as(expected).double(), expected, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out, attend(torch_backend, layer, forward_batch, queries), atol=2e-5, rtol=1e-5)
    out = attend(flash, GLOBAL_LAYER, forward_batch, queries)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, attend(torch_backend, GLOBAL_LAYER, forward_batch, queries), atol=2e-5, rtol=1e-5)


def test_decode_past_the_window_through_path_changes_is_the_windowed_formula(backends):
    batch = gemma_batch()
    flash, torch_backend = backends(batch)
    for step in range(40):  # every request decodes past its window
        change_path(batch, step)
        forward, forward_batch, queries = forward_step(batch, (flash, torch_backend))
        assert_layers_match(batch, flash, torch_backend, forward, forward_batch, queries)
    # Kept across decode steps: built at the first step and at each change of the batch, as the torch backend's.
    assert flash._window_keys.builds == torch_backend._window_keys.builds == 5


def test_an_extend_windows_every_request_plain_ones_included(backends):
    batch = gemma_batch()  # windows that start inside a node, a plain request, two nodes, a short one
    flash, torch_backend = backends(batch)
    forward, forward_batch, queries = forward_step(batch, (flash, torch_backend), new_tokens=(5, 20, 3, 1))
    assert_layers_match(batch, flash, torch_backend, forward, forward_batch, queries)
    # One plan per wrapper for the whole forward (every layer shares the scale), each layer one run.
    local_wrapper, global_wrapper = flash.prefill_wrappers_paged
    (local_plan,), (global_plan,) = local_wrapper.plan_calls, global_wrapper.plan_calls
    assert local_plan["window_left"] == WINDOW - 1 and global_plan["window_left"] == -1
    assert local_plan["causal"] and global_plan["causal"]
    assert len(local_wrapper.run_calls) == len(LOCAL.layers) and len(global_wrapper.run_calls) == 1
    # Each request's keys from its first query's window start to its last query, request-major in rows of
    # the padded width: the inside request 29 + 5 long reads [14, 34), the plain 9 + 20 all 29.
    spans = [r.seq_len - max(0, s.first_query_position - WINDOW + 1) for r, s in zip(batch.requests, forward.requests)]
    assert spans == [20, 29, 18, 5]
    assert local_plan["paged_kv_indptr"].tolist() == [0, 20, 49, 67, 72]
    assert local_plan["qo_indptr"].tolist() == [0, 5, 25, 28, 29]
    width = max(spans)
    assert local_plan["paged_kv_indices"].tolist() == [b * width + j for b, n in enumerate(spans) for j in range(n)]
    assert local_plan["paged_kv_indices"].dtype == torch.int32
    for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_last_page_len"):  # plan schedules on the host
        assert local_plan[name].dtype == torch.int32 and local_plan[name].device.type == "cpu", name
    k_cache = local_wrapper.run_calls[0]["k_cache"]
    assert k_cache.shape == (len(spans) * width, 1, KV_HEADS, HEAD_DIM)  # NHD, page size 1: the gathered window


def test_decode_graphs_are_refused_for_a_model_with_local_layers(monkeypatch):
    module = next(flashinfer_against_fake(monkeypatch))
    flash_class = module.backend.KVEvictFlashInferBackend
    flash = flash_class.__new__(flash_class)
    flash.dispatch_reason = WrapperDispatch.SLIDING_WINDOW
    with pytest.raises(NotImplementedError, match="--cuda-graph-backend-decode disabled"):
        flash.init_segment_graph_state(4)


def test_fake_window_left_is_flashinfers_mask():
    """Query ``i`` of ``qo_len`` over ``kv_len`` keys sees ``j`` iff ``a - window_left <= j <= a`` with
    ``a = i + kv_len - qo_len`` (bottom-right), and without ``causal`` the window alone bounds it on the left."""
    generator = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(12, 1, 1, 8, generator=generator) for _ in range(2))
    q = torch.randn(4, 2, 8, generator=generator)
    int32 = dict(dtype=torch.int32)
    for causal in (True, False):
        wrapper = fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
        wrapper.plan(
            torch.tensor([0, 4], **int32), torch.tensor([0, 10], **int32), torch.arange(10, **int32),
            torch.tensor([1], **int32), 2, 1, 8, 1, causal=causal, sm_scale=0.5, window_left=3, q_data_type=torch.float32,
        )  # fmt: skip
        out, lse = wrapper.run(q, (k_cache, v_cache), return_lse=True)
        for token in range(4):
            aligned = token + 6  # kv_len 10, qo_len 4
            last = aligned if causal else 9
            keys, values = k_cache[aligned - 3 : last + 1, 0, 0], v_cache[aligned - 3 : last + 1, 0, 0]
            for head in range(2):
                logits = keys @ q[token, head] * 0.5
                torch.testing.assert_close(lse[token, head], torch.logsumexp(logits, 0) / math.log(2))
                torch.testing.assert_close(out[token, head], torch.softmax(logits, 0) @ values)
