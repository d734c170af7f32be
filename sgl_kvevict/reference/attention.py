"""The attention function the reference engine installs in HF transformers.

Why an attention function and not a hook: transformers (5.x) models call
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, mask, scaling=...)``
after RoPE (and after q/k norms where the model has them) and after the cache update. That one call
site therefore sees, for every layer, exactly what scoring and eviction need: the post-RoPE queries of
this forward, and the full post-RoPE keys and values of the sequence so far. A forward hook on the
attention module does not see ``q``, and recomputing ``q`` from the hidden states would re-implement
every model's projections, norms and RoPE variants. Extra keyword arguments of ``model(...)`` are
forwarded down to this call, so the per-forward state travels as ``sgl_kvevict_forward=...``; a
forward without it (e.g. ``model.generate``) is plain SDPA.

Attention itself is transformers' own SDPA function with the head-wise keep mask folded into its
mask, so a sequence with nothing evicted runs bit-for-bit the stock path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies.base import Policy, SegmentCompressor, SegmentSpec
from sgl_kvevict.reference.keep_mask import HeadwiseKeepMask
from sgl_kvevict.scoring.window import StatsRequest, window_stats

ATTENTION_IMPLEMENTATION = "sgl_kvevict_reference"
FORWARD_KWARG = "sgl_kvevict_forward"


@dataclass
class SegmentScoring:
    """One segment being compressed: its compressor and the window whose queries score it."""

    compressor: SegmentCompressor
    window: int
    request: StatsRequest

    @classmethod
    def start(cls, policy: Policy, spec: SegmentSpec) -> "SegmentScoring":
        # The window rule of the policies' SegmentLayout: the last `window` tokens, at most the segment.
        window = min(policy.config.window, spec.length)
        return cls(policy.start(spec), window, policy.stats_request())

    @property
    def spec(self) -> SegmentSpec:
        return self.compressor.spec

    def observe(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kept: torch.Tensor,
        query_start: int,
        scaling: float,
    ) -> None:
        """Score one layer from this forward's attention inputs.

        query: ``[H_q, q, D]`` post-RoPE queries of positions ``[query_start, query_start + q)``.
        key, value: ``[H_kv, k, D]`` the cache after this forward's update (``k >= spec.end``).
        kept: bool ``[H_kv, spec.end]``: entries still visible (earlier segments may be compressed).
        """
        end = self.spec.end
        window_start = end - self.window - query_start
        stats = window_stats(
            query[:, window_start : end - query_start],
            key[:, :end],
            value[:, :end],
            scaling,
            self.request,
            kept=kept,
        )
        self.compressor.observe(layer, stats)

    def plan(self) -> CompressionPlan:
        return self.compressor.plan()


@dataclass
class ForwardContext:
    """What one model forward over positions ``[query_start, query_start + q)`` needs per layer."""

    keep_mask: HeadwiseKeepMask
    query_start: int
    scorings: list[SegmentScoring] = field(default_factory=list)


def evicting_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: score segments ending in this forward, attend to kept entries.

    query: ``[1, H_q, q, D]``; key, value: ``[1, H_kv, k, D]``; returns ``([1, q, H_q, D], None)``.
    """
    context: ForwardContext | None = kwargs.pop(FORWARD_KWARG, None)
    if context is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"the reference engine runs one sequence at a time, got batch {query.shape[0]}")
    layer = module.layer_idx
    num_q_heads, query_length = query.shape[1], query.shape[2]
    key_length = key.shape[2]
    for scoring in context.scorings:
        if scoring.compressor.needs_stats:
            kept = context.keep_mask.kept(layer, scoring.spec.end)
            scoring.observe(layer, query[0], key[0], value[0], kept, context.query_start, scaling)
    mask = context.keep_mask.attention_mask(layer, attention_mask, query_length, key_length, num_q_heads)
    return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **kwargs)


def register_attention() -> str:
    """Register the attention function (idempotent); returns its ``attn_implementation`` name."""
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, evicting_sdpa_attention)
    # The model builds its causal mask with the function registered under the same name; SDPA's
    # is right (without one, transformers would pass no mask at all to a chunked prefill).
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, sdpa_mask)
    return ATTENTION_IMPLEMENTATION
