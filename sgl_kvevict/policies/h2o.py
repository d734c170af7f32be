"""H2O, prefill version (docs/methods/baselines.md#h2o-prefill-version): attention accumulated over the observation window only
(full-history accumulation is incompatible with a fused prefill), no pooling; the window tokens are
the "recent" tokens and the rest of the budget goes to the heavy hitters. SnapKV without pooling.
Its scores are the window's own (attention, OBCache); with a question-agnostic score it would be
SnapKV with ``--kv-evict-pooling none``."""

from __future__ import annotations

from sgl_kvevict.policies.base import PolicyDefaults, register_policy
from sgl_kvevict.policies.scored import ScoredPolicy
from sgl_kvevict.scoring import WINDOW_SCORES


@register_policy("h2o")
class H2OPolicy(ScoredPolicy):
    defaults = PolicyDefaults(window=32, pooling="none", gqa="mean", scores=WINDOW_SCORES)
