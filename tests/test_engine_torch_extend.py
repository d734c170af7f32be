"""The CPU backend's extend without stock's padding: the same attention as stock's padded SDPA.

Stock ``TorchNativeAttnBackend`` pads each request's queries to its whole length, so a chunk of a
chunked prefill pays attention over its prefix again; ``KVEvictTorchBackend`` attends the new queries
to the prefix under an offset causal mask. Both run here on the same random pool and batch.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_kvevict.compat import activate_cpu_mode

activate_cpu_mode()

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402

from sgl_kvevict.engine.adapter.attention import KVEvictTorchBackend  # noqa: E402

HEAD_DIM, NUM_SLOTS = 16, 600


@pytest.mark.parametrize("num_kv_heads,group", [(2, 2), (1, 3)], ids=["kv2-g2", "kv1-g3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_extend_with_prefixes_matches_stock_padded_sdpa(num_kv_heads, group, dtype):
    """Requests with no prefix, a short one and a long one (a later chunk), in one batch."""
    generator = torch.Generator().manual_seed(0)
    prefixes, new_tokens = [0, 37, 300], [5, 64, 120]
    lengths = [p + n for p, n in zip(prefixes, new_tokens)]
    req_to_token = torch.zeros(4, 512, dtype=torch.int64)
    slots = torch.randperm(NUM_SLOTS, generator=generator)
    taken = 0
    for row, length in enumerate(lengths):
        req_to_token[row + 1, :length] = slots[taken : taken + length]
        taken += length
    k_cache = torch.randn(NUM_SLOTS, num_kv_heads, HEAD_DIM, generator=generator).to(dtype)
    v_cache = torch.randn(NUM_SLOTS, num_kv_heads, HEAD_DIM, generator=generator).to(dtype)
    query = torch.randn(sum(new_tokens), num_kv_heads * group, HEAD_DIM, generator=generator).to(dtype)
    batch = dict(
        req_to_token=req_to_token, req_pool_indices=torch.tensor([1, 2, 3]), seq_lens=torch.tensor(lengths),
        extend_prefix_lens=torch.tensor(prefixes), extend_seq_lens=torch.tensor(new_tokens),
        scaling=HEAD_DIM**-0.5, enable_gqa=group > 1, causal=True,
    )  # fmt: skip
    runner = SimpleNamespace(device=torch.device("cpu"), req_to_token_pool=None, token_to_kv_pool=None)
    ours = KVEvictTorchBackend(runner)._run_sdpa_forward_extend(query, torch.empty_like(query), k_cache, v_cache, **batch)
    stock = TorchNativeAttnBackend._run_sdpa_forward_extend(
        ours, query, torch.full_like(query, float("nan")), k_cache, v_cache, **batch
    )
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)
