"""Per-layer candidate scores from the observation window's statistics (``window.py``).

``scorer_for(config)`` picks the scorer a config asks for; policies override the attention scorer
(TOVA: last query; LAVa: value-norm scaled) and get OBCache scores for free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_kvevict.scoring.attention import LastQueryScorer, WindowAttentionScorer
from sgl_kvevict.scoring.base import QueryHeadScorer, Reduction, Scorer
from sgl_kvevict.scoring.lava import LavaScorer
from sgl_kvevict.scoring.obcache import OBCacheScorer
from sgl_kvevict.scoring.window import StatsRequest, WindowStats, window_stats

if TYPE_CHECKING:
    from sgl_kvevict.config import EvictionConfig

# The values of the config's ``score``: what ranks a policy's candidates.
SCORES = ("attn", "obc-value", "obc-key", "obc-joint")
OBC_SCORES = SCORES[1:]


def scorer_for(config: "EvictionConfig", attention: type[Scorer] = WindowAttentionScorer) -> Scorer:
    """The OBCache scorer if ``config.score`` names one, else ``attention``."""
    reduction = Reduction.from_config(config)
    if config.score in OBC_SCORES:
        return OBCacheScorer(config.score, reduction)
    return attention(reduction)


__all__ = [
    "OBC_SCORES",
    "SCORES",
    "LastQueryScorer",
    "LavaScorer",
    "OBCacheScorer",
    "QueryHeadScorer",
    "Reduction",
    "Scorer",
    "StatsRequest",
    "WindowAttentionScorer",
    "WindowStats",
    "scorer_for",
    "window_stats",
]
