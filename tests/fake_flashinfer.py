"""A CPU stand-in for the part of FlashInfer's documented Python API that sgl-kvevict calls.

``install(monkeypatch)`` puts it in ``sys.modules`` as ``flashinfer`` (and ``flashinfer.cascade``).
It implements exactly:

* ``BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD", backend=...)``,
  ``.plan(...)`` and ``.run(q, paged_kv_cache, return_lse=...)``, documented at
  https://docs.flashinfer.ai/api/prefill.html (``plan``: qo/kv indptr ``[B + 1]``, indices
  ``[kv_indptr[-1]]``, last-page lengths ``[B]``, ``num_qo_heads`` a multiple of ``num_kv_heads``,
  ``causal`` and ``sm_scale`` (default ``1/sqrt(head_dim)``) fixed at plan time, ``q_data_type`` /
  ``kv_data_type`` checked at run; ``run``: ``q`` ``[qo_indptr[-1], H_q, D]``, the cache a tuple of
  4-D NHD tensors ``[pages, page_size, H_kv, D]``, returns out (``o_data_type`` = q's dtype) and,
  with ``return_lse``, lse fp32 ``[qo_indptr[-1], H_q]``); ``window_left`` (plan time, ``-1``: none) is
  "the left (inclusive) window size": query ``i`` also needs ``j >= i + kv_len - qo_len - window_left``,
  the mask of FlashInfer's ``variants.cuh`` (``kv_idx + qo_len + window_left >= kv_len + qo_idx``);
* ``BatchDecodeWithPagedKVCacheWrapper`` in CUDA-graph mode, the mode SGLang's decode graphs use
  (https://docs.flashinfer.ai/api/decode.html): ``use_cuda_graph=True`` with fixed
  ``paged_kv_indptr_buffer`` ``[B + 1]``, ``paged_kv_indices_buffer`` and
  ``paged_kv_last_page_len_buffer`` ``[B]``; the batch size is fixed for the wrapper's life and the
  indices must fit the buffer (``plan`` refuses otherwise, as FlashInfer does); ``plan`` copies the
  layout into those buffers and fixes heads, page size (1 here), scale and dtypes; ``run(q,
  paged_kv_cache, return_lse=...)`` reads the buffers *when it runs*, with shapes fixed by the buffers,
  so a replayed graph (or a traced body) computes from whatever the last ``plan`` left there;
* ``flashinfer.cascade.merge_state(v_a, s_a, v_b, s_b)``
  (https://docs.flashinfer.ai/generated/flashinfer.cascade.merge_state.html).

Semantics that the pages leave implicit, and how the fake settles them:

* **LSE base 2.** The kernels fold ``log2(e)`` into the scale and return ``log2 sum exp(s)``
  (flashinfer-ai/flashinfer#2113, and #5257 which adds ``lse_base`` with ``"log2"`` the default);
  ``merge_state`` combines with ``exp2``. The fake does the same, so forgetting a conversion fails.
* **Causal alignment** is bottom-right: query ``i`` of a request with ``qo_len`` queries and
  ``kv_len`` keys sees key ``j`` iff ``j <= i + kv_len - qo_len`` (append attention).
* **Paged lengths**: ``kv_len = (pages - 1) * page_size + last_page_len``, ``1 <= last_page_len
  <= page_size`` (the decode page's example states the bound).
* **Strictness where behaviour is undocumented or known to misbehave**: ``kv_len = 0`` and causal
  ``qo_len > kv_len`` (fully masked rows; flashinfer-ai/flashinfer#4452) are refused at ``plan``,
  so code that relies on them fails here instead of on a GPU. Index tensors must be int32 (the
  dtype SGLang plans with and the kernels are instantiated for), HND layout is not implemented.

The fake also accepts fp32 q/KV (real kernels take fp16/bf16) so the tests can compare at fp32
tolerance. ``plan_calls`` / ``run_calls`` record the arguments for the contract tests.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass

import torch

_INDEX_DTYPE = torch.int32


class FakeFlashInferError(ValueError):
    """An argument the documented API does not accept (or whose behaviour it does not define)."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise FakeFlashInferError(message)


def _check_index(name: str, tensor: torch.Tensor, length: int | None = None) -> None:
    _check(isinstance(tensor, torch.Tensor) and tensor.dim() == 1, f"{name} must be a 1-D tensor")
    _check(tensor.dtype == _INDEX_DTYPE, f"{name} must be int32, got {tensor.dtype}")
    if length is not None:
        _check(len(tensor) == length, f"{name} has {len(tensor)} entries, expected {length}")


