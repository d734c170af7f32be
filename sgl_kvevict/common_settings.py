"""CommonSettings: the knobs every policy reads (budget, window, scoring reduction, sinks).

A method's own knobs live in its module (``Policy.knobs_type``, ``Scorer.knobs_type``); these are the
ones shared by all. Each is declared once here with ``setting`` (``sgl_kvevict.settings``), which
gives its ``--kv-evict-<name>`` flag, its ``--help`` and the check of its value.

``None`` defaults are the policy's (``PolicyDefaults``) or the score's: the config
(``sgl_kvevict.config.EvictionConfig``, the edge) resolves them and constructs this dataclass with
every value set, so a policy or scorer always receives it resolved (``budget`` is ``None`` only for
a policy without a budget). Like ``settings``, this module imports nothing of the policies or
scores, so they may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sgl_kvevict.settings import Budget, Settings, int_at_least, setting

POOLINGS = ("max", "avg", "none")
GQA_REDUCTIONS = ("mean", "max", "sum")


@dataclass(frozen=True)
class CommonSettings(Settings):
    """Each field's help text says what it means (``sgl_kvevict.settings.help_of``)."""

    budget: Optional[Budget] = setting(
        None,
        help="average entries kept per (layer, KV head) of each compressed prompt span, observation window "
        "included: a ratio of the span ('0.25' or '25%') or a token count ('128t', the papers' 'budget 128')",
        # The config parses it (Budget.parse) once it knows whether the policy takes a budget.
        parse=str,
    )
    window: Optional[int] = setting(
        None,
        help="observation window: the span's last W tokens are always kept (never compressed) and their "
        "queries score the rest",
        valid=(int_at_least(1), "window {value!r} must be an integer >= 1"),
    )
    pooling: Optional[str] = setting(
        None,
        help="smoothing of candidate scores along positions before the top-k (max, avg, none)",
        valid=(lambda pooling: pooling in POOLINGS, "pooling {value!r} is not one of " + ", ".join(POOLINGS)),
    )
    pooling_kernel: int = setting(
        7,
        help="width of that smoothing, odd (SnapKV / Ada-KV / LAVa use 7)",
        valid=(
            lambda kernel: int_at_least(1)(kernel) and kernel % 2 == 1,
            "pooling kernel {value!r} must be an odd integer >= 1 (centred on each position)",
        ),
    )
    gqa: Optional[str] = setting(
        None,
        help="how the scores of a GQA group's query heads reduce onto their KV head (mean, max, sum); "
        "OBCache scores default to sum",
        valid=(lambda gqa: gqa in GQA_REDUCTIONS, "gqa reduction {value!r} is not one of " + ", ".join(GQA_REDUCTIONS)),
    )
    score: Optional[str] = setting(
        None,
        help="what ranks the candidates: 'attn' (attention the window pays them), an OBCache score "
        "(obc-value, obc-key, obc-joint), or a question-agnostic one, safe to reuse for any later question: "
        "'kvzip' (attention a reconstruction of the context pays them; one extra pass over the context) or "
        "'learned' (a per-layer regressor from hidden states predicting KVzip's score; no extra pass)",
    )
    score_threshold: Optional[float] = setting(
        None,
        help="keep the candidates whose score is at least this value (KVzap's usage: e.g. -6 for the learned "
        "score, which predicts log KVzip scores), at most the budget, which becomes a cap: each span keeps "
        "what its own scores earn, so a span with more that matters keeps more (score-based policies)",
    )
    sink_tokens: int = setting(
        4,
        help="the sequence's first tokens (attention sinks, absolute positions) are never evicted by any "
        "policy; they count in the budget like the window",
        valid=(int_at_least(0), "sink tokens {value!r} must be an integer >= 0"),
    )
    min_segment_length: int = setting(
        0,
        help="prompt spans shorter than this many tokens stay dense (all policies)",
        valid=(int_at_least(0), "min segment length {value!r} must be >= 0"),
    )
