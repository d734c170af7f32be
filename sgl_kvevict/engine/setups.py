"""Which eviction configuration serves a request: the server's, or with ``--kv-evict-per-request`` its own
(bounded by ``sgl_kvevict.request_options``).

Pure Python over the policy code: nothing here imports SGLang.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.local_layers import LocalLayers, WindowedLocalLayers
from sgl_kvevict.policies.base import Policy
from sgl_kvevict.request_options import AllowList, RequestOptionsRefused, RequestSetups, options_text
from sgl_kvevict.scoring.window import StatsRequest

logger = logging.getLogger(__name__)


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
    def of(
        cls, config: EvictionConfig, model_dir: Optional[Path] = None, heads: Optional[tuple[int, ...]] = None,
        local_layers: Optional[LocalLayers] = None,
    ) -> "EvictionSetup":  # fmt: skip
        """``model_dir``: the served model, for policies bound to it (a learned scorer's weights);
        ``heads``: the model's KV heads this tensor-parallel rank holds (None: all of them); ``local_layers``:
        its local attention layers in the served scope (Gemma 3), which keep what their window can still
        read, whatever the policy."""
        policy = build_policy(config)
        if model_dir is not None:
            policy = WindowedLocalLayers.wrap(policy.for_model(model_dir), local_layers)
        if heads is not None:
            policy = policy.for_heads(heads)
        return cls(config, policy, policy.stats_request())


class Setups:
    """The server's setup and, with ``request_allow``, the setups requests name in SGLang's ``extra_key``
    field, ``"kvevict:policy=snapkv,budget=0.5"`` (the ``--kv-evict-*`` option names) within that
    allow-list: A/B experiments and the parity tests serve several policies from one server. SGLang
    keeps requests with different extra keys in separate subtrees, so a node compressed by one setup is
    never reused by another. The HTTP process refuses disallowed options first (HTTP 400); here a
    refused request stays dense and is counted once in ``request_option_errors``."""

    def __init__(
        self,
        default: EvictionSetup,
        request_allow: Optional[AllowList] = None,
        model_dir: Optional[Path] = None,
        heads: Optional[tuple[int, ...]] = None,
        local_layers: Optional[LocalLayers] = None,
    ):
        self.default = default
        self.refused = 0
        self._requests = None
        if request_allow is not None:
            build = lambda config: EvictionSetup.of(config, model_dir, heads, local_layers)  # noqa: E731
            self._requests = RequestSetups(request_allow, build)

    def for_request(self, extra_key: Optional[str]) -> Optional[EvictionSetup]:
        """The setup of a request with this ``extra_key`` (None when its options are refused)."""
        text = options_text(extra_key)
        if text is None or self._requests is None:
            return self.default
        try:
            return self._requests.get(text)
        except RequestOptionsRefused as error:
            logger.warning("sgl-kvevict: %s; the request stays dense", error)
            self.refused += 1
            return None

    def counters(self) -> dict[str, int]:
        """For ``/kvevict/stats``: per-request setups cached now and built since start, requests refused."""
        return {**RequestSetups.counters(self._requests), "request_option_errors": self.refused}