def _check_indptr(name: str, indptr: torch.Tensor, batch_size: int) -> None:
    _check_index(name, indptr, batch_size + 1)
    _check(int(indptr[0]) == 0 and bool((indptr[1:] >= indptr[:-1]).all()), f"{name} must start at 0 and not decrease")


@dataclass(frozen=True)
class _Plan:
    qo_indptr: torch.Tensor  # host copies, as FlashInfer's plan makes them
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int
    causal: bool
    sm_scale: float
    window_left: int
    q_data_type: torch.dtype
    kv_data_type: torch.dtype


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", backend: str = "auto"):
        _check(float_workspace_buffer.dtype == torch.uint8, "the float workspace buffer must be uint8")
        if kv_layout != "NHD":
            raise NotImplementedError(f"the fake implements the NHD layout only, not {kv_layout}")
        self.device = float_workspace_buffer.device
        self._plan: _Plan | None = None
        self.plan_calls: list[dict] = []
        self.run_calls: list[dict] = []

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        causal: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        q_data_type: torch.dtype = torch.float16,
        kv_data_type: torch.dtype | None = None,
        non_blocking: bool = True,
    ) -> None:
        self.plan_calls.append(dict(
            qo_indptr=qo_indptr, paged_kv_indptr=paged_kv_indptr, paged_kv_indices=paged_kv_indices,
            paged_kv_last_page_len=paged_kv_last_page_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk, page_size=page_size, head_dim_vo=head_dim_vo, causal=causal, sm_scale=sm_scale,
            window_left=window_left, q_data_type=q_data_type, kv_data_type=kv_data_type,
        ))  # fmt: skip
        _check(isinstance(window_left, int) and window_left >= -1, "window_left: -1 or a size")
        batch_size = len(qo_indptr) - 1
        _check(batch_size >= 1, "qo_indptr must describe at least one request")
        _check_indptr("qo_indptr", qo_indptr, batch_size)
        _check_indptr("paged_kv_indptr", paged_kv_indptr, batch_size)
        _check_index("paged_kv_last_page_len", paged_kv_last_page_len, batch_size)
        _check_index("paged_kv_indices", paged_kv_indices, int(paged_kv_indptr[-1]))
        _check(num_kv_heads >= 1 and num_qo_heads % num_kv_heads == 0, "num_qo_heads: a multiple of num_kv_heads")
        _check(page_size >= 1, "page_size must be positive")
        # plan reads the layout on the host (a device tensor costs a synchronising copy, not an error)
        qo_host, kv_host = qo_indptr.cpu(), paged_kv_indptr.cpu()
        last_host = paged_kv_last_page_len.cpu()
        pages = kv_host[1:] - kv_host[:-1]
        _check(bool((pages >= 1).all()), "kv_len = 0: FlashInfer does not document empty KV sequences")
        _check(bool(((last_host >= 1) & (last_host <= page_size)).all()), "need 1 <= last_page_len <= page_size")
        kv_lens = (pages - 1) * page_size + last_host
        if causal:
            _check(bool((qo_host[1:] - qo_host[:-1] <= kv_lens).all()), "causal with qo_len > kv_len (masked rows)")
        self._plan = _Plan(
            qo_indptr=qo_host.long(),
            kv_indptr=kv_host.long(),
            kv_indices=paged_kv_indices.long(),
            kv_lens=kv_lens.long(),
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk,
            head_dim_vo=head_dim_qk if head_dim_vo is None else head_dim_vo,
            page_size=page_size,
            causal=causal,
            sm_scale=1.0 / math.sqrt(head_dim_qk) if sm_scale is None else sm_scale,
            window_left=window_left,
            q_data_type=q_data_type,
            kv_data_type=q_data_type if kv_data_type is None else kv_data_type,
        )

    def run(self, q: torch.Tensor, paged_kv_cache, *, return_lse: bool = False):
        plan = self._plan
        _check(plan is not None, "run before plan")
        _check(isinstance(paged_kv_cache, tuple) and len(paged_kv_cache) == 2, "the fake takes (k_cache, v_cache)")
        k_cache, v_cache = paged_kv_cache
        self.run_calls.append(dict(q=q, k_cache=k_cache, v_cache=v_cache, return_lse=return_lse))
        _check(q.dtype == plan.q_data_type, f"q is {q.dtype}, planned {plan.q_data_type}")
        kv_dtype = plan.kv_data_type
        _check(k_cache.dtype == kv_dtype == v_cache.dtype, f"kv cache is {k_cache.dtype}, planned {kv_dtype}")
        _check(
            tuple(q.shape) == (int(plan.qo_indptr[-1]), plan.num_qo_heads, plan.head_dim_qk),
            f"q shape {tuple(q.shape)} does not match the plan",
        )
        _check(k_cache.dim() == 4 and v_cache.dim() == 4, "NHD caches are 4-D [pages, page_size, H_kv, D]")
        _check(
            k_cache.shape[1:] == (plan.page_size, plan.num_kv_heads, plan.head_dim_qk)
            and v_cache.shape[1:] == (plan.page_size, plan.num_kv_heads, plan.head_dim_vo),
            f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match the plan",
        )
        _check(plan.kv_indices.device == k_cache.device, "paged_kv_indices must be on the cache's device")
        group = plan.num_qo_heads // plan.num_kv_heads
        out = torch.empty(*q.shape[:-1], plan.head_dim_vo, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[0], plan.num_qo_heads, dtype=torch.float32, device=q.device)
        for request in range(len(plan.qo_indptr) - 1):
            q_start, q_end = int(plan.qo_indptr[request]), int(plan.qo_indptr[request + 1])
            pages = plan.kv_indices[int(plan.kv_indptr[request]) : int(plan.kv_indptr[request + 1])]
            kv_len = int(plan.kv_lens[request])
            keys = k_cache[pages].flatten(0, 1)[:kv_len].float()  # [kv_len, H_kv, D]
            values = v_cache[pages].flatten(0, 1)[:kv_len].float()
            queries = q[q_start:q_end].float().view(q_end - q_start, plan.num_kv_heads, group, -1)
            logits = torch.einsum("tkgd,lkd->tkgl", queries, keys) * plan.sm_scale
            aligned = torch.arange(q_end - q_start)[:, None] + kv_len - (q_end - q_start)  # bottom-right
            visible = torch.ones(q_end - q_start, kv_len, dtype=torch.bool)
            if plan.causal:
                visible &= torch.arange(kv_len)[None, :] <= aligned
            if plan.window_left >= 0:
                visible &= torch.arange(kv_len)[None, :] >= aligned - plan.window_left
            logits = logits.masked_fill(~visible[:, None, None, :].to(logits.device), float("-inf"))
            lse_e = torch.logsumexp(logits, dim=-1)
            probs = torch.exp(logits - lse_e[..., None])
            attended = torch.einsum("tkgl,lkd->tkgd", probs, values)
            out[q_start:q_end] = attended.reshape(q_end - q_start, plan.num_qo_heads, -1)
            lse[q_start:q_end] = (lse_e / math.log(2.0)).reshape(q_end - q_start, plan.num_qo_heads)
        return (out, lse) if return_lse else out


