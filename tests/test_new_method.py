"""Adding a method with a knob of its own is one module: the policy class and its knobs' settings
dataclass, nothing else. A throwaway policy registered in-process (the registry is restored after
each test) gets its knob parsed from strings, checked with a one-line ConfigError, refused for other
policies, delivered to its compressors, and a ``--kv-evict-<knob>`` flag in ``--help`` and the
flag table of docs/flags.md."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conftest_policies import run_policy
from sgl_kvevict.config import EvictionConfig, build_policy, eviction_options
from sgl_kvevict.policies import Policy, PolicyDefaults, SegmentCompressor, SegmentSpec, base, register_policy
from sgl_kvevict.policies.adakv import HeadFloorKnobs
from sgl_kvevict.policies.layout import SegmentLayout
from sgl_kvevict.scoring import StatsRequest, WindowStats
from sgl_kvevict.server import flags_table
from sgl_kvevict.server.flags import build_parser, parse_args
from sgl_kvevict.settings import ConfigError, Settings, setting


@pytest.fixture
def registry(monkeypatch):
    """The policy registry, restored after the test."""
    monkeypatch.setattr(base, "_POLICY_REGISTRY", dict(base._POLICY_REGISTRY))


def register_keep_every() -> type[Policy]:
    """What the new module would hold: keep every ``stride``-th candidate (plus sinks and window)."""

    @dataclass(frozen=True)
    class KeepEveryKnobs(Settings):
        stride: int = setting(
            2,
            help="keep every STRIDE-th candidate",
            valid=(lambda stride: isinstance(stride, int) and stride >= 1, "stride {value!r} must be an integer >= 1"),
        )

    class KeepEvery(SegmentCompressor):
        needs_stats = False

        def __init__(self, layout: SegmentLayout, stride: int):
            super().__init__(layout.spec)
            self.layout, self.stride = layout, stride

        def observe(self, layer: int, stats: WindowStats) -> None:
            pass

        def plan(self):
            kept = torch.arange(0, self.layout.num_candidates, self.stride)
            layer = self.layout.layer_plan([kept] * self.spec.num_kv_heads)
            return self.layout.plan([layer] * self.spec.num_layers)

    @register_policy("keep-every")
    class KeepEveryPolicy(Policy):
        defaults = PolicyDefaults(window=4, takes_budget=False)
        knobs_type = KeepEveryKnobs

        def stats_request(self) -> StatsRequest:
            return StatsRequest()

        def start(self, spec: SegmentSpec) -> SegmentCompressor:
            return KeepEvery(SegmentLayout.of(spec, self.common), self.knobs.stride)

    return KeepEveryPolicy


def test_a_new_policys_knob_is_parsed_checked_and_reaches_its_compressors(registry):
    policy_class = register_keep_every()
    config = EvictionConfig.from_strings({"policy": "keep-every", "stride": "3"})
    assert config.knobs == policy_class.knobs_type(stride=3) and config.stride == 3
    assert isinstance(build_policy(config), policy_class)
    # Positions 0-3 are sinks, 16-19 the window; candidates 4..15, every third kept.
    plan = run_policy(config, SegmentSpec(0, 20, num_layers=2, num_kv_heads=2, num_q_heads=2))
    assert plan.layers[1].head_positions(1).tolist() == [0, 1, 2, 3, 4, 7, 10, 13, 16, 17, 18, 19]
    assert EvictionConfig.for_policy("keep-every").stride == 2

    for values, message in [
        ({"stride": "0"}, "stride 0 must be an integer >= 1"),
        ({"stride": "every"}, "stride 'every' must be an integer"),
    ]:
        with pytest.raises(ConfigError) as error:
            EvictionConfig.from_strings({"policy": "keep-every", **values})
        assert str(error.value) == message
    with pytest.raises(ConfigError, match=r"^stride 3 does not apply to policy 'snapkv' with score 'attn' \(it applies to policy keep-every\)$"):
        EvictionConfig.from_strings({"policy": "snapkv", "stride": "3"})


def test_a_new_policys_knob_gets_a_flag_in_help_and_the_flags_table(registry):
    register_keep_every()
    help_text = " ".join(build_parser().format_help().split())
    assert "--kv-evict-stride VALUE keep every STRIDE-th candidate; applies to policy keep-every (default 2)" in help_text
    assert "| `--kv-evict-stride VALUE` | 2 | keep every STRIDE-th candidate; applies to policy keep-every |" in flags_table.render()
    serving = parse_args(["--model", "m", "--kv-evict-policy", "keep-every", "--kv-evict-stride", "5"]).serving
    assert serving.eviction.stride == 5


def test_a_knob_two_methods_share_is_declared_once(registry):
    """A second declaration of ``alpha`` (another class, same name) is a programming error: a method
    that wants Ada-KV's floor takes ``HeadFloorKnobs`` instead."""

    @dataclass(frozen=True)
    class OwnAlpha(Settings):
        alpha: float = setting(0.5, help="another alpha")

    @register_policy("own-alpha")
    class OwnAlphaPolicy(Policy):
        knobs_type = OwnAlpha

    with pytest.raises(TypeError, match="knob 'alpha' of policy 'own-alpha' .* is also declared by HeadFloorKnobs"):
        eviction_options()

    @register_policy("shared-alpha")
    class SharedAlphaPolicy(Policy):
        knobs_type = HeadFloorKnobs

    del base._POLICY_REGISTRY["own-alpha"]
    assert "shared-alpha" in eviction_options()["alpha"].policies
