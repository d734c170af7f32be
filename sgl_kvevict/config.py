"""EvictionConfig: every knob of KV eviction, its paper default, its help text and its validation.

This module is the edge: it turns user input (Python values or CLI strings) into a fully resolved,
validated, immutable config. Everything downstream (scoring, budget, policies) trusts it; none of
those modules imports this one (they read the config's attributes), so the dependency runs one way.

Each field is a ``setting`` (``sgl_kvevict.settings``): its annotation, default and help text are
declared once here, and the CLI parsing, the launcher's ``--kv-evict-<field>`` flags and ``--help``
are derived from them. Per-policy paper defaults (window, pooling, GQA reduction, which scores apply,
whether the policy takes a budget) are declared by each policy class as ``PolicyDefaults``; fields
left ``None`` here are filled from them, so adding a paper means one new policy module.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Union

from sgl_kvevict.policies import Policy, PolicyDefaults, get_policy_class, registered_policies
from sgl_kvevict.scoring import LEARNED_SCORE, SCORE_KINDS, SCORES, ScoreKind
from sgl_kvevict.settings import Budget, ConfigError, parse_text, setting, settings_of

POOLINGS = ("max", "avg", "none")
GQA_REDUCTIONS = ("mean", "max", "sum")
DEFAULT_BUDGET = "0.25"


def _first_set(*values):
    return next(value for value in values if value is not None)


def _policy_class(policy: str) -> type[Policy]:
    try:
        return get_policy_class(policy)
    except KeyError:
        raise ConfigError(f"unknown policy {policy!r}; valid policies: {', '.join(registered_policies())}") from None


# --------------------------------------------------------------------------------------------------
# EvictionConfig
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvictionConfig:
    """Every eviction knob; ``None`` fields resolve to the policy's paper default on construction.
    Each field's help text says what it means (``sgl_kvevict.settings.help_of``)."""

    policy: str = setting("snapkv", help="registered eviction policy")
    budget: Union[Budget, str, float, None] = setting(
        None,
        help="average entries kept per (layer, KV head) of each compressed prompt span, observation window "
        "included: a ratio of the span ('0.25' or '25%') or a token count ('128t', the papers' 'budget 128')",
        parse=str,
    )
    window: Optional[int] = setting(
        None,
        help="observation window: the span's last W tokens are always kept (never compressed) and their "
        "queries score the rest",
    )
    pooling: Optional[str] = setting(
        None, help="smoothing of candidate scores along positions before the top-k (max, avg, none)"
    )
    pooling_kernel: int = setting(7, help="width of that smoothing, odd (SnapKV / Ada-KV / LAVa use 7)")
    gqa: Optional[str] = setting(
        None,
        help="how the scores of a GQA group's query heads reduce onto their KV head (mean, max, sum); "
        "OBCache scores default to sum",
    )
    score: Optional[str] = setting(
        None,
        help="what ranks the candidates: 'attn' (attention the window pays them), an OBCache score "
        "(obc-value, obc-key, obc-joint), or a question-agnostic one, safe to reuse for any later question: "
        "'kvzip' (attention a reconstruction of the context pays them; one extra pass over the context) or "
        "'learned' (a per-layer regressor from hidden states predicting KVzip's score; no extra pass)",
    )
    learned_weights: Optional[str] = setting(
        None,
        help="score 'learned': the regressor's weights (.safetensors, with its .json manifest beside it); "
        "unset: the weights bundled for the served model, found by its fingerprint",
    )
    sink_tokens: int = setting(
        4,
        help="the sequence's first tokens (attention sinks, absolute positions) are never evicted by any "
        "policy; they count in the budget like the window",
    )
    alpha: float = setting(
        0.2,
        help="Ada-KV safeguard and LAVa head floor: fraction of the uniform per-head share every KV head is "
        "guaranteed (ada-snapkv, ada-pyramidkv, lava; the code's meaning, the Ada-KV paper prints it swapped)",
    )
    pyramid_beta: int = setting(
        20, help="PyramidKV: ratio between the average and the last layer's budget (pyramidkv, ada-pyramidkv)"
    )
    dbudget_threshold: float = setting(
        0.01,
        help="DBudgetKV t: stop keeping tokens once the attention-output norm drops by less than this fraction "
        "(dbudget)",
    )
    dbudget_query_rows: int = setting(
        1, help="DBudgetKV k: last query rows that measure the norm drop; at most the window (dbudget)"
    )
    dbudget_frozen_layers: tuple[int, ...] = setting(
        (0, 1), help="DBudgetKV: comma-separated layer indices never pruned (dbudget)"
    )
    min_segment_length: int = setting(0, help="prompt spans shorter than this many tokens stay dense (all policies)")

    def __post_init__(self):
        policy_class = _policy_class(self.policy)
        defaults = policy_class.defaults
        score = defaults.scores[0] if self.score is None else self.score
        # A score brings its own GQA reduction and pooling defaults (OBCache: sum; KVzip: max, none).
        score_kind = SCORE_KINDS.get(score, ScoreKind(None))
        resolved = {
            "budget": self._resolve_budget(defaults),
            "window": defaults.window if self.window is None else self.window,
            "score": score,
            "pooling": _first_set(self.pooling, score_kind.pooling, defaults.pooling),
            "gqa": _first_set(self.gqa, score_kind.gqa, defaults.gqa),
            "dbudget_frozen_layers": tuple(self.dbudget_frozen_layers),
        }
        for name, value in resolved.items():
            object.__setattr__(self, name, value)
        self._validate(defaults)
        policy_class.validate_config(self)

    def _resolve_budget(self, defaults: PolicyDefaults) -> Optional[Budget]:
        if not defaults.takes_budget:
            if self.budget is not None:
                raise ConfigError(
                    f"policy {self.policy!r} takes no budget (it keeps everything or decides per input); "
                    f"remove budget {str(self.budget)!r}"
                )
            return None
        return Budget.parse(DEFAULT_BUDGET if self.budget is None else self.budget)

    def _validate(self, defaults: PolicyDefaults) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        check(isinstance(self.window, int) and self.window >= 1, f"window {self.window!r} must be an integer >= 1")
        check(self.pooling in POOLINGS, f"pooling {self.pooling!r} is not one of {', '.join(POOLINGS)}")
        check(
            isinstance(self.pooling_kernel, int) and self.pooling_kernel >= 1 and self.pooling_kernel % 2 == 1,
            f"pooling kernel {self.pooling_kernel!r} must be an odd integer >= 1 (centred on each position)",
        )
        check(self.gqa in GQA_REDUCTIONS, f"gqa reduction {self.gqa!r} is not one of {', '.join(GQA_REDUCTIONS)}")
        check(self.score in SCORES, f"score {self.score!r} is not one of {', '.join(SCORES)}")
        check(
            self.score in defaults.scores,
            f"score {self.score!r} does not apply to policy {self.policy!r} (valid: {', '.join(defaults.scores)})",
        )
        check(
            0.0 <= self.alpha <= 1.0,
            f"alpha {self.alpha!r} must be in [0, 1] (the guaranteed uniform share per head)",
        )
        check(
            isinstance(self.pyramid_beta, int) and self.pyramid_beta >= 1,
            f"pyramid beta {self.pyramid_beta!r} must be an integer >= 1",
        )
        check(
            0.0 < self.dbudget_threshold < 1.0,
            f"dbudget threshold {self.dbudget_threshold!r} must be in (0, 1) (0.01 = stop at a 1% norm drop)",
        )
        check(
            isinstance(self.dbudget_query_rows, int) and self.dbudget_query_rows >= 1,
            f"dbudget query rows {self.dbudget_query_rows!r} must be an integer >= 1",
        )
        check(
            all(isinstance(layer, int) and layer >= 0 for layer in self.dbudget_frozen_layers),
            f"dbudget frozen layers {self.dbudget_frozen_layers!r} must be layer indices >= 0",
        )
        check(
            isinstance(self.sink_tokens, int) and self.sink_tokens >= 0,
            f"sink tokens {self.sink_tokens!r} must be an integer >= 0",
        )
        if self.learned_weights is not None:
            check(
                self.score == LEARNED_SCORE,
                f"learned weights {self.learned_weights!r} apply to score 'learned' only (score is {self.score!r})",
            )
            check(Path(self.learned_weights).is_file(), f"learned weights {self.learned_weights!r} is not a file")
        check(self.min_segment_length >= 0, f"min segment length {self.min_segment_length!r} must be >= 0")

    # ---- constructors ----------------------------------------------------------------------------

    @classmethod
    def for_policy(cls, policy: str, **overrides) -> "EvictionConfig":
        """The paper configuration of ``policy``, with ``overrides`` (budget may be a string)."""
        return cls(policy=policy, **overrides)

    @classmethod
    def from_strings(cls, values: Mapping[str, Optional[str]]) -> "EvictionConfig":
        """Build from string values keyed by field name (the server's ``--kv-evict-<field>`` flags).

        ``None`` values are treated as absent; dashes in keys are accepted (``pooling-kernel``).
        Example: ``{"policy": "lava", "budget": "128t", "window": "32"}``.
        """
        known = {f.name: f for f in settings_of(cls)}
        kwargs: dict[str, object] = {}
        for raw_key, text in values.items():
            if text is None:
                continue
            key = raw_key.replace("-", "_")
            if key not in known:
                raise ConfigError(f"unknown eviction option {raw_key!r}; valid: {', '.join(known)}")
            kwargs[key] = parse_text(cls, known[key], text)
        return cls(**kwargs)

    def describe(self) -> str:
        """One-line summary for logs and the stats endpoint."""
        parts = [f"policy={self.policy}"]
        if self.budget is not None:
            parts.append(f"budget={self.budget}")
        parts += [f"window={self.window}", f"score={self.score}", f"gqa={self.gqa}", f"pooling={self.pooling}"]
        return " ".join(parts)


def build_policy(config: EvictionConfig) -> Policy:
    """The policy object ``config`` describes (one per engine; it serves every request)."""
    return get_policy_class(config.policy)(config)
