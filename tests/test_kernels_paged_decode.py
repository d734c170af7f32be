"""The CPU decode kernel (``sgl_kvevict.kernels.paged_decode``) against float64 attention by the formula and
against ATen's SDPA on the same keys: every dtype it takes, GQA groups, head dims that are not a multiple of
its 16 lanes, values of another width, a row store with a row stride, sequences of 0, 1 and many keys (more
than one 64-key block, and not a multiple of it), rows past a sequence's end that must not be read."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_kvevict.kernels.paged_decode import paged_decode, paged_decode_available


def test_the_kernel_builds_here():
    """Every machine this project runs on has a C++ compiler: a build that fails would make every CPU
    decode fall back to padded SDPA without a test failing."""
    assert paged_decode_available()


def random_case(dtype, group, dim, dim_v, ends, generator):
    """A row store of 500 rows (K with a row stride of dim + 8), per sequence ``ends[s]`` rows drawn from it
    (repeats allowed) and rows past the end pointing at row 499, whose values are huge: reading them would
    show."""
    sequences, width = len(ends), max(max(ends), 1) + 5
    k_store = (torch.randn(500, dim + 8, generator=generator) * 2).to(dtype)
    k_rows = k_store[:, :dim]  # row stride dim + 8
    v_rows = torch.randn(500, dim_v, generator=generator).to(dtype)
    k_rows[499], v_rows[499] = 1e4, 1e4
    rows = torch.full((sequences, width), 499, dtype=torch.int64)
    for s, n in enumerate(ends):
        rows[s, :n] = torch.randint(0, 499, (n,), generator=generator)
    q = (torch.randn(sequences, group, dim, generator=generator) * 2).to(dtype)
    return q, k_rows, v_rows, rows, torch.tensor(ends, dtype=torch.int64)


def formula(q, k_rows, v_rows, rows, ends, scale) -> torch.Tensor:
    """float64 softmax(q k^T * scale) v per sequence; 0 for a sequence without keys."""
    out = torch.zeros(q.shape[0], q.shape[1], v_rows.shape[1], dtype=torch.float64)
    for s, n in enumerate(ends.tolist()):
        if n:
            k, v = k_rows[rows[s, :n]].double(), v_rows[rows[s, :n]].double()
            out[s] = torch.softmax(q[s].double() @ k.T * scale, dim=-1) @ v
    return out


def sdpa(q, k_rows, v_rows, rows, ends, scale) -> torch.Tensor:
    """ATen's SDPA per sequence on its gathered keys, in the inputs' dtype (stock's CPU decode kernel)."""
    out = torch.zeros(q.shape[0], q.shape[1], v_rows.shape[1], dtype=q.dtype)
    for s, n in enumerate(ends.tolist()):
        if n:
            k, v = k_rows[rows[s, :n]].unsqueeze(0), v_rows[rows[s, :n]].unsqueeze(0)
            out[s] = scaled_dot_product_attention(q[s].unsqueeze(0), k, v, scale=scale)[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group, dim, dim_v", [(3, 64, 64), (1, 128, 128), (4, 80, 48), (7, 24, 24)])
def test_paged_decode_is_the_formula_and_errs_no_more_than_sdpa(dtype, group, dim, dim_v):
    generator = torch.Generator().manual_seed(group * 1000 + dim)
    case = random_case(dtype, group, dim, dim_v, [0, 1, 63, 64, 65, 300], generator)
    scale = dim**-0.5
    ours = paged_decode(*case, scale)
    assert ours.dtype == dtype and ours.shape == (6, group, dim_v)
    exact = formula(*case, scale)
    assert torch.equal(ours[0], torch.zeros_like(ours[0]))  # no keys: 0
    ours_error = (ours.double() - exact)[1:].abs().max()
    stock_error = (sdpa(*case, scale).double() - exact)[1:].abs().max()
    assert ours_error <= 1.5 * stock_error + 1e-6, (float(ours_error), float(stock_error))


def test_paged_decode_refuses_what_it_cannot_read():
    generator = torch.Generator().manual_seed(0)
    q, k_rows, v_rows, rows, ends = random_case(torch.float32, 2, 16, 16, [3, 4], generator)
    with pytest.raises(RuntimeError, match="share one dtype"):
        paged_decode(q, k_rows.to(torch.bfloat16), v_rows, rows, ends, 0.25)
    with pytest.raises(RuntimeError, match="int64"):
        paged_decode(q, k_rows, v_rows, rows.to(torch.int32), ends, 0.25)
    with pytest.raises(RuntimeError, match="unit inner stride"):
        paged_decode(q, k_rows.T.contiguous().T, v_rows, rows, ends, 0.25)
