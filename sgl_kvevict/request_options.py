"""Eviction options a request chooses for itself (``--kv-evict-per-request``), bounded by the operator.

A request names its options in SGLang's ``extra_key`` field, ``"kvevict:policy=snapkv,budget=0.5"``
(the ``--kv-evict-*`` option names). Clients are not trusted, so three bounds apply:

* an allow-list (``--kv-evict-request-allow``, ``AllowList``) says which options a request may set
  and which values the resolved configuration may take. It is checked on the *resolved* config, so
  a policy whose default score is expensive (``topk`` ranks by KVzip's reconstruction pass) is
  refused unless that score is allowed;
* an option string longer than ``MAX_OPTIONS_LENGTH`` is refused before it is parsed;
* the scheduler keeps the setups it built for accepted strings in an LRU cache of
  ``SETUP_CACHE_SIZE`` entries (``RequestSetups``): a client that varies one digit per request
  costs one rebuild per request, never memory.

A refused string is answered before the request reaches the scheduler: the server's HTTP process
raises ``RequestOptionsRefused`` (a ``ValueError``, which SGLang turns into HTTP 400 with the
message; ``server.sglang_entry``). The scheduler checks again as a safety net for servers started
another way; there the request stays dense and ``request_option_errors`` counts it.

Nothing here imports SGLang.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, Iterable, Mapping, Optional, TypeVar

from sgl_kvevict.settings import ConfigError, GQA_REDUCTIONS, POOLINGS
from sgl_kvevict.config import POLICY_OPTION, EvictionConfig, eviction_options
from sgl_kvevict.policies import registered_policies
from sgl_kvevict.scoring import SCORES

REQUEST_OPTIONS_PREFIX = "kvevict:"
# Longer than any useful combination of the options (every option set is about 300 characters).
MAX_OPTIONS_LENGTH = 256
# Distinct option strings whose setups (config, policy, scorer) the scheduler keeps built.
SETUP_CACHE_SIZE = 16
ALLOW_ALL = "all"
ANY_VALUE = "*"
RANGE_SEPARATOR = ".."
# What a request may choose unless the operator says otherwise: the policy, its budget within
# [5%, 95%] or [16, 4096] tokens per head, the scores that cost no extra pass, and a window of at
# most 64 tokens (the window's queries are scored against the whole segment: its size is memory).
DEFAULT_ALLOW = "policy=*,budget=0.05..0.95|16t..4096t,score=attn|learned|obc-value|obc-key|obc-joint,window=1..64"


class RequestOptionsRefused(ConfigError):
    """A request's eviction options the server does not serve; the message is one line for the client."""


def _option_names() -> list[str]:
    return [POLICY_OPTION, *eviction_options()]


def _choices() -> dict[str, tuple[str, ...]]:
    """The options with a closed set of values, for checking an allow-list's literals at start-up."""
    return {"policy": tuple(registered_policies()), "score": SCORES, "pooling": POOLINGS, "gqa": GQA_REDUCTIONS}


@dataclass(frozen=True)
class Alternative:
    """One accepted value of an option: any (``*``), a literal, or an inclusive numeric range
    ``low..high``; ``tokens``: the range is of token counts written ``16t..4096t`` (budgets)."""

    text: str
    low: Optional[float] = None
    high: Optional[float] = None
    tokens: bool = False

    @classmethod
    def parse(cls, name: str, text: str) -> "Alternative":
        if RANGE_SEPARATOR not in text:
            choices = _choices().get(name)
            if text != ANY_VALUE and choices is not None and text not in choices:
                raise ConfigError(f"{name}={text} names no {name}; valid: {', '.join(choices)}")
            return cls(text)
        low_text, high_text = text.split(RANGE_SEPARATOR, 1)
        tokens = low_text.endswith("t") and high_text.endswith("t")
        try:
            low, high = (float(bound[:-1] if tokens else bound) for bound in (low_text, high_text))
        except ValueError:
            raise ConfigError(f"{name}={text}: a range is two numbers, 'low..high' (or '16t..4096t' for tokens)") from None
        if low > high:
            raise ConfigError(f"{name}={text}: the range is empty ({low:g} > {high:g})")
        return cls(text, low, high, tokens)

    def accepts(self, value: str) -> bool:
        if self.low is None:
            return self.text in (ANY_VALUE, value)
        if self.tokens != value.endswith("t"):
            return False
        try:
            number = float(value[:-1] if self.tokens else value)
        except ValueError:
            return False
        return self.low <= number <= self.high


