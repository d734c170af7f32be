"""Which eviction configuration serves a request: the server's, or with ``--kv-evict-per-request`` its own.

Pure Python over the policy code: nothing here imports SGLang.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.policies.base import Policy
from sgl_kvevict.scoring.window import StatsRequest
from sgl_kvevict.settings import ConfigError

logger = logging.getLogger(__name__)

# A request's ``extra_key`` that starts with this names its own eviction options (``per_request``).
REQUEST_OPTIONS_PREFIX = "kvevict:"


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_q_heads: int
    num_kv_heads: int


@dataclass(frozen=True)
class EvictionSetup:
    """One eviction configuration ready to serve: the config, its policy and the statistics it needs."""

    config: EvictionConfig
    policy: Policy
    stats_request: StatsRequest

    @classmethod
    def of(cls, config: EvictionConfig, model_dir: Optional[Path] = None) -> "EvictionSetup":
        """``model_dir``: the served model, for policies bound to it (a learned scorer's weights)."""
        policy = build_policy(config)
        if model_dir is not None:
            policy = policy.for_model(model_dir)
        return cls(config, policy, policy.stats_request())


class Setups:
    """The server's setup and, with ``per_request``, the setups requests name in SGLang's ``extra_key``
    field, ``"kvevict:policy=snapkv,budget=0.5"`` (the ``--kv-evict-*`` option names): A/B experiments
    and the parity tests serve several policies from one server. SGLang keeps requests with different
    extra keys in separate subtrees, so a node compressed by one setup is never reused by another.
    ``refused``: called once per request whose options are invalid (it stays dense)."""

    def __init__(
        self,
        default: EvictionSetup,
        per_request: bool = False,
        model_dir: Optional[Path] = None,
        refused: Callable[[], None] = lambda: None,
    ):
        self.default = default
        self.per_request = per_request
        self.model_dir = model_dir
        self._refused = refused
        self._by_options: dict[str, Optional[EvictionSetup]] = {}

    def for_request(self, extra_key: Optional[str]) -> Optional[EvictionSetup]:
        """The setup of a request with this ``extra_key`` (None when its options are invalid)."""
        if not (self.per_request and extra_key and extra_key.startswith(REQUEST_OPTIONS_PREFIX)):
            return self.default
        if extra_key not in self._by_options:
            self._by_options[extra_key] = self._parse(extra_key[len(REQUEST_OPTIONS_PREFIX) :])
        setup = self._by_options[extra_key]
        if setup is None:
            self._refused()
        return setup

    def _parse(self, text: str) -> Optional[EvictionSetup]:
        try:
            options = dict(item.split("=", 1) for item in text.split(",") if item)
            return EvictionSetup.of(EvictionConfig.from_strings(options), self.model_dir)
        except (ConfigError, ValueError) as error:
            logger.warning("sgl-kvevict: request eviction options %r refused (%s); the request stays dense", text, error)
            return None
