"""EvictionConfig: budget parsing, per-policy paper defaults, string construction, and one clear
ConfigError per mistake."""

from __future__ import annotations

import pytest

from sgl_kvevict.config import EvictionConfig, build_policy
from sgl_kvevict.settings import Budget, ConfigError, RatioBudget, TokenBudget
from sgl_kvevict.policies import get_policy_class, registered_policies

BUILT_IN = {
    "full", "streaming", "h2o", "tova", "snapkv", "pyramidkv", "ada-snapkv", "ada-pyramidkv", "lava", "dbudget", "topk",
}  # fmt: skip
OBC_POLICIES = {"h2o", "tova", "snapkv", "ada-snapkv", "ada-pyramidkv", "topk"}
# Policies that take the question-agnostic scores (kvzip, learned): every allocator defined apart
# from the window's queries (not h2o, tova), and KVzip's own global top-k.
QUESTION_AGNOSTIC_POLICIES = {"snapkv", "pyramidkv", "ada-snapkv", "ada-pyramidkv", "lava", "topk"}
BUDGETLESS = {"full", "dbudget"}


def test_every_built_in_policy_is_registered():
    assert BUILT_IN <= set(registered_policies())


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0.25", RatioBudget(0.25)),
        (" 0.5 ", RatioBudget(0.5)),
        ("25%", RatioBudget(0.25)),
        (0.1, RatioBudget(0.1)),
        ("128t", TokenBudget(128)),
        ("64T", TokenBudget(64)),
    ],
)
def test_budget_parse(text, expected):
    assert Budget.parse(text) == expected


def test_budget_per_head_counts_the_window_and_rounds_to_nearest():
    assert RatioBudget(0.25).per_head(1000) == 250
    assert RatioBudget(0.25).per_head(10) == 3  # 2.5 rounds half up
    assert RatioBudget(0.3).per_head(11) == 3  # 3.3
    assert TokenBudget(128).per_head(10) == 128
    assert str(RatioBudget(0.25)) == "0.25" and str(TokenBudget(128)) == "128t"


@pytest.mark.parametrize("policy", sorted(BUILT_IN))
def test_every_policy_builds_with_its_defaults(policy):
    config = EvictionConfig.for_policy(policy)
    built = build_policy(config)
    assert isinstance(built, get_policy_class(policy)) and built.name == policy
    assert (config.budget is None) == (policy in BUDGETLESS)
    assert config.window >= 1 and config.pooling and config.gqa


@pytest.mark.parametrize(
    "policy, window, pooling, gqa",
    [
        ("snapkv", 32, "max", "mean"),
        ("pyramidkv", 32, "max", "mean"),
        ("ada-snapkv", 32, "max", "mean"),
        ("ada-pyramidkv", 32, "max", "mean"),
        ("lava", 32, "max", "max"),
        ("h2o", 32, "none", "mean"),
        ("tova", 1, "none", "mean"),
        ("dbudget", 1, "none", "mean"),
        ("topk", 32, "none", "max"),  # its default score is kvzip, which brings GQA max and no pooling
    ],
)
def test_paper_defaults(policy, window, pooling, gqa):
    config = EvictionConfig.for_policy(policy)
    assert (config.window, config.pooling, config.gqa, config.pooling_kernel) == (window, pooling, gqa, 7)


def test_global_paper_defaults():
    config = EvictionConfig()
    assert config.policy == "snapkv" and config.budget == RatioBudget(0.25) and config.score == "attn"
    assert config.sink_tokens == 4
    # A method's own knobs, on the policies (and score) that take them.
    ada_pyramid = EvictionConfig.for_policy("ada-pyramidkv")
    assert ada_pyramid.alpha == 0.2 and ada_pyramid.pyramid_beta == 20
    dbudget = EvictionConfig.for_policy("dbudget")
    assert (dbudget.dbudget_threshold, dbudget.dbudget_query_rows) == (0.01, 1)
    assert dbudget.dbudget_frozen_layers == (0, 1)
    assert EvictionConfig.for_policy("topk", score="learned").learned_weights is None


@pytest.mark.parametrize("policy", sorted(BUILT_IN))
def test_each_policy_defaults_to_its_first_score(policy):
    expected = "kvzip" if policy == "topk" else "attn"
    assert EvictionConfig.for_policy(policy).score == expected


