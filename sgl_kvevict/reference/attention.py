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

The attention *input* (the hidden states after the input layernorm, which learned scorers read) is
not passed to that call; a forward pre-hook on each attention module hands it to the same
per-forward state (``register_hidden_state_capture``).

Two kinds of forward carry state:

* ``PrefillContext``: a prefill or decode forward; segments whose window lies in it are scored from
  its queries (and its attention inputs), and attention sees the kept entries only;
* ``ReconstructionContext``: one KVzip reconstruction chunk of one segment (``scoring.kvzip``), whose
  queries see the segment's context ``[0, end)`` as kept at that moment plus the chunk itself.

Attention itself is transformers' own SDPA function with the head-wise keep mask folded into its
mask, so a sequence with nothing evicted runs bit-for-bit the stock path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies.base import Policy, SegmentCompressor, SegmentSpec
from sgl_kvevict.reference.keep_mask import HeadwiseKeepMask
from sgl_kvevict.scoring.kvzip import merge_chunk_stats, reconstruction_stats
from sgl_kvevict.scoring.window import RECONSTRUCTION_QUERIES, StatsRequest, WindowStats, window_stats

ATTENTION_IMPLEMENTATION = "sgl_kvevict_reference"
FORWARD_KWARG = "sgl_kvevict_forward"


@dataclass
class SegmentScoring:
    """One segment being compressed: its compressor, the window whose queries score it, and what is
    held for it until the reconstruction passes (KVzip) run after its forward."""

    compressor: SegmentCompressor
    window: int
    request: StatsRequest
    # Per layer: the segment's attention inputs [length, d_model], kept from the prefill forward
    # until observe when the statistics come later (reconstruction).
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    # Per layer: the reconstruction statistics merged over the chunks so far.
    reconstructed: dict[int, WindowStats] = field(default_factory=dict)
    # The segment could not be scored (its passes do not fit before the context length): kept whole.
    kept_whole: bool = False

    @classmethod
    def start(cls, policy: Policy, spec: SegmentSpec) -> "SegmentScoring":
        # The window rule of the policies' SegmentLayout: the last `window` tokens, at most the segment.
        window = min(policy.common.window, spec.length)
        return cls(policy.start(spec), window, policy.stats_request())

    @property
    def spec(self) -> SegmentSpec:
        return self.compressor.spec

    @property
    def needs_reconstruction(self) -> bool:
        return self.compressor.needs_stats and self.request.queries == RECONSTRUCTION_QUERIES

    @property
    def needs_hidden_states(self) -> bool:
        return self.compressor.needs_stats and self.request.hidden_states

    def observe_prefill(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kept: torch.Tensor,
        query_start: int,
        scaling: float,
        hidden_states: Optional[torch.Tensor],
    ) -> None:
        """Score one layer from the forward that prefills the segment (window statistics), or keep
        its attention inputs for the reconstruction passes.

        query: ``[H_q, q, D]`` post-RoPE queries of positions ``[query_start, query_start + q)``.
        key, value: ``[H_kv, k, D]`` the cache after this forward's update (``k >= spec.end``).
        kept: bool ``[H_kv, spec.end]``: entries still visible (earlier segments may be compressed).
        hidden_states: ``[q, d_model]`` this forward's attention inputs, when the request needs them.
        """
        spec = self.spec
        if not self.needs_reconstruction and not self.compressor.observes(layer):
            return
        if self.needs_hidden_states:
            self.hidden_states[layer] = hidden_states[spec.start - query_start : spec.end - query_start]
        if self.needs_reconstruction:
            return
        stats = WindowStats(window=self.window)
        if self.request.needs_keys:
            window_start = spec.end - self.window - query_start
            stats = window_stats(
                query[:, window_start : spec.end - query_start],
                key[:, : spec.end],
                value[:, : spec.end],
                scaling,
                self.request,
                kept=kept,
            )
        self.compressor.observe(layer, self._with_hidden_states(layer, stats))

    def observe_chunk(self, layer: int, stats: WindowStats) -> None:
        """Fold one reconstruction chunk's statistics of ``layer`` (columns ``[0, end)``) in."""
        self.reconstructed[layer] = merge_chunk_stats(self.reconstructed.get(layer), stats)

    def finish_reconstruction(self) -> None:
        """After the last chunk: observe every layer once (contract step 4 of ``scoring.kvzip``)."""
        for layer in range(self.spec.num_layers):
            self.compressor.observe(layer, self._with_hidden_states(layer, self.reconstructed.pop(layer)))
        self.hidden_states.clear()

    def _with_hidden_states(self, layer: int, stats: WindowStats) -> WindowStats:
        if not self.request.hidden_states:
            return stats
        return dataclasses.replace(stats, hidden_states=self.hidden_states.pop(layer), hidden_start=self.spec.start)

    def keep_whole(self) -> None:
        self.kept_whole = True
        self.hidden_states.clear()

    def plan(self) -> CompressionPlan:
        if self.kept_whole:
            spec = self.spec
            return CompressionPlan.keep_all(spec.start, spec.end, spec.num_layers, spec.num_kv_heads)
        return self.compressor.plan()


