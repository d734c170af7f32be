"""Per-layer statistics of the observation window: the one interface between engines and policies.

Every score of the four papers and their baselines is a reduction of the attention of the last ``w``
(post-RoPE) queries of a segment over the keys of the context up to the segment end. An engine
computes only the reductions a policy asks for (``StatsRequest``) and hands them to the policy as a
``WindowStats``; the ``[H_q, w, L]`` attention matrix itself never outlives this call. This module is
the pure-torch definition (the formula, used by the reference engine and as the oracle of the Triton
kernels in ``sgl_kvevict.kernels``, which produce the same dataclass from a paged KV buffer).

Notation, per query head ``h`` (KV head ``g = h // G``), window query ``i`` at position ``L - w + i``,
key position ``p``; ``Z = scaling * q_i . k_p`` (signed), ``A = softmax_p(Z)`` over the keys the query
may see (``p <= L - w + i``: causal inside the window, everything before it), ``o_i = sum_p A v_p``:

* ``attn_sum[h, p]   = sum_i A``                                     SnapKV, PyramidKV, Ada-KV, LAVa, H2O
* ``attn_max[h, p]   = max_i A``                                     KVzip (over reconstruction queries)
* ``tail_attn[h, j, p] = A`` of the last ``tail_rows`` window queries  TOVA (j = last), DBudgetKV
* ``obc_value[h, p]  = sum_i A^2 ||v_p||^2``                          OBCache value (exact error)
* ``obc_key[h, p]    = sum_i A^2 Z^2 ||v_p - o_i||^2``                OBCache key
* ``obc_joint[h, p]  = sum_i A^2 ||(1 + Z) v_p - Z o_i||^2``          OBCache joint (compact form)
* ``value_l1[g, p]   = ||v_p||_1``                                     LAVa's per-head value-norm factor

All statistics are fp32 whatever the KV dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

WINDOW_QUERIES = "window"
RECONSTRUCTION_QUERIES = "reconstruction"


@dataclass(frozen=True)
class StatsRequest:
    """Which statistics a policy needs; engines compute nothing else.

    queries: whose queries the statistics are of. ``window``: the segment's last ``w`` tokens.
    ``reconstruction``: a teacher-forced pass that repeats the segment after its end (KVzip, see
    ``scoring.kvzip``); the engine runs it after the prefill and its queries play the window's role,
    positioned after the segment end (the statistics' columns stay the context positions).
    hidden_states: the attention-input hidden states of the candidates (learned scorers); no queries.
    """

    attn_sum: bool = False
    attn_max: bool = False
    tail_rows: int = 0  # 0 = no tail_attn; k = attention rows of the last k window queries
    obc_value: bool = False
    obc_key: bool = False
    obc_joint: bool = False
    value_l1: bool = False
    hidden_states: bool = False
    queries: str = WINDOW_QUERIES

    def __post_init__(self):
        if self.queries not in (WINDOW_QUERIES, RECONSTRUCTION_QUERIES):
            raise ValueError(f"queries {self.queries!r} is neither {WINDOW_QUERIES!r} nor {RECONSTRUCTION_QUERIES!r}")
        if self.queries == RECONSTRUCTION_QUERIES and self.tail_rows:
            raise ValueError("tail rows are rows of the window's last queries; a reconstruction pass has no window")

    def union(self, other: "StatsRequest") -> "StatsRequest":
        if self.queries != other.queries:
            raise ValueError(f"statistics of {self.queries} and {other.queries} queries cannot be combined")
        return StatsRequest(
            attn_sum=self.attn_sum or other.attn_sum,
            attn_max=self.attn_max or other.attn_max,
            tail_rows=max(self.tail_rows, other.tail_rows),
            obc_value=self.obc_value or other.obc_value,
            obc_key=self.obc_key or other.obc_key,
            obc_joint=self.obc_joint or other.obc_joint,
            value_l1=self.value_l1 or other.value_l1,
            hidden_states=self.hidden_states or other.hidden_states,
            queries=self.queries,
        )

    @property
    def needs_outputs(self) -> bool:
        """Key and joint scores need the window outputs ``o_i`` (a first pass over the keys)."""
        return self.obc_key or self.obc_joint

    @property
    def needs_keys(self) -> bool:
        """Whether any per-position statistic is asked for (a learned scorer needs hidden states only)."""
        return bool(
            self.attn_sum or self.attn_max or self.tail_rows or self.obc_value or self.needs_outputs or self.value_l1
        )


@dataclass(frozen=True)
class WindowStats:
    """Statistics of one layer for one segment; shapes with ``L`` = context length up to the last query.

    window: the number of queries the statistics are over.
    attn_sum, attn_max: fp32 ``[H_q, L]``
    tail_attn: fp32 ``[H_q, tail_rows, L]`` (row ``-1`` is the last query)
    obc_value, obc_key, obc_joint: fp32 ``[H_q, L]``
    value_l1:  fp32 ``[H_kv, L]``
    hidden_states: ``[n, d_model]`` (the model's dtype) of positions ``[hidden_start, hidden_start + n)``
    Fields not requested are ``None``.
    """

    window: int
    attn_sum: Optional[torch.Tensor] = None
    attn_max: Optional[torch.Tensor] = None
    tail_attn: Optional[torch.Tensor] = None
    obc_value: Optional[torch.Tensor] = None
    obc_key: Optional[torch.Tensor] = None
    obc_joint: Optional[torch.Tensor] = None
    value_l1: Optional[torch.Tensor] = None
    hidden_states: Optional[torch.Tensor] = None
    hidden_start: int = 0

    @property
    def context_length(self) -> int:
        for name in COLUMN_STATS:
            t = getattr(self, name)
            if isinstance(t, torch.Tensor):
                return t.shape[-1]
        raise ValueError("WindowStats without a per-position statistic")


# The statistics whose last dimension is the context position; hidden_states is per candidate row.
COLUMN_STATS = ("attn_sum", "attn_max", "tail_attn", "obc_value", "obc_key", "obc_joint", "value_l1")
# Queries per chunk of the reference computation: bounds its fp32 [H_q, chunk, L] temporaries
# (a reconstruction pass has thousands of queries). Every statistic is a sum, max or row slice over
# queries, so chunking changes nothing but memory.
QUERY_CHUNK = 256


def window_stats(
    q_window: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    request: StatsRequest,
    kept: Optional[torch.Tensor] = None,
) -> WindowStats:
    """Reference computation of ``WindowStats``.

    q_window: ``[H_q, w, D]`` post-RoPE queries at positions ``L - w .. L - 1``.
    keys, values: ``[H_kv, L, D]`` post-RoPE keys and values at positions ``0 .. L - 1``.
    kept: optional bool ``[H_kv, L]``: the entries each KV head still holds (earlier segments may be
        evicted); every head must keep the window ``[L - w, L)``. The softmax of each head runs over
        its kept keys only, as in an engine that reuses a compressed prefix; evicted columns of
        every statistic are 0 (they get no attention).

    Every tensor created here lives on the inputs' device: the engines call this on CUDA tensors.
    """
    num_q_heads, window, _ = q_window.shape
    num_kv_heads, context, _ = keys.shape
    # Slicing would silently return fewer rows than asked for; these are engine bugs, not user input.
    if not 0 < window <= context:
        raise ValueError(f"window {window} must be in [1, context length {context}]")
    if request.tail_rows > window:
        raise ValueError(f"tail_rows {request.tail_rows} exceeds the window {window}")
    group = num_q_heads // num_kv_heads
    device = keys.device
    k = keys.float().repeat_interleave(group, 0)  # [H_q, L, D]
    v = values.float()
    v_rep = v.repeat_interleave(group, 0)  # [H_q, L, D_v]
    v_sq = v_rep.square().sum(-1)  # [H_q, L]
    key_visible = None if kept is None else kept.repeat_interleave(group, 0).unsqueeze(1)  # [H_q, 1, L]
    positions = torch.arange(context, device=device)

    sums: dict[str, torch.Tensor] = {}
    attn_max = None
    tail_chunks = []
    for chunk_start in range(0, window, QUERY_CHUNK):
        chunk_end = min(chunk_start + QUERY_CHUNK, window)
        q = q_window[:, chunk_start:chunk_end].float()
        logits = torch.einsum("hid,hpd->hip", q, k) * scaling  # Z: [H_q, c, L]
        query_pos = (context - window + torch.arange(chunk_start, chunk_end, device=device)).view(-1, 1)
        visible = (positions.view(1, context) <= query_pos).unsqueeze(0)  # [1, c, L]
        if key_visible is not None:
            visible = visible & key_visible
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)  # A
        chunk: dict[str, torch.Tensor] = {}
        if request.attn_sum:
            chunk["attn_sum"] = probs.sum(1)
        if request.attn_max:
            chunk_max = probs.amax(1)
            attn_max = chunk_max if attn_max is None else torch.maximum(attn_max, chunk_max)
        if request.tail_rows and chunk_end > window - request.tail_rows:
            tail_chunks.append(probs[:, max(window - request.tail_rows - chunk_start, 0) :])
        if request.obc_value or request.needs_outputs:
            probs_sq = probs.square()
            if request.obc_value:
                chunk["obc_value"] = probs_sq.sum(1) * v_sq
            if request.needs_outputs:
                o = torch.einsum("hip,hpd->hid", probs, v_rep)  # [H_q, c, D]
                o_sq = o.square().sum(-1, keepdim=True)  # [H_q, c, 1]
                v_dot_o = torch.einsum("hid,hpd->hip", o, v_rep)  # [H_q, c, L]
                z = logits.masked_fill(~visible, 0.0)
                if request.obc_key:
                    dist = v_sq.unsqueeze(1) + o_sq - 2 * v_dot_o  # ||v_p - o_i||^2
                    chunk["obc_key"] = (probs_sq * z.square() * dist).sum(1)
                if request.obc_joint:
                    joint = (1 + z).square() * v_sq.unsqueeze(1) - 2 * z * (1 + z) * v_dot_o + z.square() * o_sq
                    chunk["obc_joint"] = (probs_sq * joint).sum(1)
        for name, value in chunk.items():
            sums[name] = value if name not in sums else sums[name] + value

    out: dict[str, torch.Tensor] = dict(sums)
    if attn_max is not None:
        out["attn_max"] = attn_max
    if tail_chunks:
        out["tail_attn"] = torch.cat(tail_chunks, dim=1)
    if request.value_l1:
        value_l1 = v.abs().sum(-1)
        out["value_l1"] = value_l1 if kept is None else value_l1 * kept
    return WindowStats(window=window, **out)
