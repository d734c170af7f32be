"""ScoredPolicy: the base of score-based policies (kvpress "press" style).

A score-based method is three choices, each a hook with a default:

* ``build_scorer``: the score hook (default: the window's mean attention, or the score the ``score``
  knob names: OBCache, KVzip, learned);
* ``layer_budgets``: candidates kept per layer (default: the same in every layer);
* ``head_counts``: how a layer's budget splits over its KV heads (default: evenly).

With a score threshold (``CommonSettings.score_threshold``) the budget is a cap: a segment keeps as many
candidates in all as score at least the threshold (never more than the budget allows), and the hooks
place them as they place a fixed budget. Under ``topk`` that keeps exactly the candidates above the
threshold (KVzap's usage); a layer- or head-balanced policy keeps as many, spread its own way.

The compressor stores one ``[H_kv, n_candidates]`` score tensor per layer during the forward pass
and decides everything in ``plan()``: layer budgets that depend on every layer (LAVa, PyramidKV)
are computed once after the last layer (docs/methods/lava.md#one-shot-equals-the-cascade).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Optional

import torch

from sgl_kvevict.budget.heads import kept_offsets, rank_candidates, uniform_head_counts
from sgl_kvevict.settings import CommonSettings, Settings
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.policies.base import Policy, SegmentCompressor, SegmentSpec
from sgl_kvevict.policies.layout import SegmentLayout
from sgl_kvevict.scoring import RowScorer, Scorer, StatsRequest, WindowStats, scorer_for


class ScoredPolicy(Policy):
    """Scores candidates with ``self.scorer``, splits the budget over layers, then over KV heads."""

    def __init__(self, common: CommonSettings, knobs: Settings = Settings(), score_knobs: Settings = Settings()):
        super().__init__(common, knobs, score_knobs)
        self.scorer = self.build_scorer()

    def build_scorer(self) -> Scorer:
        return scorer_for(self.common, self.score_knobs)

    def layer_budgets(self, layout: SegmentLayout, layer_scores: list[torch.Tensor]) -> list[int]:
        """Candidates kept in each layer, summed over its KV heads (``layer_scores``: ``[H_kv, n]`` each)."""
        return [layout.spec.num_kv_heads * layout.selected_per_head] * layout.spec.num_layers

    def head_counts(self, sorted_scores: torch.Tensor, layer_budget: int) -> torch.Tensor:
        """int64 ``[H_kv]`` candidates kept per KV head; ``sorted_scores`` ``[H_kv, n]`` descending per head."""
        return uniform_head_counts(layer_budget, sorted_scores.shape[0])

    def plans_each_head_alone(self) -> bool:
        """Whether a KV head's kept positions depend on its own scores only: the default hooks (an even
        split, the same budget in every layer). Then ranks holding different heads plan without an
        exchange (``SegmentCompressor.shared_state``); a policy overriding a hook exchanges, unless it says
        its hook reads no scores."""
        if self.common.score_threshold is not None:
            return False  # how many a head keeps depends on every head's scores
        return type(self).layer_budgets is ScoredPolicy.layer_budgets and type(self).head_counts is ScoredPolicy.head_counts

    def stats_request(self) -> StatsRequest:
        return self.scorer.request

    def for_model(self, model_dir: Path) -> "ScoredPolicy":
        return self._with_scorer(self.scorer.for_model(model_dir))

    def for_heads(self, heads: tuple[int, ...]) -> "ScoredPolicy":
        return self._with_scorer(self.scorer.for_heads(heads))

    def for_layers(self, layers: tuple[int, ...]) -> "ScoredPolicy":
        return super().for_layers(layers)._with_scorer(self.scorer.for_layers(layers))

    def _with_scorer(self, scorer: Scorer) -> "ScoredPolicy":
        if scorer is self.scorer:
            return self
        bound = copy.copy(self)
        bound.scorer = scorer
        return bound

    def start(self, spec: SegmentSpec) -> SegmentCompressor:
        return ScoredCompressor(self, SegmentLayout.of(spec, self.common))


class ScoredCompressor(SegmentCompressor):
    """Keeps one ``[H_kv, n_candidates]`` fp32 score tensor per observed layer until ``plan()``.

    A ``RowScorer``'s statistics (hidden states) may arrive in pieces of consecutive rows, one per
    prefill forward: each piece is scored at once (``[H_kv, n]``, never the hidden states themselves)
    and the layer's scores are pooled when the piece holding the last candidate arrives."""

    def __init__(self, policy: ScoredPolicy, layout: SegmentLayout):
        super().__init__(layout.spec)
        self.policy = policy
        self.layout = layout
        self.needs_stats = layout.compresses
        self.layer_scores: dict[int, torch.Tensor] = {}
        self._row_pieces: dict[int, list[torch.Tensor]] = {}

    def observe(self, layer: int, stats: WindowStats) -> None:
        if not self.layout.compresses:
            return
        scorer, candidates = self.policy.scorer, self.layout.candidate_columns
        if not isinstance(scorer, RowScorer):
            self.layer_scores[layer] = scorer(stats, candidates, self.spec.num_kv_heads, layer)
            return
        piece_end = stats.hidden_start + len(stats.hidden_states)
        rows = slice(max(candidates.start, stats.hidden_start), min(candidates.stop, piece_end))
        if rows.start >= rows.stop:
            return  # a piece of sinks or window rows only
        pieces = self._row_pieces.setdefault(layer, [])
        seen = candidates.start + sum(piece.shape[1] for piece in pieces)
        if rows.start != seen:
            raise ValueError(f"layer {layer}: rows from {rows.start} after rows up to {seen} (pieces out of order)")
        pieces.append(scorer.row_scores(stats, rows, layer))
        if rows.stop == candidates.stop:
            self.layer_scores[layer] = scorer.reduction.pool(torch.cat(self._row_pieces.pop(layer), dim=1))

    def plan(self) -> CompressionPlan:
        if not self.layout.compresses:
            return self.layout.keep_all()
        return self._plan(self.layout, self._scores())

    def shared_state(self) -> Optional[torch.Tensor]:
        if not self.layout.compresses or self.policy.plans_each_head_alone():
            return None
        return torch.stack(self._scores())

    def plan_shared(self, state: torch.Tensor) -> CompressionPlan:
        every_head = SegmentLayout.of(dataclasses.replace(self.spec, num_kv_heads=state.shape[1]), self.policy.common)
        return self._plan(every_head, list(state))

    def _scores(self) -> list[torch.Tensor]:
        missing = sorted(set(range(self.spec.num_layers)) - set(self.layer_scores))
        if missing:
            raise RuntimeError(f"plan() before observe() of layers {missing}")
        return [self.layer_scores[layer] for layer in range(self.spec.num_layers)]

    def _plan(self, layout: SegmentLayout, scores: list[torch.Tensor]) -> CompressionPlan:
        """scores: ``[H_kv, n]`` per layer, ``H_kv`` the heads of ``layout``."""
        threshold = self.policy.common.score_threshold
        if threshold is not None:
            above = sum(int((layer_scores >= threshold).sum()) for layer_scores in scores)
            layout = layout.with_selected(min(layout.selected_per_head, above // (len(scores) * len(scores[0]))))
        layers = []
        for layer_scores, layer_budget in zip(scores, self.policy.layer_budgets(layout, scores)):
            sorted_scores, ranked_offsets = rank_candidates(layer_scores)
            counts = self.policy.head_counts(sorted_scores, int(layer_budget))
            layers.append(layout.layer_plan(kept_offsets(ranked_offsets.cpu(), counts)))
        return layout.plan(layers)
