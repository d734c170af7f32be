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
* ``tail_attn[h, j, p] = A`` of the last ``tail_rows`` window queries  TOVA (j = last), DBudgetKV
* ``obc_value[h, p]  = sum_i A^2 ||v_p||^2``                          OBCache value (exact error)
* ``obc_key[h, p]    = sum_i A^2 Z^2 ||v_p - o_i||^2``                OBCache key
* ``obc_joint[h, p]  = sum_i A^2 ||(1 + Z) v_p - Z o_i||^2``          OBCache joint (compact form)
* ``value_l1[g, p]   = ||v_p||_1``                                     LAVa's per-head value-norm factor

All statistics are fp32 whatever the KV dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch


@dataclass(frozen=True)
class StatsRequest:
    """Which statistics a policy needs; engines compute nothing else."""

    attn_sum: bool = False
    tail_rows: int = 0  # 0 = no tail_attn; k = attention rows of the last k window queries
    obc_value: bool = False
    obc_key: bool = False
    obc_joint: bool = False
    value_l1: bool = False

    def union(self, other: "StatsRequest") -> "StatsRequest":
        return StatsRequest(
            attn_sum=self.attn_sum or other.attn_sum,
            tail_rows=max(self.tail_rows, other.tail_rows),
            obc_value=self.obc_value or other.obc_value,
            obc_key=self.obc_key or other.obc_key,
            obc_joint=self.obc_joint or other.obc_joint,
            value_l1=self.value_l1 or other.value_l1,
        )

    @property
    def needs_outputs(self) -> bool:
        """Key and joint scores need the window outputs ``o_i`` (a first pass over the keys)."""
        return self.obc_key or self.obc_joint


@dataclass(frozen=True)
class WindowStats:
    """Statistics of one layer for one segment; shapes with ``L`` = context length up to segment end.

    attn_sum:  fp32 ``[H_q, L]``
    tail_attn: fp32 ``[H_q, tail_rows, L]`` (row ``-1`` is the last query)
    obc_value, obc_key, obc_joint: fp32 ``[H_q, L]``
    value_l1:  fp32 ``[H_kv, L]``
    Fields not requested are ``None``.
    """

    window: int
    attn_sum: Optional[torch.Tensor] = None
    tail_attn: Optional[torch.Tensor] = None
    obc_value: Optional[torch.Tensor] = None
    obc_key: Optional[torch.Tensor] = None
    obc_joint: Optional[torch.Tensor] = None
    value_l1: Optional[torch.Tensor] = None

    @property
    def context_length(self) -> int:
        for f in fields(self):
            t = getattr(self, f.name)
            if isinstance(t, torch.Tensor):
                return t.shape[-1]
        raise ValueError("empty WindowStats")


def window_stats(
    q_window: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    request: StatsRequest,
) -> WindowStats:
    """Reference computation of ``WindowStats``.

    q_window: ``[H_q, w, D]`` post-RoPE queries at positions ``L - w .. L - 1``.
    keys, values: ``[H_kv, L, D]`` post-RoPE keys and values at positions ``0 .. L - 1``.
    """
    num_q_heads, window, _ = q_window.shape
    num_kv_heads, context, _ = keys.shape
    # Slicing would silently return fewer rows than asked for; these are engine bugs, not user input.
    if not 0 < window <= context:
        raise ValueError(f"window {window} must be in [1, context length {context}]")
    if request.tail_rows > window:
        raise ValueError(f"tail_rows {request.tail_rows} exceeds the window {window}")
    group = num_q_heads // num_kv_heads
    q = q_window.float()
    k = keys.float().repeat_interleave(group, 0)  # [H_q, L, D]
    v = values.float()

    logits = torch.einsum("hid,hpd->hip", q, k) * scaling  # Z: [H_q, w, L]
    query_pos = torch.arange(context - window, context).view(window, 1)
    visible = torch.arange(context).view(1, context) <= query_pos  # [w, L]
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)  # A

    out: dict[str, torch.Tensor] = {}
    if request.attn_sum:
        out["attn_sum"] = probs.sum(1)
    if request.tail_rows:
        out["tail_attn"] = probs[:, window - request.tail_rows :].clone()
    if request.value_l1:
        out["value_l1"] = v.abs().sum(-1)
    if request.obc_value or request.needs_outputs:
        probs_sq = probs.square()
        v_rep = v.repeat_interleave(group, 0)  # [H_q, L, D]
        v_sq = v_rep.square().sum(-1)  # [H_q, L]
        if request.obc_value:
            out["obc_value"] = probs_sq.sum(1) * v_sq
        if request.needs_outputs:
            o = torch.einsum("hip,hpd->hid", probs, v_rep)  # [H_q, w, D]
            o_sq = o.square().sum(-1, keepdim=True)  # [H_q, w, 1]
            v_dot_o = torch.einsum("hid,hpd->hip", o, v_rep)  # [H_q, w, L]
            z = logits.masked_fill(~visible, 0.0)
            if request.obc_key:
                dist = v_sq.unsqueeze(1) + o_sq - 2 * v_dot_o  # ||v_p - o_i||^2
                out["obc_key"] = (probs_sq * z.square() * dist).sum(1)
            if request.obc_joint:
                joint = (1 + z).square() * v_sq.unsqueeze(1) - 2 * z * (1 + z) * v_dot_o + z.square() * o_sq
                out["obc_joint"] = (probs_sq * joint).sum(1)
    return WindowStats(window=window, **out)


def window_stats_over_kept(
    q_window: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
    scaling: float,
    request: StatsRequest,
) -> WindowStats:
    """``window_stats`` when some earlier entries are already evicted, per KV head.

    q_window: ``[H_q, w, D]``; keys, values: ``[H_kv, L, D]``; kept: bool ``[H_kv, L]`` (the window
    ``[L - w, L)`` must be kept). The softmax of each head runs over its kept keys only, as in an engine
    that reuses a compressed prefix (the SGLang engine calls it for exactly that); evicted columns of every statistic are 0 (they get no attention).
    """
    num_q_heads, window, _ = q_window.shape
    num_kv_heads, length, _ = keys.shape
    if bool(kept.all()):
        return window_stats(q_window, keys, values, scaling, request)
    if not bool(kept[:, length - window :].all()):
        raise ValueError("the observation window of a segment cannot contain evicted entries")
    group = num_q_heads // num_kv_heads
    # Gathering keeps the window as the last `w` keys of each head, so window_stats' causal mask, which
    # counts from the end, stays right in the gathered index space.
    per_head = []
    for head in range(num_kv_heads):
        positions = kept[head].nonzero().squeeze(1)
        per_head.append(
            (
                positions,
                window_stats(
                    q_window[head * group : (head + 1) * group],
                    keys[head : head + 1, positions],
                    values[head : head + 1, positions],
                    scaling,
                    request,
                ),
            )
        )
    scattered: dict[str, torch.Tensor] = {}
    for field in fields(WindowStats):
        if field.name == "window" or getattr(per_head[0][1], field.name) is None:
            continue
        columns = []
        for positions, stats in per_head:
            head_stat = getattr(stats, field.name)
            full = head_stat.new_zeros(*head_stat.shape[:-1], length)
            full[..., positions] = head_stat
            columns.append(full)
        scattered[field.name] = torch.cat(columns)
    return WindowStats(window=window, **scattered)
