"""EvictionConfig: the edge where user input (Python values or CLI strings) becomes the validated,
immutable settings a policy is built from.

Nothing downstream imports this module: a policy receives narrow settings types, never the config
(``Policy(common, knobs, score_knobs)``), so the dependency runs one way, type annotations included.

Where each knob is declared (``sgl_kvevict.settings.setting``: type, default, help text, validity):

* the knobs every policy reads: ``CommonSettings`` (``sgl_kvevict.settings``); those left
  ``None`` are resolved here from the policy's ``PolicyDefaults`` and the score's ``ScoreKind``;
* a method's own knobs: the settings dataclass its module declares, ``Policy.knobs_type`` (Ada-KV's
  ``alpha``, PyramidKV's ``pyramid_beta``, topk's ``layer_scale``, DBudgetKV's three) or ``Scorer.knobs_type`` (the learned
  score's ``learned_weights``). A knob two methods share is declared once, by one class both take.

``eviction_options()`` collects them all from the registries (``Option``: the declaration and who
takes it), so the launcher's ``--kv-evict-<name>`` flags, ``--help`` and the flag table of
docs/flags.md follow a new method without a line here. A knob given to a policy (and score) that does
not take it is refused, like a budget given to a policy without one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from sgl_kvevict.settings import Budget, CommonSettings, ConfigError, Settings, label_of, parse_text, settings_of
from sgl_kvevict.policies import Policy, PolicyDefaults, ScoredPolicy, get_policy_class, registered_policies
from sgl_kvevict.scoring import SCORE_KINDS, SCORES

DEFAULT_POLICY = "snapkv"
DEFAULT_BUDGET = "0.25"
POLICY_OPTION = "policy"


def _first_set(*values):
    return next(value for value in values if value is not None)


def _policy_class(policy: str) -> type[Policy]:
    try:
        return get_policy_class(policy)
    except KeyError:
        raise ConfigError(f"unknown policy {policy!r}; valid policies: {', '.join(registered_policies())}") from None


# --------------------------------------------------------------------------------------------------
# Options: every knob, where it is declared and who takes it
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One eviction option (one ``--kv-evict-<name>`` flag).

    field: its ``setting`` declaration; owner: a settings dataclass that has it (its type hints parse
    the option's strings). policies, scores: the policies and scores whose own knobs include it;
    both empty for a common knob, which every policy takes.
    """

    field: dataclasses.Field
    owner: type[Settings]
    policies: tuple[str, ...] = ()
    scores: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def common(self) -> bool:
        return not (self.policies or self.scores)

    def taken_by(self, policy: str, score: str) -> bool:
        return self.common or policy in self.policies or score in self.scores

    def takers(self) -> str:
        """Who takes a method's knob, for messages and ``--help``: ``policies ada-snapkv, lava``."""
        groups = (("policy", "policies", self.policies), ("score", "scores", self.scores))
        return " and ".join(
            f"{one if len(names) == 1 else many} {', '.join(names)}" for one, many, names in groups if names
        )


def eviction_options() -> dict[str, Option]:
    """Every option but the policy, by name: the common knobs, then each score's and each policy's
    own, from the registries (a policy registered later is included). Raises ``TypeError`` when two
    classes declare a knob of the same name: a shared knob is declared once, by one class both take."""
    options = {field.name: Option(field, CommonSettings) for field in settings_of(CommonSettings)}
    takers: dict[str, dict[str, list[str]]] = {}

    def add(knobs_type: type[Settings], kind: str, name: str) -> None:
        for field in settings_of(knobs_type):
            known = options.get(field.name)
            if known is not None and known.field is not field:
                raise TypeError(
                    f"knob {field.name!r} of {kind} {name!r} ({knobs_type.__qualname__}) is also declared by "
                    f"{known.owner.__qualname__}: declare it once and let both methods take that class"
                )
            options.setdefault(field.name, Option(field, _declaring_class(knobs_type, field.name)))
            takers.setdefault(field.name, {"policy": [], "score": []})[kind].append(name)

    for score, score_kind in SCORE_KINDS.items():
        add(score_kind.knobs_type, "score", score)
    for policy in registered_policies():
        add(get_policy_class(policy).knobs_type, "policy", policy)
    for name, by_kind in takers.items():
        options[name] = dataclasses.replace(options[name], policies=tuple(by_kind["policy"]), scores=tuple(by_kind["score"]))
    return options