@pytest.mark.parametrize("policy", sorted(BUILT_IN - {"full", "dbudget", "streaming"}))
@pytest.mark.parametrize("score", ["kvzip", "learned"])
def test_question_agnostic_scores_apply_to_allocator_policies_only(policy, score):
    if policy in QUESTION_AGNOSTIC_POLICIES:
        config = EvictionConfig.for_policy(policy, score=score)
        assert config.score == score and config.pooling == "none"
        assert config.gqa == ("max" if score == "kvzip" else get_policy_class(policy).defaults.gqa)
    else:
        with pytest.raises(ConfigError, match=f"score '{score}' does not apply to policy '{policy}'"):
            EvictionConfig.for_policy(policy, score=score)


@pytest.mark.parametrize("policy", sorted(OBC_POLICIES - {"tova"}))
@pytest.mark.parametrize("score", ["obc-value", "obc-key", "obc-joint"])
def test_obcache_scores_default_to_gqa_sum(policy, score):
    assert EvictionConfig.for_policy(policy, score=score).gqa == "sum"
    assert EvictionConfig.for_policy(policy, score=score, gqa="max").gqa == "max"


def test_explicit_values_override_policy_defaults():
    config = EvictionConfig.for_policy("lava", budget="128t", window=16, pooling="avg", gqa="mean", pooling_kernel=5)
    assert (config.budget, config.window, config.pooling, config.gqa, config.pooling_kernel) == (
        TokenBudget(128),
        16,
        "avg",
        "mean",
        5,
    )


def test_from_strings_matches_typed_construction():
    flags = {
        "policy": "ada-pyramidkv",
        "budget": "0.2",
        "window": "16",
        "score": "obc-key",
        "alpha": "0.5",
        "pyramid-beta": "10",
        "pooling_kernel": "5",
        "gqa": None,  # flag not given
    }
    assert EvictionConfig.from_strings(flags) == EvictionConfig(
        policy="ada-pyramidkv", budget=RatioBudget(0.2), window=16, score="obc-key", alpha=0.5, pyramid_beta=10,
        pooling_kernel=5,
    )
    dbudget = EvictionConfig.from_strings({"policy": "dbudget", "dbudget_frozen_layers": "0, 1,2"})
    assert dbudget.dbudget_frozen_layers == (0, 1, 2)


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ConfigError) as error:
        EvictionConfig(policy="snapkvv")
    message = str(error.value)
    assert "'snapkvv'" in message and all(name in message for name in registered_policies())


