"""Settings: how a knob declares its type, default, help text and validity, in one place.

A settings dataclass (a frozen subclass of ``Settings``) declares each knob with
``setting(default, help, valid=...)``; its annotation is the type. Everything else is derived from
that one declaration: parsing a CLI string (``parse_text``), the one-line ``ConfigError`` of a bad
value (checked on construction), the launcher's ``--kv-evict-<name>`` flags with their ``--help``,
and the table of flags in docs/flags.md. The knobs every policy reads are ``CommonSettings``, at the
end of this module; a method's own knobs are a settings dataclass in its own module
(``Policy.knobs_type``, ``Scorer.knobs_type``), so adding a knob is one field of the method that
reads it.

Also here: the error type of every user mistake in a configuration (``ConfigError``) and the budget
types, which both the config and the policies use. This module imports nothing from the package,
so every other module may import it.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union


class ConfigError(ValueError):
    """One user mistake in a configuration, with a message that says how to fix it."""


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
# Settings
# --------------------------------------------------------------------------------------------------

_HELP = "help"
_PARSE = "parse"
_VALID = "valid"
_LAYERS = "layers"  # the setting names model layers (``Settings.on_layers`` renumbers it)

# (holds, message): ``holds(value)`` is true for a valid value; ``message`` is the ConfigError's text,
# formatted with ``value`` (``"alpha {value!r} must be in [0, 1]"``).
Rule = tuple[Callable[[Any], bool], str]


def setting(
    default: Any, help: str, parse: Optional[Callable[[str], Any]] = None, valid: Optional[Rule] = None,
    names_layers: bool = False,
) -> Any:  # fmt: skip
    """A dataclass field with its ``--help`` text; ``parse`` turns a CLI string into the field's value
    when the annotation alone cannot (the default parser follows the annotation: int, float, str,
    ``tuple[int, ...]``); ``valid`` is checked when a ``Settings`` dataclass is constructed; ``names_layers``:
    a tuple of model layer indices (``Settings.on_layers``)."""
    metadata = {_HELP: help, _PARSE: parse, _VALID: valid, _LAYERS: names_layers}
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults are not settings; use a tuple")
    return dataclasses.field(default=default, metadata=metadata)


def int_at_least(minimum: int) -> Callable[[Any], bool]:
    """The check of an integer setting with a lower bound (for ``valid``)."""
    return lambda value: isinstance(value, int) and value >= minimum


def layer_indices(default: tuple[int, ...], help: str, label: str) -> Any:
    """A setting of layer indices (comma-separated on the command line), each an integer >= 0;
    ``label`` names it in the error."""
    return setting(
        default,
        help=help,
        valid=(lambda layers: all(isinstance(layer, int) and layer >= 0 for layer in layers), label + " {value!r} must be layer indices >= 0"),
        names_layers=True,
    )


def help_of(field: dataclasses.Field) -> str:
    return field.metadata[_HELP]


def label_of(field: dataclasses.Field) -> str:
    """How messages name a setting: ``pyramid_beta`` -> ``pyramid beta``."""
    return field.name.replace("_", " ")


def settings_of(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` declared with ``setting`` (every field of a settings dataclass must be)."""
    fields = dataclasses.fields(cls)
    missing = [f.name for f in fields if _HELP not in f.metadata]
    if missing:
        raise TypeError(f"{cls.__name__} fields without setting(): {', '.join(missing)}")
    return list(fields)


