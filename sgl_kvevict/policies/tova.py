"""TOVA (Oren et al. 2024), prefill version: keep the tokens the last query attends to most.

The window is the last query alone (docs/methods/baselines.md#tova-prefill-version: no recent window, the whole budget goes to
the scored tokens; the last token itself is kept). OBCache scores with window 1 are their TOVA form.
Scores are the last query's own (attention, OBCache): TOVA is defined by that query.
"""

from __future__ import annotations

from sgl_kvevict.settings import CommonSettings, ConfigError, Settings
from sgl_kvevict.policies.base import PolicyDefaults, register_policy
from sgl_kvevict.policies.scored import ScoredPolicy
from sgl_kvevict.scoring import OBC_SCORES, WINDOW_SCORES, LastQueryScorer, Scorer, scorer_for


@register_policy("tova")
class TOVAPolicy(ScoredPolicy):
    defaults = PolicyDefaults(window=1, pooling="none", gqa="mean", scores=WINDOW_SCORES)

    @classmethod
    def validate_settings(cls, common: CommonSettings, knobs: Settings) -> None:
        if common.score in OBC_SCORES and common.window != 1:
            raise ConfigError(
                f"tova scores with the last query only, but {common.score} sums over the whole window: "
                f"use window 1 with tova (got {common.window})"
            )

    def build_scorer(self) -> Scorer:
        return scorer_for(self.common, self.score_knobs, attention=LastQueryScorer)
