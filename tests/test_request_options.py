"""Client-chosen eviction options, in-process: the allow-list, the refusals a client reads, the bounded
cache of setups, and the scheduler's safety net (``engine.setups.Setups``)."""

from __future__ import annotations

import pytest

from sgl_kvevict.config import EvictionConfig
from sgl_kvevict.engine.setups import EvictionSetup, Setups
from sgl_kvevict.request_options import (
    DEFAULT_ALLOW,
    MAX_OPTIONS_LENGTH,
    AllowList,
    RequestOptionsRefused,
    RequestSetups,
    check_extra_keys,
    options_text,
    request_config,
)
from sgl_kvevict.serving import ServingConfig
from sgl_kvevict.settings import ConfigError, RatioBudget

DEFAULT = AllowList.parse(DEFAULT_ALLOW)
ALL = AllowList.parse("all")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("policy=snapkv,budget=0.5", EvictionConfig(policy="snapkv", budget="0.5")),
        ("policy=lava,budget=64t,window=16", EvictionConfig(policy="lava", budget="64t", window=16)),
        ("policy=topk,score=learned", EvictionConfig(policy="topk", score="learned")),
        ("policy=dbudget", EvictionConfig(policy="dbudget")),  # no budget to check
        ("", EvictionConfig()),  # the defaults: snapkv at 0.25
    ],
)
def test_the_default_allow_list_accepts_cheap_choices(text, expected):
    assert request_config(text, DEFAULT) == expected


@pytest.mark.parametrize(
    "text, reason",
    [
        # topk ranks by KVzip's reconstruction pass unless told otherwise: checked on the resolved config.
        ("policy=topk", r"score kvzip \(policy topk\) is not among the values a request may choose \(attn\|learned"),
        ("policy=snapkv,score=kvzip", r"score kvzip \(policy snapkv\) is not among"),
        ("policy=snapkv,budget=0.99", r"budget 0.99 \(policy snapkv\) is not among .*0.05..0.95\|16t..4096t"),
        ("policy=snapkv,budget=8192t", r"budget 8192t .* is not among"),
        ("policy=snapkv,window=4096", r"window 4096 .* is not among .*1..64"),
        ("policy=snapkv,pooling-kernel=9", r"option 'pooling_kernel' may not be chosen by a request"),
        ("policy=snapkv,learned_weights=/etc/passwd", r"option 'learned_weights' may not be chosen"),
        ("policy=lava2", r"unknown policy 'lava2'"),
        ("policy=snapkv,budget=2", r"budget '2' is neither a ratio"),
        ("policy=snapkv,budget", r"write name=value items separated by commas"),
        ("policy=snapkv," + "x" * MAX_OPTIONS_LENGTH, rf"refused: {MAX_OPTIONS_LENGTH + 14} characters, at most {MAX_OPTIONS_LENGTH}"),
    ],
)
def test_refusals_say_why_in_one_line(text, reason):
    with pytest.raises(RequestOptionsRefused, match=reason) as refusal:
        request_config(text, DEFAULT)
    assert "\n" not in str(refusal.value)


def test_a_file_is_never_read_for_an_option_the_client_may_not_set(tmp_path):
    """The name is refused before the options are parsed, so the answer does not reveal whether a
    path exists on the server."""
    answers = set()
    for path in (tmp_path / "missing.safetensors", tmp_path):
        with pytest.raises(RequestOptionsRefused) as refusal:
            request_config(f"policy=snapkv,score=learned,learned_weights={path}", DEFAULT)
        answers.add(str(refusal.value).replace(str(path), "PATH"))
    assert len(answers) == 1 and "may not be chosen" in answers.pop()


def test_all_accepts_every_option_a_trusted_client_sets():
    config = request_config("policy=topk,window=128,pooling_kernel=9,sink_tokens=0", ALL)
    assert (config.score, config.window, config.pooling_kernel, config.sink_tokens) == ("kvzip", 128, 9, 0)