def _declaring_class(knobs_type: type[Settings], name: str) -> type[Settings]:
    """The class of ``knobs_type``'s bases (or itself) whose body declares knob ``name``."""
    return next(cls for cls in knobs_type.__mro__ if name in cls.__dict__.get("__annotations__", {}))


def _option(raw_name: str, options: Mapping[str, Option], valid: list[str]) -> Option:
    """The option named ``raw_name`` (dashes allowed), or one ``ConfigError`` listing ``valid``."""
    option = options.get(raw_name.replace("-", "_"))
    if option is None:
        raise ConfigError(f"unknown eviction option {raw_name!r}; valid: {', '.join(valid)}")
    return option


# --------------------------------------------------------------------------------------------------
# EvictionConfig
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, init=False)
class EvictionConfig:
    """A policy with every knob resolved and checked: ``common`` (``CommonSettings``), ``knobs`` (an
    instance of the policy's ``knobs_type``) and ``score_knobs`` (its score's).

    ``EvictionConfig(policy, **options)`` takes option values by name (``budget`` may be a string;
    ``None`` = not given: the policy's or the score's default). ``config.<option>`` reads a resolved
    value by name (``config.window``, ``config.alpha``), for the options this policy takes.
    """

    policy: str
    common: CommonSettings
    knobs: Settings
    score_knobs: Settings

    def __init__(self, policy: str = DEFAULT_POLICY, **options: Any):
        policy_class = _policy_class(policy)
        known = eviction_options()
        given = {name: value for name, value in options.items() if value is not None}
        for name in given:
            _option(name, known, [POLICY_OPTION, *known])
        common = _resolve_common(policy, policy_class.defaults, {n: v for n, v in given.items() if known[n].common})
        knobs: dict[str, Any] = {}
        score_knobs: dict[str, Any] = {}
        for name, value in given.items():
            option = known[name]
            if not option.taken_by(policy, common.score):
                raise ConfigError(
                    f"{label_of(option.field)} {value!r} does not apply to policy {policy!r} with score "
                    f"{common.score!r} (it applies to {option.takers()})"
                )
            if policy in option.policies:
                knobs[name] = value
            if common.score in option.scores:
                score_knobs[name] = value
        resolved = {
            POLICY_OPTION: policy,
            "common": common,
            "knobs": policy_class.knobs_type(**knobs),
            "score_knobs": SCORE_KINDS[common.score].knobs_type(**score_knobs),
        }
        for name, value in resolved.items():
            object.__setattr__(self, name, value)
        policy_class.validate_settings(self.common, self.knobs)

    def option_values(self) -> dict[str, Any]:
        """Every option this config has, by name, resolved: the policy, the common knobs, the policy's
        own and its score's."""
        parts = (self.common, self.knobs, self.score_knobs)
        return {POLICY_OPTION: self.policy, **{f.name: getattr(p, f.name) for p in parts for f in dataclasses.fields(p)}}

    def __getattr__(self, name: str) -> Any:
        # Only called when ordinary lookup fails: an option's value by name.
        for part in ("common", "knobs", "score_knobs"):
            settings = self.__dict__.get(part)
            if settings is not None and name in settings.__dataclass_fields__:
                return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__} of policy {self.__dict__.get(POLICY_OPTION)!r} has no option {name!r}")

    # ---- constructors ----------------------------------------------------------------------------

    @classmethod
    def for_policy(cls, policy: str, **overrides) -> "EvictionConfig":
        """The paper configuration of ``policy``, with ``overrides`` (budget may be a string)."""
        return cls(policy=policy, **overrides)

    @classmethod
    def from_strings(cls, values: Mapping[str, Optional[str]]) -> "EvictionConfig":
        """Build from string values keyed by option name (the server's ``--kv-evict-<name>`` flags).

        ``None`` values are treated as absent; dashes in keys are accepted (``pooling-kernel``).
        Example: ``{"policy": "lava", "budget": "128t", "window": "32"}``.
        """
        known = eviction_options()
        kwargs: dict[str, Any] = {}
        for raw_key, text in values.items():
            if text is None:
                continue
            if raw_key == POLICY_OPTION:
                kwargs[POLICY_OPTION] = text.strip()
                continue
            option = _option(raw_key, known, [POLICY_OPTION, *known])
            kwargs[option.name] = parse_text(option.owner, option.field, text)
        return cls(**kwargs)

    def describe(self) -> str:
        """One-line summary for logs and the stats endpoint."""
        common = self.common
        parts = [f"policy={self.policy}"]
        if common.budget is not None:
            parts.append(f"budget={common.budget}")
        if common.score_threshold is not None:
            parts.append(f"score_threshold={common.score_threshold:g}")
        parts += [f"window={common.window}", f"score={common.score}", f"gqa={common.gqa}", f"pooling={common.pooling}"]
        return " ".join(parts)


