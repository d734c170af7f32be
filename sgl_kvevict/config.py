"""EvictionConfig: every knob of KV eviction, its paper default, and its validation.

This module is the edge: it turns user input (Python values or CLI strings) into a fully resolved,
validated, immutable config. Everything downstream (scoring, budget, policies) trusts it.

Per-policy paper defaults (window, pooling, GQA reduction, which scores apply, whether the policy
takes a budget) are declared by each policy class as ``PolicyDefaults``; fields left ``None`` here
are filled from them, so adding a paper means one new policy module, not an edit of this file.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Mapping, Optional, Union

if TYPE_CHECKING:
    from sgl_kvevict.policies.base import Policy

POOLINGS = ("max", "avg", "none")
GQA_REDUCTIONS = ("mean", "max", "sum")
SCORES = ("attn", "obc-value", "obc-key", "obc-joint")
OBC_SCORES = SCORES[1:]


class ConfigError(ValueError):
    """One user mistake in the eviction configuration, with a message that says how to fix it."""


# --------------------------------------------------------------------------------------------------
# Budget
# --------------------------------------------------------------------------------------------------


class Budget(abc.ABC):
    """Average kept entries per (layer, KV head) of a segment, observation window included."""

    @abc.abstractmethod
    def per_head(self, segment_length: int) -> int:
        """Average entries each (layer, KV head) keeps of a segment of ``segment_length`` tokens."""

    @staticmethod
    def parse(value: Union["Budget", str, float]) -> "Budget":
        """``"0.25"`` / ``0.25`` / ``"25%"`` -> ``RatioBudget``; ``"128t"`` -> ``TokenBudget``."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, float):
            return RatioBudget(value)
        if not isinstance(value, str):
            raise ConfigError(
                f"budget {value!r} must be a ratio such as 0.25 or a string such as '0.25', '25%' or '128t'"
            )
        text = value.strip().lower()
        if text.endswith("t") and text[:-1].isdigit():
            return TokenBudget(int(text[:-1]))
        if text.endswith("%") and _is_number(text[:-1]):
            return RatioBudget(float(text[:-1]) / 100)
        if "." in text and _is_number(text):
            return RatioBudget(float(text))
        raise ConfigError(
            f"budget {value!r} is neither a ratio in (0, 1) such as '0.25' or '25%' "
            "nor a token count per (layer, KV head) such as '128t'"
        )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class RatioBudget(Budget):
    """Keep ``fraction`` of the segment per (layer, KV head) on average (rounded to nearest)."""

    fraction: float

    def __post_init__(self):
        if not 0.0 < self.fraction < 1.0:
            raise ConfigError(
                f"budget ratio {self.fraction} must be in (0, 1): it is the fraction of the segment kept "
                "(1 or more keeps everything: use policy 'full')"
            )

    def per_head(self, segment_length: int) -> int:
        return math.floor(self.fraction * segment_length + 0.5)

    def __str__(self) -> str:
        return f"{self.fraction:g}"


@dataclass(frozen=True)
class TokenBudget(Budget):
    """Keep ``tokens`` entries per (layer, KV head) on average (the papers' "budget 128")."""

    tokens: int

    def __post_init__(self):
        if self.tokens <= 0:
            raise ConfigError(f"budget '{self.tokens}t' must keep at least one token per (layer, KV head)")

    def per_head(self, segment_length: int) -> int:
        return self.tokens

    def __str__(self) -> str:
        return f"{self.tokens}t"


# --------------------------------------------------------------------------------------------------
# Per-policy defaults
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyDefaults:
    """What a policy class declares about itself; ``EvictionConfig`` resolves ``None`` fields from it.

    window: observation window (queries that score, tokens always kept).
    pooling: smoothing of candidate scores along positions.
    gqa: reduction of query-head scores onto their KV head for the ``attn`` score (OBCache scores
        always default to ``sum``, the GQA-aware objective of OBCache Eq. 33-35).
    scores: the ``score`` values the policy accepts.
    takes_budget: False for policies that keep everything or decide their own budget.
    """

    window: int = 32
    pooling: str = "max"
    gqa: str = "mean"
    scores: tuple[str, ...] = ("attn",)
    takes_budget: bool = True


DEFAULT_BUDGET = "0.25"


