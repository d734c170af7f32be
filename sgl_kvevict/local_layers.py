"""Local (sliding-window) attention layers: what a compressed node keeps there, for any policy.

A local layer of Gemma 3 attends from position ``p`` over the keys ``[p - window + 1, p]`` only (SGLang's
``sliding_window_size`` is ``window - 1``, HF's sliding mask the same). Every position a request reads
after a compressed node ``[s, e)`` is at least ``e``, so of the node a local layer can ever read only its
last ``window - 1`` positions: a node keeping its last ``min(e - s, window)`` there answers every later
query exactly as the dense cache does. ``LocalLayers.with_windows`` puts that into a plan: in local
layers, every KV head keeps the ``window`` positions before the node's end (the segment's end in block
scope; in request scope the segment's observation window stays dense after the node, so those before it,
and the window); global layers keep the policy's choice. Nothing a local layer can read is dropped, so a
``full`` server of such a model answers exactly as stock while holding, per compressed node, ``n`` entries
per global layer and ``min(n, window)`` per local one.

``WindowedLocalLayers`` wraps a policy so that it plans the global layers alone: they are its layers
(``Policy.for_layers``), its budget is their share, it scores nothing in local layers, and the local
layers' windows are added to its plans. Both engines wrap the served policy with the model's
``LocalLayers`` (``of_model``), so their plans stay equal.
Every KV head of a local layer keeps the same positions: the attention backends rely on it (a local
layer's compressed entries read as one dense-like key list per request).

Pure torch: no engine, no config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from sgl_kvevict.architectures import local_attention_layers
from sgl_kvevict.plan import CompressionPlan, LayerPlan
from sgl_kvevict.policies.base import Policy, SegmentCompressor, SegmentSpec
from sgl_kvevict.scoring.window import StatsRequest, WindowStats


@dataclass(frozen=True)
class LocalLayers:
    """The model's local attention layers and their window.

    layers: the local layers' indices, ascending. window: the keys a query reads, itself included
    (HF's ``sliding_window``). observation_window_dense: the scope leaves a segment's observation window
    dense after its node (request scope; a block keeps its window in its node), so the node ends that
    window before the segment does and keeps the ``window`` positions before it. trim: False keeps local
    layers whole instead (no saving; the tests' check that trimming changes no token).
    """

    layers: tuple[int, ...]
    window: int
    observation_window_dense: bool = True
    trim: bool = True

    @classmethod
    def of_model(cls, model_dir: Path, observation_window_dense: bool = True) -> Optional["LocalLayers"]:
        """The local layers of the model in ``model_dir`` (its config.json) in a scope that leaves the
        observation window dense or not; None for a model without any."""
        found = local_attention_layers(model_dir)
        return None if found is None else cls(*found, observation_window_dense)

    def is_local(self, layer: int) -> bool:
        return layer in self.layers

    def kept_positions(self, start: int, end: int, dense_after: int = 0) -> torch.Tensor:
        """int64: what a local layer keeps of the segment ``[start, end)`` whose last ``dense_after`` positions
        stay dense after its node: the ``window`` positions before the node's end, and those (all of them
        when not trimming)."""
        first = max(start, end - dense_after - self.window) if self.trim else start
        return torch.arange(first, end, dtype=torch.int64)

    def with_windows(self, global_plan: CompressionPlan, spec: SegmentSpec, observation_window: int) -> CompressionPlan:
        """The plan of every layer of the segment ``spec`` (scored by its last ``observation_window``
        positions) from ``global_plan``, its global layers' in order: every local layer keeps
        ``kept_positions`` of the segment in every KV head."""
        dense_after = min(observation_window, spec.length) if self.observation_window_dense else 0
        local = LayerPlan.from_heads([self.kept_positions(spec.start, spec.end, dense_after)] * spec.num_kv_heads)
        global_layers = iter(global_plan.layers)
        layers = tuple(local if self.is_local(index) else next(global_layers) for index in range(spec.num_layers))
        return CompressionPlan(spec.start, spec.end, layers)

    def global_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers of a model of ``num_layers`` that are not local, ascending."""
        return tuple(layer for layer in range(num_layers) if not self.is_local(layer))

    def window_before(
        self, start: int, at: int, present: torch.Tensor, num_layers: int, num_kv_heads: int
    ) -> Optional[CompressionPlan]:
        """What the head ``[start, at)`` of a split trimmed node must gain to keep its own window: in local
        layers, the positions of ``kept_positions(start, at)`` missing from ``present`` (int64, what its
        local layers hold), in every KV head (a plan of ``[start, at)`` with nothing in global layers); None
        when it lacks nothing."""
        wanted = self.kept_positions(start, at)
        missing = wanted[~torch.isin(wanted, present)]
        if not len(missing):
            return None
        local = LayerPlan.from_heads([missing] * num_kv_heads)
        empty = LayerPlan.from_heads([torch.empty(0, dtype=torch.int64)] * num_kv_heads)
        return CompressionPlan(start, at, tuple(local if self.is_local(layer) else empty for layer in range(num_layers)))



class _TrimmedCompressor(SegmentCompressor):
    """The compressor of a segment ``spec`` of every layer around ``inner``, a policy's compressor of its
    global layers (renumbered ``0..``, ``Policy.for_layers``): local layers are never observed, and keep what
    they can still read (``LocalLayers.with_windows``)."""

    def __init__(self, spec: SegmentSpec, inner: SegmentCompressor, local: LocalLayers, observation_window: int):
        super().__init__(spec)
        self.inner = inner
        self.local = local
        self.observation_window = observation_window
        self.needs_stats = inner.needs_stats
        self.global_index = {layer: index for index, layer in enumerate(local.global_layers(spec.num_layers))}

    def observes(self, layer: int) -> bool:
        return layer in self.global_index

    def observe(self, layer: int, stats: WindowStats) -> None:
        index = self.global_index.get(layer)
        if index is not None:
            self.inner.observe(index, stats)

    def plan(self) -> CompressionPlan:
        return self.local.with_windows(self.inner.plan(), self.spec, self.observation_window)

    def shared_state(self) -> Optional[torch.Tensor]:
        return self.inner.shared_state()

    def plan_shared(self, state: torch.Tensor) -> CompressionPlan:
        return self.local.with_windows(self.inner.plan_shared(state), self.spec, self.observation_window)


class WindowedLocalLayers(Policy):
    """``inner`` on a model with local layers: its budget and layer allocators see the global layers alone
    (``Policy.for_layers``): a budget of 25% keeps 25% of the global layers' KV, as local layers keep their
    window anyway, and nothing is scored there. Built by the engines, never registered: it is a fact of the
    model, not a method."""

    def __init__(self, inner: Policy, local: LocalLayers):
        super().__init__(inner.common, inner.knobs, inner.score_knobs)
        self.inner = inner
        self.local = local
        self._on_global: dict[int, Policy] = {}  # model layers -> inner.for_layers(its global layers)

    @classmethod
    def wrap(cls, policy: Policy, local: Optional[LocalLayers]) -> Policy:
        """``policy`` itself for a model without local layers."""
        return policy if local is None else cls(policy, local)

    def stats_request(self) -> StatsRequest:
        return self.inner.stats_request()

    def start(self, spec: SegmentSpec) -> SegmentCompressor:
        global_layers = self.local.global_layers(spec.num_layers)
        on_global = self._on_global.get(spec.num_layers)
        if on_global is None:
            on_global = self._on_global[spec.num_layers] = self.inner.for_layers(global_layers)
        inner = on_global.start(dataclasses.replace(spec, num_layers=len(global_layers)))
        return _TrimmedCompressor(spec, inner, self.local, self.common.window)

    def for_model(self, model_dir: Path) -> "Policy":
        return WindowedLocalLayers(self.inner.for_model(model_dir), self.local)

    def for_heads(self, heads: tuple[int, ...]) -> "Policy":
        return WindowedLocalLayers(self.inner.for_heads(heads), self.local)