@dataclass(frozen=True)
class Settings:
    """Base of every settings dataclass: construction checks each field's ``valid`` rule, in field
    order, and raises the first failing rule's ``ConfigError``. Itself the empty set of knobs (a
    method that declares none)."""

    def __post_init__(self):
        for field in settings_of(type(self)):
            rule = field.metadata[_VALID]
            value = getattr(self, field.name)
            if isinstance(value, list):  # a list given in code: settings are frozen, hashable values
                value = tuple(value)
                object.__setattr__(self, field.name, value)
            if rule is not None and not rule[0](value):
                raise ConfigError(rule[1].format(value=value))

    def on_layers(self, layers: tuple[int, ...]) -> "Settings":
        """These settings where only the model's layers ``layers`` (ascending) are seen, renumbered ``0..`` in
        that order (``Policy.for_layers``): a setting naming layers keeps those of them in ``layers``, in its
        own order, at their new index; ``self`` when none names layers."""
        index = {layer: new for new, layer in enumerate(layers)}
        renumbered = {
            field.name: tuple(index[layer] for layer in getattr(self, field.name) if layer in index)
            for field in settings_of(type(self))
            if field.metadata[_LAYERS]
        }
        return dataclasses.replace(self, **renumbered) if renumbered else self


def parse_text(cls: type, field: dataclasses.Field, text: str) -> Any:
    """One CLI string to the value of ``field`` of settings dataclass ``cls``."""
    label = label_of(field)
    custom = field.metadata.get(_PARSE)
    if custom is not None:
        return custom(text.strip())
    kind = _plain_type(typing.get_type_hints(cls)[field.name])
    if kind is str:
        return text.strip()
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise ConfigError(f"{label} {text!r} must be {'an integer' if kind is int else 'a number'}") from None
    if kind == tuple[int, ...]:
        try:
            return tuple(int(item) for item in text.replace(",", " ").split())
        except ValueError:
            raise ConfigError(f"{label} {text!r} must be comma-separated integers") from None
    raise TypeError(f"setting {field.name} of type {kind} needs parse=")


def _plain_type(annotation: Any) -> Any:
    """``Optional[X]`` -> ``X``; anything else unchanged."""
    if typing.get_origin(annotation) is Union:
        arguments = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(arguments) == 1:
            return arguments[0]
    return annotation


# --------------------------------------------------------------------------------------------------
# CommonSettings: the knobs every policy reads (budget, window, scoring reduction, sinks)
# --------------------------------------------------------------------------------------------------
# Each is declared once here with ``setting``, which gives its ``--kv-evict-<name>`` flag, its
# ``--help`` and the check of its value. ``None`` defaults are the policy's (``PolicyDefaults``) or the
# score's: the config (``sgl_kvevict.config.EvictionConfig``, the edge) resolves them and constructs
# ``CommonSettings`` with every value set, so a policy or scorer always receives it resolved (``budget``
# is ``None`` only for a policy without a budget).

POOLINGS = ("max", "avg", "none")
GQA_REDUCTIONS = ("mean", "max", "sum")


@dataclass(frozen=True)
class CommonSettings(Settings):
    """Each field's help text says what it means (``sgl_kvevict.settings.help_of``)."""

    budget: Optional[Budget] = setting(
        None,
        help="average entries kept per (layer, KV head) of each compressed prompt segment, observation window "
        "included: a ratio of the segment ('0.25' or '25%') or a token count ('128t', the papers' 'budget 128')",
        # The config parses it (Budget.parse) once it knows whether the policy takes a budget.
        parse=str,
    )
    window: Optional[int] = setting(
        None,
        help="observation window: the segment's last W tokens are always kept (never compressed) and their "
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
        "score, which predicts log KVzip scores), at most the budget, which becomes a cap: each segment keeps "
        "what its own scores earn, so a segment with more that matters keeps more (score-based policies)",
    )
    sink_tokens: int = setting(
        4,
        help="the sequence's first tokens (attention sinks, absolute positions) are never evicted by any "
        "policy; they count in the budget like the window",
        valid=(int_at_least(0), "sink tokens {value!r} must be an integer >= 0"),
    )
    min_segment_length: int = setting(
        0,
        help="prompt segments shorter than this many tokens stay dense (all policies)",
        valid=(int_at_least(0), "min segment length {value!r} must be >= 0"),
    )
