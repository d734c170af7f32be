"""Per-layer candidate scores from the statistics an engine computes (``window.py``).

``SCORE_KINDS`` is the registry of the ``score`` knob's values: the scorer each builds and the GQA
reduction and pooling it brings (instead of the policy's); a scorer with knobs of its own declares
them (``Scorer.knobs_type``: the learned score's weights). ``scorer_for(common, score_knobs)`` picks
the scorer; policies override the attention scorer (TOVA: last query; LAVa: value-norm scaled).

* ``attn``: the attention the observation window pays each candidate (the policy's own scorer);
* ``obc-value``, ``obc-key``, ``obc-joint``: OBCache's output-error scores of that window;
* ``kvzip``: the largest attention a reconstruction of the context pays it (question-agnostic);
* ``learned``: a per-layer linear map from hidden states predicting the log KVzip score.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sgl_kvevict.settings import CommonSettings, Settings
from sgl_kvevict.scoring.attention import LastQueryScorer, WindowAttentionScorer
from sgl_kvevict.scoring.base import QueryHeadScorer, Reduction, RowScorer, Scorer
from sgl_kvevict.scoring.kvzip import KVzipScorer
from sgl_kvevict.scoring.lava import LavaScorer
from sgl_kvevict.scoring.learned import LEARNED_SCORE, LearnedKnobs, LearnedScorer, resolve_learned_weights
from sgl_kvevict.scoring.obcache import OBCacheScorer
from sgl_kvevict.scoring.window import RECONSTRUCTION_QUERIES, StatsRequest, WindowStats, window_stats


@dataclass(frozen=True)
class ScoreKind:
    """What a ``score`` value builds. scorer: its class (``Scorer.of``), or ``None`` for the
    policy's own attention scorer. gqa, pooling: the defaults it brings (``None``: the policy's)."""

    scorer: Optional[type[Scorer]]
    gqa: Optional[str] = None
    pooling: Optional[str] = None

    @property
    def knobs_type(self) -> type[Settings]:
        """The score's own knobs (none for the policy's attention scorer)."""
        return Settings if self.scorer is None else self.scorer.knobs_type

    @property
    def scored_by_passes(self) -> bool:
        """Whether the score comes from passes after the prefill (KVzip) rather than from the prefill."""
        # A class-level request where the score fixes it (OBCache's depends on which of its three).
        request = getattr(self.scorer, "request", None)
        return isinstance(request, StatsRequest) and request.queries == RECONSTRUCTION_QUERIES


SCORE_KINDS: dict[str, ScoreKind] = {
    "attn": ScoreKind(None),
    # OBCache Eq. 33-35: the GQA group's summed output error.
    "obc-value": ScoreKind(OBCacheScorer, gqa="sum"),
    "obc-key": ScoreKind(OBCacheScorer, gqa="sum"),
    "obc-joint": ScoreKind(OBCacheScorer, gqa="sum"),
    # KVzip keeps an entry any head of the group needs, and does not pool.
    "kvzip": ScoreKind(KVzipScorer, gqa="max", pooling="none"),
    LEARNED_SCORE: ScoreKind(LearnedScorer, pooling="none"),
}
SCORES = tuple(SCORE_KINDS)
OBC_SCORES = ("obc-value", "obc-key", "obc-joint")
# Scores of the observation window, and scores that do not depend on any question (safe to reuse).
WINDOW_SCORES = ("attn", *OBC_SCORES)
QUESTION_AGNOSTIC_SCORES = ("kvzip", LEARNED_SCORE)


def scorer_for(common: CommonSettings, knobs: Settings, attention: type[Scorer] = WindowAttentionScorer) -> Scorer:
    """The scorer ``common.score`` names, with its ``knobs`` (``SCORE_KINDS[score].knobs_type``);
    ``attention`` for ``attn``."""
    reduction = Reduction.of(common)
    scorer = SCORE_KINDS[common.score].scorer
    return attention(reduction) if scorer is None else scorer.of(common, knobs, reduction)


__all__ = [
    "OBC_SCORES",
    "QUESTION_AGNOSTIC_SCORES",
    "SCORES",
    "SCORE_KINDS",
    "WINDOW_SCORES",
    "KVzipScorer",
    "LastQueryScorer",
    "LavaScorer",
    "LearnedKnobs",
    "LearnedScorer",
    "OBCacheScorer",
    "QueryHeadScorer",
    "Reduction",
    "RowScorer",
    "ScoreKind",
    "Scorer",
    "StatsRequest",
    "WindowAttentionScorer",
    "WindowStats",
    "resolve_learned_weights",
    "scorer_for",
    "window_stats",
]