@dataclass
class PrefillContext:
    """What one model forward over positions ``[query_start, query_start + q)`` needs per layer."""

    keep_mask: HeadwiseKeepMask
    query_start: int
    scorings: list[SegmentScoring] = field(default_factory=list)
    # Per layer: this forward's attention inputs [q, d_model], captured when a scoring reads them.
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)

    def capture_hidden_states(self, layer: int, hidden_states: torch.Tensor) -> None:
        if any(scoring.needs_hidden_states for scoring in self.scorings):
            self.hidden_states[layer] = hidden_states[0]

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        layer = module.layer_idx
        num_q_heads, query_length = query.shape[1], query.shape[2]
        for scoring in self.scorings:
            if scoring.compressor.needs_stats:
                kept = self.keep_mask.kept(layer, scoring.spec.end)
                hidden = self.hidden_states.get(layer)
                scoring.observe_prefill(layer, query[0], key[0], value[0], kept, self.query_start, scaling, hidden)
        mask = self.keep_mask.attention_mask(layer, attention_mask, query_length, key.shape[2], num_q_heads)
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **kwargs)


@dataclass
class ReconstructionContext:
    """One reconstruction chunk of ``scoring``'s segment ``[start, end)``: its keys and values follow
    the cache's ``cache_length`` entries, its positions start at ``end``."""

    keep_mask: HeadwiseKeepMask
    scoring: SegmentScoring
    cache_length: int

    def capture_hidden_states(self, layer: int, hidden_states: torch.Tensor) -> None:
        pass  # learned scores read the prefill's attention inputs, not the reconstruction's

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs):
        layer = module.layer_idx
        end, own = self.scoring.spec.end, self.cache_length
        kept = self.keep_mask.kept(layer, end).to(key.device)  # [H_kv, end]
        k, v = key[0], value[0]
        stats = reconstruction_stats(
            query[0], k[:, :end], v[:, :end], k[:, own:], v[:, own:], scaling, self.scoring.request, kept
        )
        self.scoring.observe_chunk(layer, stats)
        mask = self._mask(kept, query.shape[1], query.shape[2], getattr(module, "sliding_window", None))
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **kwargs)

    def _mask(self, kept: torch.Tensor, num_q_heads: int, chunk_length: int, window: Optional[int] = None) -> torch.Tensor:
        """bool ``[1, H_q, m, cache_length + m]``: kept keys of ``[0, end)``, none of ``[end, cache_length)``
        (later tokens of the prefill forward), the chunk's own keys causally; in a local layer (``window``,
        HF's ``sliding_window``) only keys of the last ``window`` positions, the chunk's at ``end`` on."""
        device = kept.device
        end = kept.shape[1]
        group = num_q_heads // kept.shape[0]
        context = torch.zeros(num_q_heads, chunk_length, self.cache_length, dtype=torch.bool, device=device)
        context[:, :, :end] = kept.repeat_interleave(group, 0).unsqueeze(1)
        own = torch.ones(chunk_length, chunk_length, dtype=torch.bool, device=device).tril()
        mask = torch.cat([context, own.expand(num_q_heads, -1, -1)], dim=-1)
        if window is not None:
            key_positions = torch.cat([torch.arange(self.cache_length, device=device), end + torch.arange(chunk_length, device=device)])
            query_positions = end + torch.arange(chunk_length, device=device)
            mask &= key_positions[None, :] > query_positions[:, None] - window
        return mask.unsqueeze(0)


ForwardContext = Union[PrefillContext, ReconstructionContext]


def evicting_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: score segments, attend to kept entries.

    query: ``[1, H_q, q, D]``; key, value: ``[1, H_kv, k, D]``; returns ``([1, q, H_q, D], None)``.
    """
    context: ForwardContext | None = kwargs.pop(FORWARD_KWARG, None)
    if context is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"the reference engine runs one sequence at a time, got batch {query.shape[0]}")
    return context.attend(module, query, key, value, attention_mask, scaling, **kwargs)


def _capture_attention_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of an attention module: hand its input hidden states to the forward's context."""
    context: ForwardContext | None = kwargs.get(FORWARD_KWARG)
    if context is not None:
        context.capture_hidden_states(module.layer_idx, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])


def register_hidden_state_capture(model: torch.nn.Module) -> None:
    """Install the pre-hook on every decoder layer's attention module (``model.model.layers[i].self_attn``,
    the layout of every supported model type)."""
    for decoder_layer in model.model.layers:
        decoder_layer.self_attn.register_forward_pre_hook(_capture_attention_input, with_kwargs=True)


def register_attention() -> str:
    """Register the attention function (idempotent); returns its ``attn_implementation`` name."""
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, evicting_sdpa_attention)
    # The model builds its causal mask with the function registered under the same name; SDPA's
    # is right (without one, transformers would pass no mask at all to a chunked prefill).
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, sdpa_mask)
    return ATTENTION_IMPLEMENTATION
