"""Stock's numerics in the CPU backend: logits, softmax and weighted sums in fp32 whatever the KV dtype.

Stock's SDPA on CPU (ATen's kernel) accumulates QK and PV in fp32 for bf16 inputs; the plugin's batched
decode and its compressed extend must err against float64 no more than stock does on the same inputs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from segment_scenarios import EXTEND, NUM_LAYERS, attention_by_entry, build_scenario, layer_of, naive_attention, run_backend, torch_backend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from torch.nn.functional import scaled_dot_product_attention

from sgl_kvevict.engine import batch as batch_module
from sgl_kvevict.engine.adapter import attention as attention_module
from sgl_kvevict.engine.adapter.attention import KVEvictTorchBackend, dense_attention
from sgl_kvevict.engine.cells import CellSpace


@pytest.mark.parametrize("paged", [True, False], ids=["cpu-kernel", "padded-sdpa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_errs_against_float64_no_more_than_stock_sdpa(dtype, paged):
    """SmolLM2's shape (3 KV heads, groups of 3, head dim 64), 2000 keys: the batched decode, through the
    CPU kernel and through padded SDPA, keeps the logits, the softmax and the weighted sum in fp32 whatever
    the KV dtype, as stock's SDPA does on CPU; logits rounded to bf16 err several times more (0.031 against
    stock's 0.0044 before this was so)."""
    heads, group, dim, length = 3, 3, 64, 2000
    generator = torch.Generator().manual_seed(0)
    keys = (torch.randn(length, heads, dim, generator=generator) * 2).to(dtype)
    values = torch.randn(length, heads, dim, generator=generator).to(dtype)
    queries = (torch.randn(heads * group, dim, generator=generator) * 2).to(dtype)
    space = CellSpace.of_buffers([keys], [values])
    slots = torch.arange(length)
    rows = space.entry_rows(torch.zeros(1, 1, 1), slots.view(1, 1, -1), torch.arange(heads).view(1, -1, 1))  # [1, H_kv, L]
    decode_keys = batch_module.DecodeKeys.of_rows(rows, torch.full((1, heads), length), [length], space)
    backend = SimpleNamespace(decode_keys=decode_keys, cell_rows=(space.k_rows, space.v_rows), _paged_decode=paged)
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=heads * group, tp_k_head_num=heads, scaling=dim**-0.5)
    ours = KVEvictTorchBackend._decode_attention(backend, queries.unsqueeze(0), layer)[0]
    stock = scaled_dot_product_attention(
        queries.view(1, heads * group, 1, dim), keys.movedim(0, 1).unsqueeze(0), values.movedim(0, 1).unsqueeze(0),
        scale=layer.scaling, enable_gqa=True,
    )[0, :, 0]  # fmt: skip
    k64, v64 = keys.double().repeat_interleave(group, dim=1), values.double().repeat_interleave(group, dim=1)  # [L, H_q, D]
    exact = torch.einsum("hl,lhd->hd", torch.softmax(torch.einsum("hd,lhd->hl", queries.double(), k64) * layer.scaling, -1), v64)
    ours_error, stock_error = ((out.double() - exact).abs().max() for out in (ours, stock))
    assert ours_error <= 1.5 * stock_error + 1e-6, (float(ours_error), float(stock_error))



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compressed_extend_errs_against_float64_no_more_than_stock_sdpa(dtype):
    """The extend of compressed requests (cells and dense positions, merged by log-sum-exp) against stock
    SDPA given the same keys, per query (``segment_scenarios``; random inputs scaled so logits spread)."""
    scenario = build_scenario(EXTEND, ForwardMode.EXTEND, 2, 2, dtype=dtype)
    scenario.q.mul_(4)
    backend = torch_backend(scenario)
    for layer_id in range(NUM_LAYERS):
        layer = layer_of(layer_id, 2, 2)

        def stock_sdpa(query, keys, values):
            return scaled_dot_product_attention(query.view(1, 1, -1), keys.unsqueeze(0), values.unsqueeze(0), scale=layer.scaling)[0, 0]

        ours = run_backend(backend, scenario, layer)
        stock = attention_by_entry(scenario, layer, stock_sdpa)
        exact = naive_attention(scenario, layer)
        ours_error, stock_error = ((out.double() - exact).abs().max() for out in (ours, stock))
        assert ours_error <= 1.5 * stock_error + 1e-6, (layer_id, float(ours_error), float(stock_error))


@pytest.mark.parametrize("window_left", [None, 6])
@pytest.mark.parametrize("chunk", ["_flash_chunk", "_formula_chunk"])
def test_dense_part_is_the_causal_formula_by_position_with_its_lse(monkeypatch, window_left, chunk):
    """``dense_attention`` against float64, on CPU through ATen's flash kernel (G query heads as query rows)
    and through the formula other devices use: positions with holes (compressed ranges), a second request,
    more queries than one chunk, queries that see no key (lse -inf, out 0, so a merge weighs them 0) and a
    local layer's window."""
    monkeypatch.setattr(attention_module, "_flash_chunk", getattr(attention_module, chunk))
    generator = torch.Generator().manual_seed(1)
    batch, queries, length, heads, group, dim = 2, 600, 40, 2, 3, 16
    q = torch.randn(batch, queries, heads * group, dim, generator=generator).bfloat16()
    keys = torch.randn(batch, length, heads, dim, generator=generator).bfloat16()
    values = torch.randn(batch, length, heads, dim, generator=generator).bfloat16()
    key_positions = torch.stack([torch.arange(10, 10 + 2 * length, 2), torch.arange(length)])  # request 0: keys from 10
    query_positions = torch.arange(queries).repeat(batch, 1)
    out, lse = dense_attention(q, keys, values, query_positions, key_positions, 0.25, window_left)
    visible = key_positions[:, None, :] <= query_positions[:, :, None]
    if window_left is not None:
        visible &= key_positions[:, None, :] >= query_positions[:, :, None] - window_left
    logits = torch.einsum("btkgd,blkd->btkgl", q.double().view(batch, queries, heads, group, dim), keys.double()) * 0.25
    logits = logits.masked_fill(~visible[:, :, None, None, :], float("-inf")).flatten(2, 3)  # [B, T, H_q, L]
    exact_lse = torch.logsumexp(logits, dim=-1)
    probs = torch.nan_to_num(torch.exp(logits - exact_lse[..., None]))
    exact = torch.einsum("bthl,blhd->bthd", probs, values.double().repeat_interleave(group, dim=2))
    empty = ~visible.any(-1)
    assert empty.any() and (~empty).any()
    assert torch.isinf(lse[empty]).all() and (lse[empty] < 0).all() and (out[empty] == 0).all()
    torch.testing.assert_close(lse[~empty].double(), exact_lse[~empty], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=1e-5)