def test_an_operator_allow_list_narrows_policies_and_ranges():
    allow = AllowList.parse("policy=snapkv|lava, budget=0.2..0.5, sink-tokens=0..8")
    assert request_config("policy=lava,budget=0.5,sink_tokens=2", allow).sink_tokens == 2
    with pytest.raises(RequestOptionsRefused, match=r"policy streaming .* \(snapkv\|lava\)"):
        request_config("policy=streaming", allow)
    with pytest.raises(RequestOptionsRefused, match=r"budget 64t"):  # a token count is outside a ratio range
        request_config("policy=snapkv,budget=64t", allow)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "allows nothing"),
        ("budget", "names no values"),
        ("budgett=0.1..0.5", "'budgett' is not an eviction option"),
        ("policy=snapkvv", "policy=snapkvv names no policy"),
        ("score=kvzp", "score=kvzp names no score"),
        ("window=64..1", r"the range is empty \(64 > 1\)"),
        ("window=a..b", "a range is two numbers"),
    ],
)
def test_a_bad_allow_list_is_refused_at_start_up(spec, message):
    with pytest.raises(ConfigError, match=message):
        AllowList.parse(spec)


def test_the_serving_config_carries_the_allow_list_to_the_scheduler():
    serving = ServingConfig("snapkv", per_request=True, request_allow="policy=lava")
    travelled = ServingConfig.from_env({"KVEVICT_SERVING": serving.to_env()})
    assert travelled.request_allow_list == AllowList.parse("policy=lava")
    assert ServingConfig("snapkv", per_request=True).request_allow_list == DEFAULT
    assert ServingConfig("snapkv").request_allow_list is None
    with pytest.raises(ConfigError, match="needs per-request options"):
        ServingConfig("snapkv", request_allow="all")


def test_the_http_check_reads_single_and_batched_extra_keys():
    check_extra_keys(None, DEFAULT)
    check_extra_keys("tenant-7", None)  # an extra_key of the client's own (cache isolation) is not ours
    check_extra_keys(["kvevict:policy=lava", None, "tenant-7"], DEFAULT)
    with pytest.raises(RequestOptionsRefused, match="score kvzip"):
        check_extra_keys(["kvevict:policy=lava", "kvevict:policy=topk"], DEFAULT)
    with pytest.raises(RequestOptionsRefused, match="started without --kv-evict-per-request"):
        check_extra_keys("kvevict:policy=lava", None)
    assert options_text("kvevict:policy=lava") == "policy=lava" and options_text("tenant-7") is None


def test_the_cache_of_setups_is_bounded_and_least_recently_used_goes_first():
    built = []
    setups = RequestSetups(DEFAULT, lambda config: built.append(config) or config, capacity=3)
    for index in range(1000):  # a client varying one digit per request
        setups.get(f"policy=snapkv,budget=0.1{index:04d}")
    assert RequestSetups.counters(setups) == {"request_setups_cached": 3, "request_setups_built": 1000}
    setups.get("policy=snapkv,budget=0.10997")  # cached: reused, and now the most recent
    setups.get("policy=lava")  # evicts the least recently used, budget=0.10998
    setups.get("policy=snapkv,budget=0.10997")
    assert len(built) == 1001
    setups.get("policy=snapkv,budget=0.10998")
    assert len(built) == 1002
    assert built[-1].budget == RatioBudget(0.10998)


def test_a_refused_string_is_never_cached_and_a_setup_that_cannot_bind_is_refused():
    def build(config):
        if config.policy == "lava":
            raise ConfigError("no learned weights for this model")
        return config

    setups = RequestSetups(DEFAULT, build)
    for _ in range(3):
        with pytest.raises(RequestOptionsRefused):
            setups.get("policy=topk")
    with pytest.raises(RequestOptionsRefused, match="no learned weights for this model"):
        setups.get("policy=lava")
    assert RequestSetups.counters(setups) == {"request_setups_cached": 0, "request_setups_built": 0}


def test_the_scheduler_serves_accepted_options_and_leaves_refused_ones_dense():
    """``Setups.for_request`` (the scheduler's safety net) with the default allow-list: the server's setup
    without options, the request's own for accepted ones (built once while cached), None (dense) and
    one count of ``request_option_errors`` for refused ones."""
    setups = Setups(EvictionSetup.of(EvictionConfig()), DEFAULT)
    assert setups.for_request(None) is setups.default
    assert setups.for_request("tenant-7") is setups.default
    chosen = setups.for_request("kvevict:policy=lava,budget=0.5")
    assert chosen.config == EvictionConfig(policy="lava", budget="0.5") and chosen.policy.name == "lava"
    assert setups.for_request("kvevict:policy=lava,budget=0.5") is chosen
    assert setups.for_request("kvevict:policy=topk") is None
    assert setups.counters() == {"request_setups_cached": 1, "request_setups_built": 1, "request_option_errors": 1}
    # Without per-request options every request gets the server's setup, whatever its extra_key.
    assert Setups(setups.default).for_request("kvevict:policy=lava") is setups.default
