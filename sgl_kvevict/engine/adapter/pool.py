"""SGLang's KV pool as one allocation, so cells can hold any layer's entry (``engine.cells``).

SGLang 0.5.23's ``MHATokenToKVPool._create_buffers_normal`` allocates one tensor per layer (K and V as
the two halves of it). ``install_contiguous_kv_buffers`` replaces it, in the scheduler process and
only when compression is on, with the same layout and the same bytes in a single allocation: layer
``l``'s buffers are ``storage[l, 0, :rows]`` and ``storage[l, 1, :rows]`` (``[L, 2, padded, H_kv, D]``),
or two ``[L, rows, H_kv, D]`` tensors when K and V head dims differ. Everything SGLang does with the
buffers is unchanged (they have the same shapes, strides and dtypes); only their addresses are now
equally spaced, which ``CellSpace.of_buffers`` checks before the engine uses them.

Layouts other than plain NHD (HND pages, ROCm's vectorized 5-D layout, quantised KV, post-capture
backing) keep the stock allocation; ``cell_space_of`` then refuses them, naming the layout.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch

from sgl_kvevict.engine.cells import CellSpace

_PATCHED_FLAG = "_kvevict_contiguous"
SUPPORTED_POOL = (
    "MHATokenToKVPool with the 'nhd' layout and K and V of one unquantised dtype, which sgl-kvevict allocates as "
    "one tensor (page size 1; MLA, hybrid and quantised pools are not supported)"
)


class UnsupportedKVPool(ValueError):
    """SGLang's KV pool is not one whose cells the engine can address; the message names its layout."""


def cell_space_of(pool) -> CellSpace:
    """The cells of SGLang's KV pool ``pool`` (``CellSpace.of_buffers`` over its layer buffers), or
    ``UnsupportedKVPool`` naming its class, layout and dtype and what is supported."""
    described = (
        f"{type(pool).__name__} with layout {getattr(pool, 'kv_cache_layout', 'unknown')!r} and "
        f"dtype {getattr(pool, 'store_dtype', getattr(pool, 'dtype', 'unknown'))}"
    )
    if not (isinstance(getattr(pool, "k_buffer", None), list) and isinstance(getattr(pool, "v_buffer", None), list)):
        raise UnsupportedKVPool(f"the KV pool ({described}) has no per-layer K and V buffers; supported: {SUPPORTED_POOL}")
    try:
        return CellSpace.of_buffers(pool.k_buffer, pool.v_buffer)
    except ValueError as error:
        raise UnsupportedKVPool(f"the KV pool ({described}) is not supported: {error}; supported: {SUPPORTED_POOL}") from None


def install_contiguous_kv_buffers() -> None:
    """Make ``MHATokenToKVPool`` allocate all layers' plain NHD buffers as one tensor (idempotent)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    stock = MHATokenToKVPool._create_buffers_normal
    if getattr(stock, _PATCHED_FLAG, False):
        return

    @functools.wraps(stock)
    def create_buffers(pool) -> None:
        if pool.kv_cache_layout != "nhd":
            return stock(pool)
        _create_contiguous(pool)

    setattr(create_buffers, _PATCHED_FLAG, True)
    MHATokenToKVPool._create_buffers_normal = create_buffers


def _create_contiguous(pool) -> None:
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

    k_shape, v_shape = pool._kv_buffer_shapes()
    rows = k_shape[0]
    custom_pool = torch.cuda.use_mem_pool(pool.custom_mem_pool) if pool.enable_custom_mem_pool else nullcontext()
    with pool.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE), custom_pool:
        if k_shape == v_shape:
            # As stock: K and V are block-aligned halves of one allocation per layer (kernels with a
            # single pool base reach V by an offset), here with every layer in the same allocation.
            padded = -(-rows // pool.page_size) * pool.page_size
            storage = torch.zeros((pool.layer_num, 2, padded, *k_shape[1:]), dtype=pool.store_dtype, device=pool.device)
            pool.k_buffer = [storage[layer, 0, :rows] for layer in range(pool.layer_num)]
            pool.v_buffer = [storage[layer, 1, :rows] for layer in range(pool.layer_num)]
        else:
            k_storage = torch.zeros((pool.layer_num, *k_shape), dtype=pool.store_dtype, device=pool.device)
            v_storage = torch.zeros((pool.layer_num, *v_shape), dtype=pool.store_dtype, device=pool.device)
            pool.k_buffer = list(k_storage.unbind(0))
            pool.v_buffer = list(v_storage.unbind(0))