def _policy_class(policy: str) -> type["Policy"]:
    # Imported here, not at module level: the policy modules import this module.
    from sgl_kvevict.policies import get_policy_class, registered_policies

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

    policy: registered policy name (``sgl_kvevict.policies.registered_policies()``).
    budget: average kept entries per (layer, KV head), window included: ``"0.25"`` (ratio of the
        segment), ``"128t"`` (tokens). ``None`` = 0.25 for policies that take a budget.
    window: observation window; its tokens are always kept and its queries score the rest.
    pooling, pooling_kernel: smoothing of candidate scores along positions (``max`` kernel 7 as
        SnapKV/Ada-KV/LAVa; ``none`` for H2O and TOVA).
    gqa: reduction of query-head scores to KV heads (``mean`` SnapKV/Ada-KV, ``max`` LAVa, ``sum``
        OBCache).
    score: ``attn`` or an OBCache score (``obc-value``/``obc-key``/``obc-joint``) for the policies
        that accept one (h2o, tova, snapkv, ada-snapkv, ada-pyramidkv).
    alpha: Ada-KV safeguard (also LAVa's head floor): the fraction of the uniform per-head share every
        KV head is guaranteed (the code's meaning; the Ada-KV paper prints it swapped).
    pyramid_beta: PyramidKV's ratio between the average and the last layer's budget.
    dbudget_threshold, dbudget_query_rows, dbudget_sinks, dbudget_frozen_layers: DBudgetKV's t, k, m
        and the layers it never prunes.
    streaming_sinks: StreamingLLM's attention-sink tokens.
    min_segment_length: segments shorter than this are kept whole.
    """

    policy: str = "snapkv"
    budget: Union[Budget, str, float, None] = None
    window: Optional[int] = None
    pooling: Optional[str] = None
    pooling_kernel: int = 7
    gqa: Optional[str] = None
    score: str = "attn"
    alpha: float = 0.2
    pyramid_beta: int = 20
    dbudget_threshold: float = 0.01
    dbudget_query_rows: int = 1
    dbudget_sinks: int = 4
    dbudget_frozen_layers: tuple[int, ...] = (0, 1)
    streaming_sinks: int = 4
    min_segment_length: int = 0

    def __post_init__(self):
        policy_class = _policy_class(self.policy)
        defaults = policy_class.defaults
        resolved = {
            "budget": self._resolve_budget(defaults),
            "window": defaults.window if self.window is None else self.window,
            "pooling": defaults.pooling if self.pooling is None else self.pooling,
            "gqa": self._resolve_gqa(defaults),
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

    def _resolve_gqa(self, defaults: PolicyDefaults) -> str:
        if self.gqa is not None:
            return self.gqa
        return "sum" if self.score in OBC_SCORES else defaults.gqa

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
        check(self.dbudget_sinks >= 0, f"dbudget sinks {self.dbudget_sinks!r} must be >= 0")
        check(
            all(isinstance(layer, int) and layer >= 0 for layer in self.dbudget_frozen_layers),
            f"dbudget frozen layers {self.dbudget_frozen_layers!r} must be layer indices >= 0",
        )
        check(self.streaming_sinks >= 0, f"streaming sinks {self.streaming_sinks!r} must be >= 0")
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
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, object] = {}
        for raw_key, text in values.items():
            if text is None:
                continue
            key = raw_key.replace("-", "_")
            if key not in known:
                raise ConfigError(f"unknown eviction option {raw_key!r}; valid: {', '.join(known)}")
            kwargs[key] = _parse_field(key, text)
        return cls(**kwargs)

    def describe(self) -> str:
        """One-line summary for logs and the stats endpoint."""
        parts = [f"policy={self.policy}"]
        if self.budget is not None:
            parts.append(f"budget={self.budget}")
        parts += [f"window={self.window}", f"score={self.score}", f"gqa={self.gqa}", f"pooling={self.pooling}"]
        return " ".join(parts)


def _parse_field(key: str, text: str) -> object:
    """One CLI string to the type of field ``key``."""
    if key in ("policy", "pooling", "gqa", "score", "budget"):
        return text.strip()
    if key == "dbudget_frozen_layers":
        items = [item for item in text.replace(",", " ").split() if item]
        try:
            return tuple(int(item) for item in items)
        except ValueError:
            raise ConfigError(f"dbudget frozen layers {text!r} must be comma-separated layer indices") from None
    number_type = float if key in ("alpha", "dbudget_threshold") else int
    try:
        return number_type(text)
    except ValueError:
        kind = "a number" if number_type is float else "an integer"
        raise ConfigError(f"{key.replace('_', ' ')} {text!r} must be {kind}") from None


def build_policy(config: EvictionConfig) -> "Policy":
    """The policy object ``config`` describes (one per engine; it serves every request)."""
    from sgl_kvevict.policies import get_policy_class

    return get_policy_class(config.policy)(config)