def _resolve_common(policy: str, defaults: PolicyDefaults, given: Mapping[str, Any]) -> CommonSettings:
    """The common knobs: ``given`` ones, the rest from the score (OBCache: GQA sum; KVzip: max, no
    pooling) or else the policy; each checked by its declaration, the score against the policy."""
    score = given.get("score", defaults.scores[0])
    if score not in SCORES:
        raise ConfigError(f"score {score!r} is not one of {', '.join(SCORES)}")
    if score not in defaults.scores:
        raise ConfigError(f"score {score!r} does not apply to policy {policy!r} (valid: {', '.join(defaults.scores)})")
    score_kind = SCORE_KINDS[score]
    ranks_by_score = defaults.takes_budget and issubclass(_policy_class(policy), ScoredPolicy)
    if given.get("score_threshold") is not None and not ranks_by_score:
        raise ConfigError(
            f"policy {policy!r} does not rank candidates by a score under a budget; remove score threshold "
            f"{given['score_threshold']!r}"
        )
    resolved = {
        "budget": _resolve_budget(policy, defaults, given.get("budget")),
        "window": given.get("window", defaults.window),
        "score": score,
        "pooling": _first_set(given.get("pooling"), score_kind.pooling, defaults.pooling),
        "gqa": _first_set(given.get("gqa"), score_kind.gqa, defaults.gqa),
    }
    return CommonSettings(**{**given, **resolved})


def _resolve_budget(policy: str, defaults: PolicyDefaults, budget: Any) -> Optional[Budget]:
    if not defaults.takes_budget:
        if budget is not None:
            raise ConfigError(
                f"policy {policy!r} takes no budget (it keeps everything or decides per input); "
                f"remove budget {str(budget)!r}"
            )
        return None
    return Budget.parse(DEFAULT_BUDGET if budget is None else budget)


def build_policy(config: EvictionConfig) -> Policy:
    """The policy object ``config`` describes (one per engine; it serves every request)."""
    return get_policy_class(config.policy)(config.common, config.knobs, config.score_knobs)


# --------------------------------------------------------------------------------------------------
# Options a policy takes, for a command line shared by every policy
# --------------------------------------------------------------------------------------------------


def with_taken_defaults(policy: str, given: Mapping[str, str], defaults: Mapping[str, str]) -> dict[str, str]:
    """``given`` (option name -> string, as ``from_strings`` takes them) plus each of ``defaults`` that
    ``given`` does not set and ``policy`` takes: a budget when the policy has one, a score the policy
    accepts, any other common knob, a method's knob when the policy or its score declares it. The
    others are dropped, so one set of defaults serves every policy (the launcher's
    ``--kv-evict-default``, which ``make serve`` passes its budget and score through)."""
    policy_class = _policy_class(policy)
    known = eviction_options()
    options = dict(given)
    # The score first: a score's own knobs are taken only with that score.
    for raw_name in sorted(defaults, key=lambda raw: raw.replace("-", "_") != "score"):
        option, text = _option(raw_name, known, list(known)), defaults[raw_name]
        if option.name in options:
            continue
        if option.name == "budget":
            taken = policy_class.defaults.takes_budget
        elif option.name == "score":
            taken = text.strip() in policy_class.defaults.scores
        else:
            taken = option.taken_by(policy, options.get("score", policy_class.defaults.scores[0]).strip())
        if taken:
            options[option.name] = text
    return options
