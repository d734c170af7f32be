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
from types import SimpleNamespace

import pytest
import torch

import fake_flashinfer
from sgl_kvevict.compat import activate_cpu_mode

activate_cpu_mode()

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

import segment_scenarios as scenarios  # noqa: E402


@pytest.fixture
def flashinfer_module(monkeypatch):
    yield from scenarios.flashinfer_against_fake(monkeypatch)


def make_flashinfer_backend(module, scenario: scenarios.Scenario, num_kv_heads: int = 2, group: int = 2):
    """The backend without ``FlashInferAttnBackend.__init__`` (CUDA only): the attributes its segment path reads."""
    backend = module.backend.KVEvictFlashInferBackend.__new__(module.backend.KVEvictFlashInferBackend)
    backend.req_to_token_pool = SimpleNamespace(req_to_token=scenario.req_to_token)
    backend.token_to_kv_pool = scenario.pool
    workspace = torch.empty(1 << 20, dtype=torch.uint8)
    backend.prefill_wrappers_paged = [module.fake.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")]
    backend.num_wrappers, backend.dispatch_reason = 1, None  # a model without local layers: one wrapper set
    layer = scenarios.layer_of(0, num_kv_heads, group)
    head_dim, dtype = scenarios.HEAD_DIM, scenario.pool.dtype
    backend._shape = module.backend.AttentionShape(
        layer.tp_q_head_num, num_kv_heads, head_dim, head_dim, layer.scaling, dtype, dtype
    )
    backend.cell_space = scenario.space
    backend._init_segment_metadata(scenario.forward_batch, scenario.segments)
    return backend


GQA = [pytest.param(2, 2, id="kv2-g2"), pytest.param(1, 3, id="kv1-g3"), pytest.param(4, 1, id="kv4-g1")]
MODES = [(scenarios.EXTEND, ForwardMode.EXTEND), (scenarios.DECODE, ForwardMode.DECODE)]


@pytest.mark.parametrize("num_kv_heads,group", GQA)
@pytest.mark.parametrize("specs,mode", MODES, ids=["extend", "decode"])
def test_mixed_batch_matches_cpu_backend_and_naive_attention(flashinfer_module, specs, mode, num_kv_heads, group):
    flash = scenarios.build_scenario(specs, mode, num_kv_heads, group)
    cpu = scenarios.build_scenario(specs, mode, num_kv_heads, group)
    backend = make_flashinfer_backend(flashinfer_module, flash, num_kv_heads, group)
    cpu_backend = scenarios.torch_backend(cpu)
    for layer_id in range(scenarios.NUM_LAYERS):  # the layers keep different cells per head
        layer = scenarios.layer_of(layer_id, num_kv_heads, group)
        out = scenarios.run_backend(backend, flash, layer)
        expected = scenarios.run_backend(cpu_backend, cpu, layer)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out.double(), scenarios.naive_attention(flash, layer), atol=2e-5, rtol=1e-5)
    # one plan serves every layer (same softmax scale); each layer ran the dense wrapper once
    wrapper = backend.prefill_wrappers_paged[0]
    assert len(wrapper.plan_calls) == 1 and len(wrapper.run_calls) == scenarios.NUM_LAYERS


def test_bf16_batch_matches_naive_attention(flashinfer_module):
    scenario = scenarios.build_scenario(scenarios.EXTEND, ForwardMode.EXTEND, 2, 2, dtype=torch.bfloat16)
    backend = make_flashinfer_backend(flashinfer_module, scenario)
    layer = scenarios.layer_of(1, 2, 2)
    out = scenarios.run_backend(backend, scenario, layer)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), scenarios.naive_attention(scenario, layer), atol=3e-2, rtol=3e-2)


def test_flashinfer_arguments_have_the_documented_types(flashinfer_module):
    scenario = scenarios.build_scenario(scenarios.EXTEND, ForwardMode.EXTEND, 2, 2)
    backend = make_flashinfer_backend(flashinfer_module, scenario)
    layer = scenarios.layer_of(0, 2, 2)
    scenarios.run_backend(backend, scenario, layer)
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
        num_qo_heads=4, num_kv_heads=2, head_dim_qk=scenarios.HEAD_DIM, head_dim_vo=scenarios.HEAD_DIM, page_size=1,
        causal=True, sm_scale=layer.scaling, q_data_type=torch.float32, kv_data_type=torch.float32,
    )  # fmt: skip
    assert {key: plan[key] for key in expected} == expected
    (run,) = wrapper.run_calls
    assert run["return_lse"]
    assert run["k_cache"].shape == (scenarios.NUM_SLOTS, 1, 2, scenarios.HEAD_DIM)  # NHD, page size 1


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
