"""The policy contract and registry.

Compression of one segment runs in two phases because layer budgets (LAVa, PyramidKV) need every
layer's statistics before any layer is cut:

1. per layer, during the engine's forward: ``compressor.observe(layer, stats)`` reduces the
   ``WindowStats`` to a compact per-layer record (candidate scores ``[H_kv, n]`` in fp32, LAVa
   entropy, DBudgetKV stop index, ...). Hidden-state statistics (learned scores) may come in
   several calls per layer, one per prefill forward of a chunked prefill, each with the next rows of
   the segment in order (``scoring.base.RowScorer``);
2. once, after the last layer: ``compressor.plan()`` returns the ``CompressionPlan``.

A ``Policy`` is immutable configuration plus a factory of per-segment compressors, so one policy
object serves every concurrent request of an engine. A new method is one module that subclasses
``Policy`` and decorates it with ``@register_policy("name")``; its own knobs, if any, are a
``Settings`` dataclass in that module named by ``knobs_type`` (the config, the flags and ``--help``
find them there).

A policy is built from narrow settings, never from the config (``sgl_kvevict.config``, which imports
this package): ``common`` (``CommonSettings``, resolved), ``knobs`` (an instance of its
``knobs_type``) and ``score_knobs`` (those of its score's scorer, ``Scorer.knobs_type``).
"""

from __future__ import annotations

import abc
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Optional, TypeVar

import torch

from sgl_kvevict.settings import CommonSettings, Settings
from sgl_kvevict.plan import CompressionPlan
from sgl_kvevict.scoring.window import StatsRequest, WindowStats


@dataclass(frozen=True)
class PolicyDefaults:
    """What a policy class declares about the common knobs; the config resolves ``None`` ones from it.

    window: observation window (queries that score, tokens always kept).
    pooling: smoothing of candidate scores along positions.
    gqa: reduction of query-head scores onto their KV head for the ``attn`` score (OBCache scores
        always default to ``sum``, the GQA-aware objective of OBCache Eq. 33-35).
    scores: the ``score`` values the policy accepts; the first is its default.
    takes_budget: False for policies that keep everything or decide their own budget.
    """

    window: int = 32
    pooling: str = "max"
    gqa: str = "mean"
    scores: tuple[str, ...] = ("attn",)
    takes_budget: bool = True


@dataclass(frozen=True)
class SegmentSpec:
    """Shape of one compression job: the segment ``[start, end)`` of a context of ``end`` tokens."""

    start: int
    end: int
    num_layers: int
    num_kv_heads: int
    num_q_heads: int

    @property
    def length(self) -> int:
        return self.end - self.start


class SegmentCompressor(abc.ABC):
    """Per-segment state of a policy between ``observe`` calls.

    ``needs_stats`` is False when ``plan()`` does not depend on any statistics (the segment is kept
    whole, or the policy is position-based): engines may then skip computing ``WindowStats`` and
    ``observe`` altogether.
    """

    needs_stats: bool = True

    def __init__(self, spec: SegmentSpec):
        self.spec = spec

    @abc.abstractmethod
    def observe(self, layer: int, stats: WindowStats) -> None:
        """Reduce one layer's statistics; must not keep ``stats`` tensors larger than ``[H_kv, L]``."""

    def observes(self, layer: int) -> bool:
        """Whether ``observe`` reads ``layer``'s statistics: engines compute none for a layer it does not
        (a model's local layers, which keep their window whatever the policy: ``local_layers``)."""
        return True

    @abc.abstractmethod
    def plan(self) -> CompressionPlan:
        """Decide kept positions for every (layer, KV head); called once after the last layer."""

    def shared_state(self) -> Optional[torch.Tensor]:
        """For engines whose ranks each hold some KV heads (tensor parallelism): the per-(layer, KV head)
        state that ``plan`` weighs across heads, fp32 ``[L, H_kv, m]``, called once after the last layer.
        The engine gathers every rank's and calls ``plan_shared`` (``sgl_kvevict.sharding``). None: each
        head's kept positions depend on its own statistics only, so every rank plans its heads alone."""
        return None

    def plan_shared(self, state: torch.Tensor) -> CompressionPlan:
        """The plan of every KV head of the model from every rank's ``shared_state``, ``[L, H_all, m]`` in
        global head order (``H_all`` need not be ``spec.num_kv_heads``: that is this rank's count)."""
        raise NotImplementedError(f"{type(self).__name__} shares no state")