@dataclass(frozen=True)
class AllowList:
    """Which eviction options a request may set, and the values its resolved config may take.

    rules: option name -> its accepted alternatives; None: every option and value (``all``)."""

    rules: Optional[Mapping[str, tuple[Alternative, ...]]]
    spec: str

    @classmethod
    def parse(cls, spec: str) -> "AllowList":
        """``all``, or ``name=alternatives`` items separated by commas, the alternatives by ``|``:
        ``policy=*,budget=0.05..0.95|16t..4096t,score=attn|learned,window=1..64``."""
        spec = spec.strip()
        if spec == ALLOW_ALL:
            return cls(None, spec)
        names = _option_names()
        rules: dict[str, tuple[Alternative, ...]] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, separator, values = item.partition("=")
            name = name.strip().replace("-", "_")
            if not separator or not values.strip():
                raise ConfigError(f"{item!r} names no values: write {name}=* for any value, or {name}=a|b or {name}=low..high")
            if name not in names:
                raise ConfigError(f"{name!r} is not an eviction option; valid: {', '.join(names)}")
            rules[name] = tuple(Alternative.parse(name, value.strip()) for value in values.split("|"))
        if not rules:
            raise ConfigError(f"the allow-list {spec!r} allows nothing; use '{ALLOW_ALL}' or name=values items")
        return cls(rules, spec)

    def check_names(self, given: Iterable[str]) -> None:
        """Raises ``RequestOptionsRefused`` unless every option a request ``given`` has a rule. Runs before
        the options are parsed: parsing reads the server's files (``learned_weights``)."""
        if self.rules is None:
            return
        for name in given:
            if name not in self.rules:
                raise RequestOptionsRefused(
                    f"option {name!r} may not be chosen by a request (the server allows: {', '.join(self.rules)})"
                )

    def check_values(self, config: EvictionConfig) -> None:
        """Raises ``RequestOptionsRefused`` unless every ruled field of the resolved ``config`` (the
        request's choices and the defaults they imply) is accepted."""
        values = config.option_values()
        for name, alternatives in (self.rules or {}).items():
            value = values.get(name)
            if value is None:  # a policy without a budget, or an option this policy does not take
                continue
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            if not any(alternative.accepts(text) for alternative in alternatives):
                accepted = "|".join(alternative.text for alternative in alternatives)
                raise RequestOptionsRefused(
                    f"{name} {text} (policy {config.policy}) is not among the values a request may choose ({accepted})"
                )


def options_text(extra_key: Optional[str]) -> Optional[str]:
    """The option string of an ``extra_key`` that names eviction options, else None."""
    if not extra_key or not extra_key.startswith(REQUEST_OPTIONS_PREFIX):
        return None
    return extra_key[len(REQUEST_OPTIONS_PREFIX) :]


def request_config(text: str, allow: AllowList) -> EvictionConfig:
    """The config ``text`` (``policy=snapkv,budget=0.5``) asks for, if ``allow`` permits it; else raises
    ``RequestOptionsRefused`` saying why."""
    try:
        return _allowed_config(text, allow)
    except ConfigError as error:  # RequestOptionsRefused included
        raise RequestOptionsRefused(f"eviction options {text[:MAX_OPTIONS_LENGTH]!r} refused: {error}") from None


def _allowed_config(text: str, allow: AllowList) -> EvictionConfig:
    if len(text) > MAX_OPTIONS_LENGTH:
        raise ConfigError(f"{len(text)} characters, at most {MAX_OPTIONS_LENGTH}")
    items = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(item) != 2 for item in items):
        raise ConfigError("write name=value items separated by commas")
    options = {name.strip().replace("-", "_"): value for name, value in items}
    allow.check_names(options)
    config = EvictionConfig.from_strings(options)
    allow.check_values(config)
    return config


def check_extra_keys(value, allow: Optional[AllowList]) -> None:
    """The HTTP-side check of a request's ``extra_key`` field (a string, a list of them for a batch, or
    None); ``allow``: None when the server takes no per-request options. Raises ``RequestOptionsRefused``."""
    for extra_key in value if isinstance(value, list) else [value]:
        text = options_text(extra_key) if isinstance(extra_key, str) else None
        if text is None:
            continue
        if allow is None:
            raise RequestOptionsRefused(
                f"extra_key {extra_key[:64]!r}: this server takes no per-request eviction options "
                "(it was started without --kv-evict-per-request)"
            )
        request_config(text, allow)


Setup = TypeVar("Setup")


class RequestSetups(Generic[Setup]):
    """The setups built for accepted option strings, at most ``capacity`` of them, least recently used
    dropped first. A dropped setup stays alive for the requests that hold it."""

    def __init__(self, allow: AllowList, build: Callable[[EvictionConfig], Setup], capacity: int = SETUP_CACHE_SIZE):
        if capacity < 1:
            raise ValueError(f"capacity {capacity} must be at least 1")
        self.allow = allow
        self._build = build
        self._capacity = capacity
        self._setups: "OrderedDict[str, Setup]" = OrderedDict()
        self.built = 0

    def get(self, text: str) -> Setup:
        """The setup of option string ``text``; raises ``RequestOptionsRefused`` (nothing is cached then)."""
        if text in self._setups:
            self._setups.move_to_end(text)
            return self._setups[text]
        config = request_config(text, self.allow)
        try:
            setup = self._build(config)
        except ConfigError as error:  # the setup binds the config to the served model (learned weights)
            raise RequestOptionsRefused(f"eviction options {text!r} refused: {error}") from None
        self.built += 1
        self._setups[text] = setup
        if len(self._setups) > self._capacity:
            self._setups.popitem(last=False)
        return setup

    @staticmethod
    def counters(setups: Optional["RequestSetups"]) -> dict[str, int]:
        """For ``/kvevict/stats``: setups cached now and built since start (zeros without per-request options)."""
        if setups is None:
            return {"request_setups_cached": 0, "request_setups_built": 0}
        return {"request_setups_cached": len(setups._setups), "request_setups_built": setups.built}
