"""ServingConfig: what the launcher hands every SGLang process it starts.

SGLang's ``ServerArgs`` has no plugin fields and its processes are spawned, so the launcher passes
our settings in one environment variable (inherited by every spawned process) as JSON of the
validated option strings; each process rebuilds the typed objects from them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

from sgl_kvevict.config import EvictionConfig
from sgl_kvevict.engine.deferred import COMPRESS_WHEN, PREFILL, PRESSURE
from sgl_kvevict.request_options import DEFAULT_ALLOW, AllowList
from sgl_kvevict.scope import BlockScope, RequestScope, Scope
from sgl_kvevict.settings import ConfigError

ENV_VAR = "KVEVICT_SERVING"
NO_EVICTION = "none"
# The name our radix cache registers under (--radix-cache-backend), passed by the launcher.
RADIX_CACHE_BACKEND = "sgl_kvevict"


@dataclass(frozen=True)
class ServingConfig:
    """policy: a registered policy name or ``none`` (stock SGLang).
    eviction_options: the ``--kv-evict-<name>`` strings given besides the policy (option names as
        ``EvictionConfig.from_strings`` takes them, dashes allowed).
    per_request: requests may name their own eviction options in SGLang's ``extra_key`` request field
        (``"kvevict:policy=snapkv,budget=0.5"``; ``engine.setups.Setups``, bounded by ``sgl_kvevict.request_options``).
    request_allow: with ``per_request``, which options and values a request may choose (an
        ``AllowList`` spec; None: ``DEFAULT_ALLOW``).
    scope: which segments become compressed radix nodes (``sgl_kvevict.scope``). One scope per server:
        block scope does not also compress the tail after the last block in request scope. A block
        must hold more than the policy's window.
    compress_when: ``prefill`` stores a scored segment compressed right after its prefill; ``pressure``
        keeps it dense with its plan and compresses it only when SGLang needs the KV slots
        (``engine.deferred``).
    """

    policy: str = NO_EVICTION
    eviction_options: Mapping[str, str] = field(default_factory=dict)
    scope: Scope = RequestScope()
    per_request: bool = False
    request_allow: Optional[str] = None
    compress_when: str = PREFILL

    def __post_init__(self):
        if self.compress_when not in COMPRESS_WHEN:
            raise ConfigError(f"compress when {self.compress_when!r}: choose one of {', '.join(COMPRESS_WHEN)}")
        if self.policy == NO_EVICTION and self.eviction_options:
            raise ConfigError(
                f"eviction options {', '.join(sorted(self.eviction_options))} need a policy; "
                f"--kv-evict-policy is {NO_EVICTION!r}"
            )
        if self.request_allow is not None:
            if not self.per_request:
                raise ConfigError("an allow-list of request options needs per-request options (--kv-evict-per-request)")
            AllowList.parse(self.request_allow)  # refused now, in the process that parsed the flags
        eviction = self.eviction  # validates the options now, in the process that parsed them
        if eviction is not None and isinstance(self.scope, BlockScope):
            _check_blocks_compress(self.scope.block_size, eviction)

    @property
    def enabled(self) -> bool:
        return self.policy != NO_EVICTION

    @property
    def eviction(self) -> Optional[EvictionConfig]:
        if not self.enabled:
            return None
        return EvictionConfig.from_strings({"policy": self.policy, **self.eviction_options})

    @property
    def compresses_while_prefilling(self) -> bool:
        """Whether a prompt's blocks may be stored compressed before its prefill ends (admission's footprints):
        never under pressure, where they stay dense until SGLang needs their slots."""
        return self.enabled and self.compress_when == PREFILL

    @property
    def request_allow_list(self) -> Optional[AllowList]:
        """What a request may choose, or None when requests choose nothing."""
        if not (self.enabled and self.per_request):
            return None
        return AllowList.parse(DEFAULT_ALLOW if self.request_allow is None else self.request_allow)

    def describe(self) -> str:
        """One-line summary for logs: the policy, its budget and window."""
        if not self.enabled:
            return f"policy={NO_EVICTION}"
        when = "" if self.compress_when == PREFILL else f", compressed under {PRESSURE}"
        return f"{self.eviction.describe()}, {self.scope}{when}"

    def to_env(self) -> str:
        return json.dumps(
            {
                "policy": self.policy,
                "eviction_options": dict(self.eviction_options),
                "scope": self.scope.name,
                "block_size": getattr(self.scope, "block_size", None),
                "per_request": self.per_request,
                "request_allow": self.request_allow,
                "compress_when": self.compress_when,
            }
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "ServingConfig":
        """The config the launcher set, or stock SGLang when the variable is absent."""
        text = environ.get(ENV_VAR)
        if not text:
            return cls()
        values = json.loads(text)
        values["scope"] = Scope.parse(values.pop("scope"), values.pop("block_size"))
        return cls(**values)


def _check_blocks_compress(block_size: int, eviction: EvictionConfig) -> None:
    """A block keeps its window whole and its budget counts the window, so a block compresses only if
    its per-head budget exceeds the window; otherwise every block would silently stay dense
    (``SegmentLayout``: nothing left to select)."""
    window = eviction.window
    if block_size <= window:
        raise ConfigError(f"block size {block_size} must exceed the observation window ({window})")
    if eviction.budget is None or eviction.budget.per_head(block_size) > window:
        return
    kept = eviction.budget.per_head(block_size)
    larger = range(block_size + 1, 64 * block_size)
    smallest = next((size for size in larger if eviction.budget.per_head(size) > window), None)
    fix = f"use --kv-evict-block-size {smallest} or more" if smallest else "raise the budget"
    raise ConfigError(
        f"block size {block_size} at budget {eviction.budget} keeps {kept} entries per (layer, KV head), no more than "
        f"the {window}-token window every block keeps whole: no block would be compressed; {fix}"
    )