# (constructor kwargs, a fragment the message must contain). Each row is one distinct mistake.
MISTAKES = [
    (dict(budget="0"), "budget '0' is neither a ratio"),
    (dict(budget="0.0"), "budget ratio 0.0 must be in (0, 1)"),
    (dict(budget="-0.5"), "budget ratio -0.5 must be in (0, 1)"),
    (dict(budget="1.0"), "budget ratio 1.0 must be in (0, 1)"),
    (dict(budget="150%"), "budget ratio 1.5 must be in (0, 1)"),
    (dict(budget="0t"), "budget '0t' must keep at least one token"),
    (dict(budget="128"), "budget '128' is neither a ratio"),
    (dict(budget="lots"), "budget 'lots' is neither a ratio"),
    (dict(budget=128), "budget 128 must be a ratio such as 0.25"),
    (dict(policy="full", budget="0.5"), "policy 'full' takes no budget"),
    (dict(policy="dbudget", budget="128t"), "policy 'dbudget' takes no budget"),
    (dict(window=0), "window 0 must be an integer >= 1"),
    (dict(window=-4), "window -4 must be an integer >= 1"),
    (dict(pooling="min"), "pooling 'min' is not one of max, avg, none"),
    (dict(pooling_kernel=6), "pooling kernel 6 must be an odd integer >= 1"),
    (dict(pooling_kernel=0), "pooling kernel 0 must be an odd integer >= 1"),
    (dict(gqa="median"), "gqa reduction 'median' is not one of mean, max, sum"),
    (dict(score="obc"), "score 'obc' is not one of attn, obc-value, obc-key, obc-joint, kvzip, learned"),
    (dict(policy="lava", score="obc-value"), "score 'obc-value' does not apply to policy 'lava' (valid: attn, kvzip, learned)"),
    (dict(policy="h2o", score="kvzip"), "score 'kvzip' does not apply to policy 'h2o'"),
    (
        dict(policy="snapkv", learned_weights="weights.safetensors"),
        "learned weights 'weights.safetensors' does not apply to policy 'snapkv' with score 'attn' (it applies to score learned)",
    ),
    (dict(policy="topk", score="learned", learned_weights="/nonexistent.safetensors"), "learned weights '/nonexistent.safetensors' does not exist"),
    (dict(policy="pyramidkv", score="obc-key"), "score 'obc-key' does not apply to policy 'pyramidkv'"),
    (dict(policy="tova", score="obc-joint", window=8), "use window 1 with tova (got 8)"),
    (dict(policy="ada-snapkv", alpha=-0.1), "alpha -0.1 must be in [0, 1]"),
    (dict(policy="lava", alpha=1.5), "alpha 1.5 must be in [0, 1]"),
    (dict(policy="pyramidkv", pyramid_beta=0), "pyramid beta 0 must be an integer >= 1"),
    (dict(policy="dbudget", dbudget_threshold=0.0), "dbudget threshold 0.0 must be in (0, 1)"),
    (dict(policy="dbudget", dbudget_threshold=1.0), "dbudget threshold 1.0 must be in (0, 1)"),
    (dict(policy="dbudget", dbudget_query_rows=0), "dbudget query rows 0 must be an integer >= 1"),
    (dict(policy="dbudget", dbudget_query_rows=4), "dbudget query rows (4) must not exceed the window (1)"),
    (dict(sink_tokens=-1), "sink tokens -1 must be an integer >= 0"),
    (dict(policy="dbudget", dbudget_frozen_layers=(0, -1)), "dbudget frozen layers (0, -1) must be layer indices >= 0"),
    (dict(min_segment_length=-1), "min segment length -1 must be >= 0"),
    (dict(policy="topk", whole_layers=[2, -1]), "whole layers (2, -1) must be layer indices >= 0"),  # a list, as code may give
    (dict(policy="topk", layer_floor=1.5), "layer floor 1.5 must be in [0, 1]"),
    (dict(policy="lava", whole_layers=(0,)), "whole layers (0,) does not apply to policy 'lava'"),
    # A method's knob given to a policy that does not take it is refused, like a budget to full.
    (
        dict(policy="snapkv", alpha=0.3),
        "alpha 0.3 does not apply to policy 'snapkv' with score 'attn' (it applies to policies ada-pyramidkv, ada-snapkv, lava)",
    ),
    (dict(policy="ada-snapkv", pyramid_beta=10), "pyramid beta 10 does not apply to policy 'ada-snapkv'"),
    (dict(policy="lava", dbudget_threshold=0.02), "dbudget threshold 0.02 does not apply to policy 'lava' with score 'attn' (it applies to policy dbudget)"),
    (dict(windw=8), "unknown eviction option 'windw'; valid: policy, budget, window"),
]


@pytest.mark.parametrize("kwargs, fragment", MISTAKES, ids=[fragment for _, fragment in MISTAKES])
def test_each_mistake_raises_one_clear_config_error(kwargs, fragment):
    with pytest.raises(ConfigError) as error:
        EvictionConfig(**kwargs)
    assert isinstance(error.value, ValueError)
    assert fragment in str(error.value)


def test_mistake_messages_are_distinct():
    messages = []
    for kwargs, _ in MISTAKES:
        with pytest.raises(ConfigError) as error:
            EvictionConfig(**kwargs)
        messages.append(str(error.value))
    assert len(set(messages)) == len(messages)


@pytest.mark.parametrize(
    "flags, fragment",
    [
        ({"polcy": "lava"}, "unknown eviction option 'polcy'"),
        ({"window": "thirty"}, "window 'thirty' must be an integer"),
        ({"alpha": "high"}, "alpha 'high' must be a number"),
        ({"dbudget_frozen_layers": "0;1"}, "dbudget frozen layers '0;1' must be comma-separated integers"),
    ],
)
def test_from_strings_mistakes(flags, fragment):
    with pytest.raises(ConfigError) as error:
        EvictionConfig.from_strings(flags)
    assert fragment in str(error.value)


def test_config_is_frozen_and_describes_itself():
    config = EvictionConfig.for_policy("lava", budget="128t")
    with pytest.raises(AttributeError):
        config.window = 8
    assert config.describe() == "policy=lava budget=128t window=32 score=attn gqa=max pooling=max"
