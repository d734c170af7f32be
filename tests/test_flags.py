"""Launcher flag parsing: validation, pass-through, CPU defaults, --help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sgl_kvevict.server.flags import (
    CPU_DEFAULT_MAX_TOTAL_TOKENS,
    FlagError,
    build_parser,
    cpu_mode_args,
    parse_args,
)


def test_unknown_flags_pass_through_to_sglang():
    config = parse_args(["--model", "m", "--max-running-requests", "4", "--log-level", "warning"])
    assert config.sglang_args == ["--max-running-requests", "4", "--log-level", "warning"]
    assert (config.host, config.port, config.kv_evict_policy) == ("127.0.0.1", 30000, "none")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "m", "--kv-evict-policy", "lava2"], "'lava2' is not a policy"),
        (["--model", "m", "--port", "70000"], "outside 1..65535"),
        (["--model", "m", "--model-path", "x"], "--model-path is set by the launcher"),
        (["--model", "m", "--startup-timeout", "0"], "must be positive"),
    ],
)
def test_bad_flags_have_one_clear_message(argv, message):
    with pytest.raises(FlagError, match=message):
        parse_args(argv)


def test_cpu_defaults_yield_to_user_flags():
    added = cpu_mode_args(["--attention-backend", "flex_attention", "--dtype=float32"])
    assert "--attention-backend" not in added and "--dtype" not in added
    assert added[added.index("--device") + 1] == "cpu"
    assert added[added.index("--max-total-tokens") + 1] == str(CPU_DEFAULT_MAX_TOTAL_TOKENS)
    assert "--max-total-tokens" not in cpu_mode_args(["--mem-fraction-static", "0.2"])


def test_help_documents_every_flag_of_ours():
    result = subprocess.run(
        [sys.executable, "-m", "sgl_kvevict.server", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    for action in build_parser()._actions:
        for option in action.option_strings:
            assert option in result.stdout
        assert action.help and len(action.help) > 10
    assert "passed to SGLang unchanged" in result.stdout