@dataclass(frozen=True)
class _DecodePlan:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    sm_scale: float
    q_data_type: torch.dtype
    kv_data_type: torch.dtype


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        backend: str = "auto",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
    ):
        _check(float_workspace_buffer.dtype == torch.uint8, "the float workspace buffer must be uint8")
        if kv_layout != "NHD" or not use_cuda_graph:
            raise NotImplementedError("the fake implements the NHD layout in CUDA-graph mode only")
        buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        _check(all(isinstance(buffer, torch.Tensor) for buffer in buffers), "CUDA-graph mode needs the three buffers")
        for name, buffer in zip(("indptr", "indices", "last_page_len"), buffers):
            _check_index(f"paged_kv_{name}_buffer", buffer)
        self._fixed_batch_size = len(paged_kv_indptr_buffer) - 1
        _check_index("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer, self._fixed_batch_size)
        self._paged_kv_indptr_buf, self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf = buffers
        self._plan: _DecodePlan | None = None
        self.plan_calls: list[dict] = []

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type: torch.dtype = torch.float16,
        kv_data_type: torch.dtype | None = None,
        data_type: torch.dtype | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
    ) -> None:
        self.plan_calls.append(dict(indptr=indptr, indices=indices, last_page_len=last_page_len, page_size=page_size,
                                    sm_scale=sm_scale, disable_split_kv=disable_split_kv))  # fmt: skip
        batch_size = len(indptr) - 1
        _check(batch_size == self._fixed_batch_size,
               f"the batch size is fixed in CUDA-graph mode: {batch_size} planned, {self._fixed_batch_size} set")  # fmt: skip
        _check_indptr("indptr", indptr, batch_size)
        _check_index("last_page_len", last_page_len, batch_size)
        _check_index("indices", indices, int(indptr[-1]))
        _check(len(indices) <= len(self._paged_kv_indices_buf), "the indices exceed the allocated buffer")
        _check(num_kv_heads >= 1 and num_qo_heads % num_kv_heads == 0, "num_qo_heads: a multiple of num_kv_heads")
        if page_size != 1:
            raise NotImplementedError("the fake's decode wrapper implements page size 1 (sgl-kvevict's) only")
        _check(bool((indptr[1:] > indptr[:-1]).all()), "kv_len = 0: FlashInfer does not document empty KV sequences")
        _check(bool((last_page_len == 1).all()), "need 1 <= last_page_len <= page_size")
        _check(pos_encoding_mode == "NONE" and logits_soft_cap is None and window_left == -1, "not implemented")
        _check(indices.device == self._paged_kv_indices_buf.device, "indices must be on the buffers' device")
        self._paged_kv_indptr_buf.copy_(indptr, non_blocking=non_blocking)
        self._paged_kv_indices_buf[: len(indices)].copy_(indices, non_blocking=non_blocking)
        self._paged_kv_last_page_len_buf.copy_(last_page_len, non_blocking=non_blocking)
        kv_dtype = kv_data_type or data_type or q_data_type
        scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
        self._plan = _DecodePlan(num_qo_heads, num_kv_heads, head_dim, scale, q_data_type, kv_dtype)

    def run(self, q: torch.Tensor, paged_kv_cache, *, return_lse: bool = False):
        """Every request's query over its keys, from the buffers as they are now: every buffer entry is
        read and the entries of other requests (and stale ones past the batch's) are masked out, so the
        shapes depend on the buffers alone."""
        plan = self._plan
        _check(plan is not None, "run before plan")
        _check(isinstance(paged_kv_cache, tuple) and len(paged_kv_cache) == 2, "the fake takes (k_cache, v_cache)")
        k_cache, v_cache = paged_kv_cache
        batch_size, group = self._fixed_batch_size, plan.num_qo_heads // plan.num_kv_heads
        _check(q.dtype == plan.q_data_type and k_cache.dtype == plan.kv_data_type == v_cache.dtype, "dtypes differ from the plan")
        _check(tuple(q.shape) == (batch_size, plan.num_qo_heads, plan.head_dim), f"q shape {tuple(q.shape)} does not match the plan")
        _check(k_cache.dim() == 4 and k_cache.shape[1:] == (1, plan.num_kv_heads, plan.head_dim), "NHD caches [pages, 1, H_kv, D]")
        indptr, entries = self._paged_kv_indptr_buf.long(), self._paged_kv_indices_buf.long()
        position = torch.arange(len(entries), device=entries.device)
        owned = (position[None, :] >= indptr[:-1, None]) & (position[None, :] < indptr[1:, None])  # [B, N]
        keys, values = k_cache[entries, 0].float(), v_cache[entries, 0].float()  # [N, H_kv, D]
        queries = q.float().view(batch_size, plan.num_kv_heads, group, plan.head_dim)
        logits = torch.einsum("bkgd,nkd->bkgn", queries, keys) * plan.sm_scale
        logits = logits.masked_fill(~owned[:, None, None, :], float("-inf"))
        lse_e = torch.logsumexp(logits, dim=-1)
        probs = torch.exp(logits - lse_e[..., None])
        # A masked entry has probability 0; its value may be anything (slot 0's NaN), so it is zeroed.
        out = torch.einsum("bkgn,nkd->bkgd", probs, torch.nan_to_num(values))
        out = out.reshape(batch_size, plan.num_qo_heads, -1).to(q.dtype)
        lse = (lse_e / math.log(2.0)).reshape(batch_size, plan.num_qo_heads)
        return (out, lse) if return_lse else out


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor):
    """``(V, S)`` of the union of two key sets; ``s_*`` are base-2 LSEs fp32 ``[seq_len, num_heads]``."""
    _check(v_a.dim() == 3 and v_a.shape == v_b.shape and v_a.dtype == v_b.dtype, "v_a, v_b: same [seq_len, H, D]")
    _check(s_a.shape == v_a.shape[:2] == s_b.shape, "s_a, s_b: [seq_len, num_heads]")
    _check(s_a.dtype == torch.float32 == s_b.dtype, "s_a, s_b must be float32")
    s = torch.logaddexp2(s_a, s_b)
    v = v_a.float() * torch.exp2(s_a - s)[..., None] + v_b.float() * torch.exp2(s_b - s)[..., None]
    return v.to(v_a.dtype), s


def install(monkeypatch) -> types.ModuleType:
    """Make ``import flashinfer`` / ``flashinfer.cascade`` resolve to this fake for one test."""
    cascade = types.ModuleType("flashinfer.cascade")
    cascade.merge_state = merge_state
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    module.merge_state = merge_state
    module.cascade = cascade
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setitem(sys.modules, "flashinfer.cascade", cascade)
    return module
