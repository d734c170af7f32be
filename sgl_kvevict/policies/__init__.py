"""Eviction policies: importing this package registers every built-in policy.

A new method is one module here that subclasses ``Policy`` (or ``ScoredPolicy`` for score-based
methods) with ``@register_policy("name")``, plus one import line below.
"""

from sgl_kvevict.policies.base import (
    Policy,
    PolicyDefaults,
    SegmentCompressor,
    SegmentSpec,
    get_policy_class,
    register_policy,
    registered_policies,
)
from sgl_kvevict.policies.scored import ScoredPolicy
from sgl_kvevict.policies import (  # noqa: F401  (registration)
    adakv,
    dbudget,
    full,
    h2o,
    lava,
    pyramidkv,
    snapkv,
    streaming,
    topk,
    tova,
)

__all__ = [
    "Policy",
    "PolicyDefaults",
    "SegmentCompressor",
    "ScoredPolicy",
    "SegmentSpec",
    "get_policy_class",
    "register_policy",
    "registered_policies",
]