class Policy(abc.ABC):
    name: ClassVar[str]
    # Paper defaults the config resolves unset common knobs from (window, pooling, GQA, valid scores).
    defaults: ClassVar[PolicyDefaults] = PolicyDefaults()
    # The policy's own knobs (a frozen ``Settings`` dataclass); ``Settings`` itself: none. Two
    # policies sharing a knob share the class that declares it (a base of both knobs types).
    knobs_type: ClassVar[type[Settings]] = Settings

    def __init__(self, common: CommonSettings, knobs: Settings = Settings(), score_knobs: Settings = Settings()):
        self.common = common
        self.knobs = knobs
        self.score_knobs = score_knobs

    @classmethod
    def validate_settings(cls, common: CommonSettings, knobs: Settings) -> None:
        """Raise ``ConfigError`` for a combination of knobs this policy cannot honour (called by the
        config, after each value passed its own check)."""

    @abc.abstractmethod
    def stats_request(self) -> StatsRequest:
        """The window statistics ``observe`` needs (engines compute nothing else)."""

    @abc.abstractmethod
    def start(self, spec: SegmentSpec) -> SegmentCompressor:
        """A fresh compressor for one segment."""

    def for_model(self, model_dir: Path) -> "Policy":
        """This policy with what it needs from the served model loaded and checked (the learned
        scorer's weights, found by the fingerprint of ``model_dir``, the model's HF folder); ``self``
        when it needs nothing. Engines call it once with their model; it raises ``ConfigError``."""
        return self

    def for_heads(self, heads: tuple[int, ...]) -> "Policy":
        """This policy on a rank that holds the model's KV heads ``heads`` (``sharding.PADDING``: a padded
        head) and sees only their statistics (tensor parallelism); ``self`` when its statistics already
        come per rank (window statistics do: a rank computes its own heads')."""
        return self

    def for_layers(self, layers: tuple[int, ...]) -> "Policy":
        """This policy on compressors that see only the model's layers ``layers`` (ascending), renumbered
        ``0..`` in that order (their ``SegmentSpec.num_layers`` is ``len(layers)``): a model whose other layers
        keep a share of their own, whatever the policy (``local_layers``), so that the budget and the layer
        allocators are the global layers' alone. Knobs naming layers name those of them in ``layers``,
        renumbered; ``self`` when nothing changes."""
        knobs, score_knobs = self.knobs.on_layers(layers), self.score_knobs.on_layers(layers)
        if knobs == self.knobs and score_knobs == self.score_knobs:
            return self
        bound = copy.copy(self)
        bound.knobs, bound.score_knobs = knobs, score_knobs
        return bound


_P = TypeVar("_P", bound=type[Policy])
_POLICY_REGISTRY: dict[str, type[Policy]] = {}


def register_policy(name: str) -> Callable[[_P], _P]:
    def decorator(cls: _P) -> _P:
        if name in _POLICY_REGISTRY:
            raise ValueError(f"policy {name!r} is already registered by {_POLICY_REGISTRY[name].__qualname__}")
        cls.name = name
        _POLICY_REGISTRY[name] = cls
        return cls

    return decorator


def registered_policies() -> list[str]:
    return sorted(_POLICY_REGISTRY)


def get_policy_class(name: str) -> type[Policy]:
    try:
        return _POLICY_REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; registered: {', '.join(registered_policies())}") from None
