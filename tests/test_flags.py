"""Launcher flag parsing: validation, pass-through, CPU defaults, compression refusals, --help."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_kvevict.engine.stats_channel import ADDRESS_ENV_VAR as STATS_ADDRESS_ENV_VAR
from sgl_kvevict.config import EvictionConfig
from sgl_kvevict.policies import get_policy_class, registered_policies
from sgl_kvevict.scope import BlockScope
from sgl_kvevict.serving import ENV_VAR as SERVING_ENV_VAR, ServingConfig
from sgl_kvevict.settings import ConfigError
from sgl_kvevict.limits import limit_flags
from sgl_kvevict.server.flags import build_parser, knob_fields, knob_flag, parse_args
from sgl_kvevict.server.refusals import FlagError, check_environment, check_tensor_parallel, inspected_flags
from sgl_kvevict.server.sglang_args import (
    CPU_CHUNKED_PREFILL_SIZE,
    CPU_DEFAULT_MAX_TOTAL_TOKENS,
    CPU_POLICY_CHUNKED_PREFILL_SIZE,
    cpu_mode_args,
    flag_value,
    host_cpu_flags,
)
from sgl_kvevict.server.worker import THREADS_BIND_ENV_VAR, server_env, sglang_command, stats_socket_address, threads_bind


def parse(*args: str):
    return parse_args(["--model", "m", *args])


def test_unknown_flags_pass_through_to_sglang():
    config = parse("--max-running-requests", "4", "--log-level", "warning")
    assert config.sglang_args == ["--max-running-requests", "4", "--log-level", "warning"]
    assert (config.host, config.port, config.serving) == ("127.0.0.1", 30000, ServingConfig())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-evict-policy", "lava2"], "'lava2' is not a policy; valid: none, ada-pyramidkv"),
        (["--port", "70000"], "outside 1..65535"),
        (["--model-path", "x"], "--model-path is set by the launcher"),
        (["--startup-timeout", "0"], "must be positive"),
        (["--kv-evict-policy", "lava", "--kv-evict-window", "0"], "window 0 must be an integer >= 1"),
        (["--kv-evict-policy", "lava", "--kv-evict-budget", "2"], "budget '2' is neither a ratio"),
        (["--kv-evict-policy", "full", "--kv-evict-budget", "0.3"], "policy 'full' takes no budget"),
        (["--kv-evict-policy", "lava", "--kv-evict-score", "obc-key"], "does not apply to policy 'lava'"),
        (["--kv-evict-policy", "h2o", "--kv-evict-arena-fraction", "0.5"], "--kv-evict-arena-fraction is not a flag"),
        (["--kv-evict-policy", "lava", "--kv-evict-bugdet", "0.3"], "--kv-evict-bugdet is not a flag of ours"),
        (["--kv-evict-budget", "0.3", "--kv-evict-window", "8"], "--kv-evict-budget, --kv-evict-window: only with"),
        (["--kv-evict-scope", "block"], "--kv-evict-scope: only with a --kv-evict-policy"),
        (
            ["--kv-evict-policy", "lava", "--kv-evict-scope", "block", "--kv-evict-block-size", "128"],
            r"block size 128 at budget 0.25 keeps 32 entries .* no more than the 32-token window .* "
            r"use --kv-evict-block-size 130 or more",
        ),
        (
            ["--kv-evict-policy", "lava", "--kv-evict-scope", "block", "--kv-evict-budget", "32t"],
            r"block size 512 at budget 32t keeps 32 entries .* raise the budget",
        ),
        (["--kv-evict-policy", "snapkv", "--kv-evict-alpha", "0.3"], "alpha 0.3 does not apply to policy 'snapkv'"),
        (["--kv-evict-policy", "lava", "--kv-evict-default", "budgte=0.3"], "'budgte' is not an eviction option"),
        (["--kv-evict-default", "budgte=0.3"], "'budgte' is not an eviction option"),
        (["--kv-evict-policy", "lava", "--kv-evict-default", "budget"], "--kv-evict-default 'budget': expected NAME=VALUE"),
        (["--kv-evict-policy", "lava", "--kv-evict-default", "budget=2"], "budget '2' is neither a ratio"),
        (["--tp", "2"], "--tp abbreviates --tp-size; spell it in full"),
        (["--max-total=100"], "--max-total abbreviates --max-total-tokens"),
    ],
)
def test_bad_flags_have_one_clear_message(argv, message):
    with pytest.raises(FlagError, match=message) as error:
        parse(*argv)
    assert "\n" not in str(error.value)


def test_every_eviction_option_has_a_flag_reaching_the_serving_config(tmp_path):
    knobs = knob_fields()
    options = {option for action in build_parser()._actions for option in action.option_strings}
    assert {knob_flag(f.name) for f in knobs} <= options
    weights = tmp_path / "weights.safetensors"
    weights.touch()
    values = {"budget": "64t", "window": "8", "pooling": "avg", "pooling_kernel": "5", "gqa": "sum",
              "score": "learned", "learned_weights": str(weights), "alpha": "0.3", "pyramid_beta": "10", "dbudget_threshold": "0.02",
              "dbudget_query_rows": "2", "dbudget_frozen_layers": "0,3", "sink_tokens": "2",
              "min_segment_length": "16", "score_threshold": "-6.5", "layer_scale": "raw", "layer_floor": "0.5", "whole_layers": "0,2"}  # fmt: skip
    assert set(values) == {f.name for f in knobs}, "a new eviction option needs a value in this test"
    # A policy takes the common options and its own (its score's too): three policies take them all.
    dbudget_own = {"dbudget_threshold", "dbudget_query_rows", "dbudget_frozen_layers"}
    topk_own = ["layer_scale", "layer_floor", "whole_layers"]
    by_policy = {
        "ada-pyramidkv": {name: text for name, text in values.items() if name not in {*dbudget_own, *topk_own}},
        "dbudget": {name: values[name] for name in [*dbudget_own, "window", "sink_tokens", "min_segment_length"]},
        "topk": {name: values[name] for name in [*topk_own, "budget", "score", "learned_weights"]},
    }
    served = {}
    for policy, given in by_policy.items():
        args = [item for name, text in given.items() for item in (knob_flag(name), text)]
        config = parse("--kv-evict-policy", policy, *args)
        assert config.sglang_args == []
        assert dict(config.serving.eviction_options) == given
        served[policy] = config.serving.eviction
    ada_pyramid, dbudget = served["ada-pyramidkv"], served["dbudget"]
    assert (served["topk"].layer_scale, served["topk"].layer_floor, served["topk"].whole_layers) == ("raw", 0.5, (0, 2))
    assert (ada_pyramid.window, ada_pyramid.pooling_kernel, ada_pyramid.alpha, ada_pyramid.pyramid_beta) == (8, 5, 0.3, 10)
    assert ada_pyramid.learned_weights == str(weights)
    assert (dbudget.window, dbudget.dbudget_query_rows, dbudget.dbudget_frozen_layers) == (8, 2, (0, 3))


def eviction_options_of(policy: str, *argv: str) -> dict[str, str]:
    return dict(parse("--kv-evict-policy", policy, *argv).serving.eviction_options)


def test_defaults_apply_where_the_policy_takes_them_and_flags_win(tmp_path):
    defaults = []
    for pair in ["budget=0.5", "score=learned", "alpha=0.3", "dbudget-threshold=0.02", "window="]:
        defaults += ["--kv-evict-default", pair]
    assert eviction_options_of("lava", *defaults) == {"budget": "0.5", "score": "learned", "alpha": "0.3"}
    assert eviction_options_of("h2o", *defaults) == {"budget": "0.5"}  # no learned score, no alpha
    assert eviction_options_of("dbudget", *defaults) == {"dbudget_threshold": "0.02"}  # no budget, no score
    assert parse("--kv-evict-policy", "none", *defaults).serving == ServingConfig()
    explicit = eviction_options_of("lava", "--kv-evict-budget", "0.1", "--kv-evict-score", "kvzip", *defaults)
    assert explicit == {"budget": "0.1", "score": "kvzip", "alpha": "0.3"}
    # A score's own knob follows the score the policy ends up with (topk's own is kvzip).
    weights = tmp_path / "weights.safetensors"
    weights.touch()
    learned_weights = ["--kv-evict-default", f"learned_weights={weights}"]
    assert "learned_weights" in eviction_options_of("topk", "--kv-evict-score", "learned", *learned_weights)
    assert "learned_weights" in eviction_options_of("topk", "--kv-evict-default", "score=learned", *learned_weights)
    assert eviction_options_of("topk", *learned_weights) == {}


# The eviction flags `make serve` passed before the launcher decided (the Makefile listed the policies
# without a budget and those taking a score), per make variables given; block scope for every policy
# since the scope was chosen again (docs/choosing.md, "Choosing the scope"), unless SCOPE says otherwise.
BLOCK = ("--kv-evict-scope", "block")
MAKE_SERVE_BEFORE = {
    (): ["--kv-evict-policy", "topk", *BLOCK, "--kv-evict-budget", "0.25", "--kv-evict-score", "learned"],
    ("SCOPE=request",): ["--kv-evict-policy", "topk", "--kv-evict-budget", "0.25", "--kv-evict-score", "learned"],
    ("POLICY=none",): ["--kv-evict-policy", "none"],
    ("POLICY=full",): ["--kv-evict-policy", "full", *BLOCK],
    ("POLICY=dbudget",): ["--kv-evict-policy", "dbudget", *BLOCK],
    ("POLICY=snapkv", "SCORE="): ["--kv-evict-policy", "snapkv", *BLOCK, "--kv-evict-budget", "0.25"],
    ("POLICY=h2o",): ["--kv-evict-policy", "h2o", *BLOCK, "--kv-evict-budget", "0.25"],
    ("POLICY=lava", "BUDGET=0.5"): ["--kv-evict-policy", "lava", *BLOCK, "--kv-evict-budget", "0.5", "--kv-evict-score", "learned"],
}
ROOT = Path(__file__).resolve().parent.parent


def make_serve_argv(*variables: str) -> list[str]:
    """The launcher arguments of the command `make serve` runs (make -n prints it, runs nothing)."""
    result = subprocess.run(
        ["make", "--no-print-directory", "-n", "-o", "setup", "serve", *variables],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    [command] = [line for line in result.stdout.splitlines() if "-m sgl_kvevict.server" in line]
    words = shlex.split(command)
    return words[words.index("sgl_kvevict.server") + 1 :]


@pytest.mark.parametrize("variables, flags", MAKE_SERVE_BEFORE.items(), ids=lambda v: " ".join(v) or "default")
def test_make_serve_passes_the_same_effective_flags_as_before(variables, flags):
    before = parse_args(["--model", "smollm2", "--port", "30000", "--workers", "1", *flags])
    assert parse_args(make_serve_argv(*variables)) == before


def test_make_serve_starts_every_policy_with_the_budget_and_score_it_takes():
    for policy in registered_policies():
        defaults = get_policy_class(policy).defaults
        options = parse_args(make_serve_argv(f"POLICY={policy}")).serving.eviction_options
        assert ("budget" in options) == defaults.takes_budget
        assert options.get("score") == ("learned" if "learned" in defaults.scores else None)


def test_every_library_policy_is_served_and_the_default_is_none():
    assert parse().serving.policy == "none" and not parse().serving.enabled
    for policy in registered_policies():
        serving = parse("--kv-evict-policy", policy).serving
        assert serving.policy == policy and serving.scope.name == "request"


def argv_refused_by(flag, spelling: str) -> list[str]:
    if flag.above is not None:
        return [spelling, str(flag.above + 1)]
    if flag.allowed is not None:
        return [f"{spelling}=something-else"]
    return [spelling]


@pytest.mark.parametrize(
    "limit, flag, spelling",
    [(limit, flag, spelling) for limit, flag in limit_flags() for spelling in flag.spellings],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_each_incompatible_sglang_flag_is_refused_with_a_policy_and_passed_without(limit, flag, spelling):
    argv = argv_refused_by(flag, spelling)
    with pytest.raises(FlagError) as error:
        parse("--kv-evict-policy", "lava", *argv)
    assert str(error.value).startswith(spelling) and limit.reason in str(error.value)
    assert parse(*argv).sglang_args == argv


@pytest.mark.parametrize(
    "argv",
    [
        ["--page-size", "1"],
        ["--chunked-prefill-size", "-1"],
        ["--chunked-prefill-size=0"],
        ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill=disabled"],
        ["--cuda-graph-backend-decode=full"],
        ["--tp-size", "1", "--dp-size", "1"],
        ["--disaggregation-mode", "null"],
        ["--disable-overlap-schedule"],
    ],
)
def test_values_compatible_with_compression_are_accepted(argv):
    assert parse("--kv-evict-policy", "snapkv", *argv).sglang_args == argv


def test_inspected_flags_are_sglang_0_5_23_spellings_and_their_abbreviations_only():
    """Every flag the launcher checks exists in SGLang's parser, and no SGLang flag that reaches it is a
    strict prefix of one (the abbreviation guard would refuse it); SGLang does expand abbreviations,
    hence the guard."""
    code = (
        "import argparse, json\n"
        "from sgl_kvevict.compat import activate_cpu_mode; activate_cpu_mode()\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "parser = argparse.ArgumentParser(); ServerArgs.add_cli_args(parser)\n"
        "print(json.dumps({'options': [o for a in parser._actions for o in a.option_strings],\n"
        "                  'tp': parser.parse_args(['--model-path', 'm', '--tp', '2']).tp_size}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    sglang = json.loads(result.stdout.splitlines()[-1])
    options = set(sglang["options"])
    assert set(inspected_flags()) - options == set()
    inspected = inspected_flags()
    ours = {option for action in build_parser()._actions for option in action.option_strings}
    prefixes = [o for o in options - ours if o not in inspected and any(f.startswith(o) for f in inspected)]
    assert prefixes == []
    assert sglang["tp"] == 2


def test_flag_value_reads_what_argparse_keeps():
    args = ["--page-size", "4", "--chunked-prefill-size", "-1", "--page-size=8", "--disable-radix-cache", "--x"]
    assert flag_value(args, "--page-size") == "8"
    assert flag_value(args, "--chunked-prefill-size") == "-1"
    assert flag_value(args, "--disable-radix-cache") is None


def test_the_cpu_chunk_holds_every_policys_window():
    windows = [EvictionConfig.for_policy(policy).window for policy in registered_policies()]
    assert min(CPU_CHUNKED_PREFILL_SIZE, CPU_POLICY_CHUNKED_PREFILL_SIZE) >= max(windows)


def test_cpu_defaults_yield_to_user_flags():
    added = cpu_mode_args(["--attention-backend", "flex_attention", "--dtype=float32"])
    assert "--attention-backend" not in added and "--dtype" not in added
    assert added[added.index("--device") + 1] == "cpu"
    assert added[added.index("--max-total-tokens") + 1] == str(CPU_DEFAULT_MAX_TOTAL_TOKENS)
    assert "--max-total-tokens" not in cpu_mode_args(["--mem-fraction-static", "0.2"])


@pytest.mark.parametrize(
    ("cpu_flags", "dtype"),
    [({"avx2", "avx512f", "avx512_vnni"}, "float32"), ({"avx512f", "avx512_bf16"}, "bfloat16"), ({"amx_bf16"}, "bfloat16"), (set(), "float32")],
)  # fmt: skip
def test_cpu_mode_takes_bf16_only_where_the_cpu_multiplies_it(cpu_flags, dtype):
    assert flag_value(cpu_mode_args([], frozenset(cpu_flags)), "--dtype") == dtype
    assert "--dtype" not in cpu_mode_args(["--dtype", "float16"], frozenset(cpu_flags))


def test_this_machines_cpu_flags_are_read():
    cpuinfo = Path("/proc/cpuinfo")
    lines = [line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")] if cpuinfo.exists() else []
    assert host_cpu_flags() == (frozenset(lines[0].split(":", 1)[1].split()) if lines else frozenset())
    if lines:
        assert "sse2" in host_cpu_flags()  # x86: what the benchmarks and CI run on


def test_the_serving_config_travels_to_sglang_processes_intact():
    serving = parse("--kv-evict-policy", "lava", "--kv-evict-scope", "block", "--kv-evict-block-size", "256").serving
    assert serving.scope == BlockScope(256)
    assert ServingConfig.from_env({SERVING_ENV_VAR: serving.to_env()}) == serving


def test_compress_when_is_prefill_unless_pressure_is_asked_and_travels_intact():
    assert parse("--kv-evict-policy", "lava").serving.compress_when == "prefill"
    serving = parse("--kv-evict-policy", "lava", "--kv-evict-when", "pressure").serving
    assert serving.compress_when == "pressure" and not serving.compresses_while_prefilling
    assert ServingConfig.from_env({SERVING_ENV_VAR: serving.to_env()}) == serving
    with pytest.raises(FlagError, match="--kv-evict-when: only with a --kv-evict-policy"):
        parse("--kv-evict-policy", "none", "--kv-evict-when", "pressure")
    with pytest.raises(ConfigError, match="compress when 'later'"):
        ServingConfig("lava", compress_when="later")


def test_sglang_command_with_a_policy_on_cpu():
    config = parse("--kv-evict-policy", "lava", "--max-total-tokens", "10000", "--page-size", "1")
    command = sglang_command(config, "/models/m", cpu_mode=True)
    args = command[command.index("--model-path"):]
    # One KV pool: compressed cells borrow SGLang's own slots, so the user's size goes through unchanged.
    assert flag_value(args, "--max-total-tokens") == "10000" and args.count("--max-total-tokens") == 1
    assert flag_value(args, "--radix-cache-backend") == "sgl_kvevict"
    # Chunks of its own on CPU (the engine's extend does not pad), one decode round between prefills.
    assert flag_value(args, "--chunked-prefill-size") == str(CPU_POLICY_CHUNKED_PREFILL_SIZE)
    assert flag_value(args, "--prefill-decode-interval") == "1"
    stock = sglang_command(parse("--kv-evict-policy", "none"), "/models/m", cpu_mode=True)
    assert flag_value(stock, "--chunked-prefill-size") == str(CPU_CHUNKED_PREFILL_SIZE)
    for flag in ("--page-size", "--cuda-graph-backend-decode", "--device", "--chunked-prefill-size"):
        assert args.count(flag) == 1, flag
    # SGLang's default overlap schedule, for stock and compression alike (docs/results/overlap.md).
    assert "--disable-overlap-schedule" not in args and "--disable-overlap-schedule" not in stock


@pytest.mark.parametrize("pool,chunk", [("1000", 487), ("4000", CPU_POLICY_CHUNKED_PREFILL_SIZE)])
def test_the_cpu_chunk_of_block_scope_fits_beside_a_block(pool, chunk):
    config = parse("--kv-evict-policy", "lava", "--kv-evict-scope", "block", "--max-total-tokens", pool)
    args = sglang_command(config, "/models/m", cpu_mode=True)
    assert flag_value(args, "--chunked-prefill-size") == str(chunk)  # block 512 + chunk < pool
    given = parse("--kv-evict-policy", "lava", "--kv-evict-scope", "block", "--max-total-tokens", pool,
                  "--chunked-prefill-size", "256")  # fmt: skip
    assert flag_value(sglang_command(given, "/models/m", cpu_mode=True), "--chunked-prefill-size") == "256"


def test_sglang_command_on_cuda_disables_what_compression_cannot_use():
    config = parse("--kv-evict-policy", "snapkv", "--max-total-tokens", "4000")
    args = sglang_command(config, "/models/m", cpu_mode=False)
    assert "--disable-overlap-schedule" not in args and "--device" not in args
    # Decode graphs stay SGLang's default (full CUDA graphs, engine/decode_graph.py); prefill graphs are off.
    assert "--cuda-graph-backend-decode" not in args
    assert flag_value(args, "--cuda-graph-backend-prefill") == "disabled"
    assert flag_value(args, "--max-total-tokens") == "4000"
    given = parse("--kv-evict-policy", "snapkv", "--cuda-graph-backend-decode", "disabled")
    assert flag_value(sglang_command(given, "/models/m", cpu_mode=False), "--cuda-graph-backend-decode") == "disabled"


def test_sglang_command_without_a_policy_is_stock_sglang():
    args = sglang_command(parse("--max-total-tokens", "4000"), "/m", cpu_mode=False)
    assert "--radix-cache-backend" not in args and "--chunked-prefill-size" not in args
    assert flag_value(args, "--max-total-tokens") == "4000"


def test_server_env_carries_the_serving_config_and_the_stats_address(monkeypatch):
    monkeypatch.setenv(STATS_ADDRESS_ENV_VAR, "ipc:///stale")
    config = parse("--kv-evict-policy", "lava", "--kv-evict-budget", "0.1")
    with stats_socket_address(config.serving.enabled) as address:
        directory = address.removeprefix("ipc://").rsplit("/", 1)[0]
        env = server_env(config, cpu_mode=True, stats_address=address)
        assert env[STATS_ADDRESS_ENV_VAR] == address
        assert ServingConfig.from_env(env) == config.serving
        assert os.path.isdir(directory)
    assert not os.path.exists(directory)
    stock = parse()
    with stats_socket_address(stock.serving.enabled) as address:
        env = server_env(stock, cpu_mode=True, stats_address=address)
    assert address is None and STATS_ADDRESS_ENV_VAR not in env
    assert ServingConfig.from_env(env) == ServingConfig()


def test_help_documents_every_flag_of_ours_with_its_defaults():
    # Wide lines, so argparse does not break hyphenated flags across lines.
    env = {**os.environ, "COLUMNS": "10000"}
    result = subprocess.run(
        [sys.executable, "-m", "sgl_kvevict.server", "--help"], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0
    for action in build_parser()._actions:
        for option in action.option_strings:
            assert option in result.stdout
        assert action.help and len(action.help) > 10
    text = " ".join(result.stdout.split())
    assert "passed to SGLang unchanged" in text
    # Per-policy paper defaults, read from the policy classes.
    assert "32 for ada-pyramidkv" in text and "1 for dbudget, tova" in text
    assert "max for lava" in text and "none (policy decides) for dbudget, full" in text
    for _, flag in limit_flags():
        assert flag.condition() in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workers", "0"], "--workers 0: at least one worker is needed"),
        (["--workers", "-2"], "--workers -2: at least one worker is needed"),
        (["--stats-port", "31000"], "--stats-port 31000: only with --workers above 1"),
        (["--workers", "2", "--port", "31000", "--stats-port", "31000"], "--stats-port 31000 is the router's --port"),
        (["--workers", "2", "--port", "65535"], "--stats-port 65536 is outside 1..65535"),
    ],
)
def test_bad_scale_out_flags_have_one_clear_message(argv, message):
    with pytest.raises(FlagError, match=message):
        parse(*argv)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--api-key", " "], "--api-key: the key is empty or starts or ends with white space"),
        (["--admin-api-key", "k "], "--admin-api-key: the key is empty"),
        (["--workers", "2", "--admin-api-key", "a"], "--admin-api-key with --workers above 1 needs --api-key too"),
        (["--api-k", "k"], "--api-k abbreviates --api-key; spell it in full"),
        (["--kv-evict-request-allow", "all"], "--kv-evict-request-allow: only with a --kv-evict-policy"),
        (["--kv-evict-policy", "lava", "--kv-evict-request-allow", "all"], "needs per-request options"),
        (
            ["--kv-evict-policy", "lava", "--kv-evict-per-request", "--kv-evict-request-allow", "window=64..1"],
            r"window=64..1: the range is empty",
        ),
    ],
)
def test_bad_access_flags_have_one_clear_message(argv, message):
    with pytest.raises(FlagError, match=message):
        parse(*argv)


def test_both_keys_reach_a_lone_server_and_requests_choose_within_the_allow_list():
    config = parse("--kv-evict-policy", "lava", "--kv-evict-per-request", "--kv-evict-request-allow", "policy=lava",
                   "--api-key", "k", "--admin-api-key", "a")  # fmt: skip
    args = sglang_command(config, "/m", cpu_mode=True)
    assert (flag_value(args, "--api-key"), flag_value(args, "--admin-api-key")) == ("k", "a")
    assert config.control_key == "a" and parse("--api-key", "k").control_key == "k"
    assert ServingConfig.from_env({SERVING_ENV_VAR: config.serving.to_env()}).request_allow == "policy=lava"


def test_scale_out_defaults_put_the_aggregate_stats_beside_the_router():
    config = parse("--workers", "3", "--port", "31000", "--kv-evict-policy", "lava")
    assert (config.workers, config.stats_port) == (3, 31001)
    assert parse().stats_port is None and parse().workers == 1


def test_each_worker_gets_the_same_flags_its_served_name_and_on_cuda_its_own_gpu():
    from sgl_kvevict.server.scale_out import router_command, worker_config

    config = parse("--workers", "2", "--kv-evict-policy", "lava", "--max-total-tokens", "5000", "--base-gpu-id=2")
    cpu_worker = worker_config(config, 1, cpu_mode=True)
    assert flag_value(cpu_worker.sglang_args, "--served-model-name") == "m"
    assert flag_value(cpu_worker.sglang_args, "--max-total-tokens") == "5000"
    gpu_workers = [worker_config(config, index, cpu_mode=False) for index in (0, 1)]
    assert [flag_value(w.sglang_args, "--base-gpu-id") for w in gpu_workers] == ["2", "3"]
    assert all(sum(a.startswith("--base-gpu-id") for a in w.sglang_args) == 1 for w in gpu_workers)
    named = worker_config(parse("--workers", "2", "--served-model-name", "mine"), 0, cpu_mode=True)
    assert flag_value(named.sglang_args, "--served-model-name") == "mine"
    command = router_command(config, ["http://127.0.0.1:1", "http://127.0.0.1:2"], port=4, metrics_port=3)
    assert flag_value(command, "--policy") == "cache_aware"
    # The router on loopback: the launcher opens --host:--port once it routes (scale_out.open_public_port).
    assert (flag_value(command, "--host"), flag_value(command, "--port")) == ("127.0.0.1", "4")
    assert command[command.index("--worker-urls") + 1 :] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert flag_value(command, "--prometheus-port") == "3"
    assert "--api-key" not in command and "--control-plane-api-keys" not in command


def test_the_router_checks_the_api_key_and_takes_the_admin_key_for_its_control_plane():
    """Read back through the router's own parser: the API key guards its routes and reaches the workers;
    the admin key is its one control-plane key, with the admin role. The workers get the API key only."""
    from sglang_router.router_args import RouterArgs

    from sgl_kvevict.server.router_entry import router_parser
    from sgl_kvevict.server.scale_out import router_command, worker_config

    config = parse("--workers", "2", "--kv-evict-policy", "lava", "--api-key", "k:1", "--admin-api-key", "a:2")
    command = router_command(config, ["http://127.0.0.1:1"], port=4, metrics_port=3)
    module = command.index("sgl_kvevict.server.router_entry")
    router = RouterArgs.from_cli_args(router_parser().parse_args(command[module + 1 :]), use_router_prefix=False)
    assert router.api_key == "k:1"
    assert [(key, role) for _, _, key, role in router.control_plane_api_keys] == [("a:2", "admin")]
    worker = worker_config(config, 0, cpu_mode=True)
    args = sglang_command(worker, "/m", cpu_mode=True)
    assert flag_value(args, "--api-key") == "k:1" and "--admin-api-key" not in args


@pytest.mark.parametrize(
    "tp, cores, bind",
    [(1, [0, 1], None), (2, [0, 1], "0|1"), (3, [0, 1], "0|1|0"), (2, [4, 5, 6, 7, 8], "4,5|6,7")],
)
def test_cpu_tensor_parallel_ranks_get_cores_unless_the_user_chose(tp, cores, bind, monkeypatch):
    monkeypatch.delenv(THREADS_BIND_ENV_VAR, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    config = parse_args(["--model", "smollm2", "--kv-evict-policy", "lava", "--tp-size", str(tp)])
    assert threads_bind(config, cpu_mode=True) == bind
    assert server_env(config, cpu_mode=True, stats_address=None).get(THREADS_BIND_ENV_VAR) == bind
    assert threads_bind(config, cpu_mode=False) is None  # CUDA: SGLang binds nothing
    monkeypatch.setenv(THREADS_BIND_ENV_VAR, "0-3|4-7")
    assert threads_bind(config, cpu_mode=True) == (None if tp == 1 else "0-3|4-7")


def test_sglangs_metadata_glue_graph_is_refused_from_the_environment_with_a_policy():
    """Issue 34, finding 5: SGLang would capture the segments graphs' replay preparation into a graph."""
    serving = parse("--kv-evict-policy", "snapkv").serving
    for value in ("1", "true", "Yes", "y"):
        with pytest.raises(FlagError, match=f"SGLANG_ENABLE_METADATA_GLUE_GRAPH={value} cannot be used with a --kv-evict-policy: it captures"):
            check_environment(serving, {"SGLANG_ENABLE_METADATA_GLUE_GRAPH": value})
    check_environment(serving, {"SGLANG_ENABLE_METADATA_GLUE_GRAPH": "0"})
    check_environment(serving, {})
    check_environment(parse().serving, {"SGLANG_ENABLE_METADATA_GLUE_GRAPH": "1"})  # stock SGLang: its own choice


def test_replicated_kv_heads_are_refused_on_cuda_only():
    check_tensor_parallel(4, model_kv_heads=4, cpu_mode=False)
    check_tensor_parallel(8, model_kv_heads=4, cpu_mode=True)  # SGLang pads heads on CPU
    with pytest.raises(FlagError, match="--tp-size 8 cannot be used with a --kv-evict-policy on a model with 4 KV heads"):
        check_tensor_parallel(8, model_kv_heads=4, cpu_mode=False)
