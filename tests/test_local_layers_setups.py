"""Gemma 3's set-ups (local attention layers trimmed to their window): what the launcher refuses before the
weights load (``server.refusals.check_local_layers``: decode CUDA graphs; both wrapped backends and any TP
size pass) and the decode-graph default it adds on CUDA (``launcher.with_local_layer_defaults``), the
tree's start-up check that config.json's local layers are SGLang's per-layer windows
(``factory.check_local_windows``, on fake models), and the rank counts a split head's window adds on every
rank alike. Pure, in-process."""

from __future__ import annotations

import json

import pytest
import torch

from sgl_kvevict.limits import LIMITS, SetupFacts, violations
from sgl_kvevict.local_layers import LocalLayers
from sgl_kvevict.server.flags import parse_args
from sgl_kvevict.server.launcher import with_local_layer_defaults
from sgl_kvevict.server.refusals import FlagError, check_local_layers
from sgl_kvevict.server.sglang_args import compression_args, flag_value
from sgl_kvevict.sharding import RankCounts

WINDOW = 16
LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention"]
CPU_ARGS = ["--attention-backend", "torch_native", "--page-size", "1"]
GRAPHS_REASON = next(limit.reason for limit in LIMITS if limit.name == "decode graphs with local layers")


@pytest.fixture
def gemma_dir(tmp_path):
    config = {"model_type": "gemma3_text", "num_hidden_layers": 4, "layer_types": LAYER_TYPES, "sliding_window": WINDOW}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def refusal(model_dir, args: list[str]) -> str:
    with pytest.raises(FlagError) as error:
        check_local_layers(model_dir, args)
    [line] = str(error.value).splitlines()
    return line


def test_gemma_3_passes_on_both_wrapped_backends_at_any_tp_size(gemma_dir):
    check_local_layers(gemma_dir, CPU_ARGS)
    check_local_layers(gemma_dir, [*CPU_ARGS, "--tp-size", "2"])
    check_local_layers(gemma_dir, compression_args([], cpu_mode=False))  # CUDA: flashinfer, the launcher's
    check_local_layers(gemma_dir, ["--attention-backend", "flashinfer", "--cuda-graph-backend-decode", "disabled"])


def test_a_model_without_local_layers_is_not_checked(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    check_local_layers(tmp_path, ["--attention-backend", "flashinfer", "--cuda-graph-backend-decode", "full"])


def test_decode_graphs_for_gemma_3_are_refused_in_one_line_naming_the_flag(gemma_dir):
    line = refusal(gemma_dir, ["--attention-backend", "flashinfer", "--cuda-graph-backend-decode", "full"])
    assert line.startswith(f"--cuda-graph-backend-decode full cannot be used with a --kv-evict-policy on the model in {gemma_dir}")
    assert f"3 local attention layers (window {WINDOW})" in line and GRAPHS_REASON in line


def test_the_launcher_turns_decode_graphs_off_for_gemma_3_on_cuda_only(gemma_dir, tmp_path_factory):
    config = parse_args(["--model", str(gemma_dir), "--kv-evict-policy", "full"])
    on_cuda = with_local_layer_defaults(config, gemma_dir, cpu_mode=False)
    assert flag_value(on_cuda.sglang_args, "--cuda-graph-backend-decode") == "disabled"
    assert with_local_layer_defaults(config, gemma_dir, cpu_mode=True) == config  # CPU mode: off already
    llama = tmp_path_factory.mktemp("llama")
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    assert with_local_layer_defaults(config, llama, cpu_mode=False) == config
    given = parse_args(["--model", str(gemma_dir), "--kv-evict-policy", "full", "--cuda-graph-backend-decode", "disabled"])
    assert with_local_layer_defaults(given, gemma_dir, cpu_mode=False).sglang_args == given.sglang_args  # not twice


def test_the_tree_refuses_decode_graphs_for_local_layers_from_its_facts():
    [line] = violations(SetupFacts(local_layer_decode_graphs=True))
    assert line == f"decode graphs with local layers: {GRAPHS_REASON}"


# ---- the tree: config.json's local layers against SGLang's per-layer windows --------------------------


def fake_model(windows: dict[int, int], num_layers: int = 4) -> torch.nn.Module:
    """SGLang's attention layers as a model holds them: a ``RadixAttention`` per layer, with SGLang's
    ``sliding_window_size`` (``window - 1``) where ``windows`` gives one."""
    from sglang.srt.layers.radix_attention import RadixAttention

    layers = [
        RadixAttention(4, 16, 0.25, num_kv_heads=2, layer_id=layer,
                       **({"sliding_window_size": windows[layer] - 1} if layer in windows else {}))
        for layer in range(num_layers)
    ]  # fmt: skip
    return torch.nn.ModuleDict({"layers": torch.nn.ModuleList(layers), "norm": torch.nn.LayerNorm(4)})


def test_sglangs_windows_are_read_from_the_models_attention_layers():
    from sgl_kvevict.engine.adapter.factory import sglang_local_windows

    assert sglang_local_windows(fake_model({0: WINDOW, 1: WINDOW, 2: WINDOW})) == {0: WINDOW, 1: WINDOW, 2: WINDOW}
    assert sglang_local_windows(fake_model({})) == {}


def test_config_local_layers_equal_to_sglangs_windows_pass():
    from sgl_kvevict.engine.adapter.factory import check_local_windows, sglang_local_windows

    check_local_windows(LocalLayers((0, 1, 2), WINDOW), sglang_local_windows(fake_model({0: WINDOW, 1: WINDOW, 2: WINDOW})))


@pytest.mark.parametrize(
    "sglang, named",
    [
        ({0: WINDOW, 1: WINDOW}, "layer 2 (config.json: window 16, SGLang: global)"),  # a local layer trimmed, read whole
        ({0: WINDOW, 1: WINDOW, 2: WINDOW, 3: WINDOW}, "layer 3 (config.json: global, SGLang: window 16)"),
        ({0: WINDOW, 1: 2 * WINDOW, 2: WINDOW}, "layer 1 (config.json: window 16, SGLang: window 32)"),
    ],
)
def test_a_mismatch_is_refused_in_one_line_naming_the_layers(sglang, named):
    from sgl_kvevict.engine.adapter.factory import UnsupportedSetup, check_local_windows, sglang_local_windows

    with pytest.raises(UnsupportedSetup) as error:
        check_local_windows(LocalLayers((0, 1, 2), WINDOW), sglang_local_windows(fake_model(sglang)))
    [line] = str(error.value).splitlines()
    assert line.startswith("KV eviction cannot run with: the model's config.json and SGLang's attention disagree")
    assert line.endswith(named)


def test_two_mismatching_layers_are_both_named():
    from sgl_kvevict.engine.adapter.factory import UnsupportedSetup, check_local_windows

    with pytest.raises(UnsupportedSetup, match=r"layer 0 \(config.json: window 16, SGLang: global\), layer 3 "):
        check_local_windows(LocalLayers((0, 1, 2), WINDOW), {1: WINDOW, 2: WINDOW, 3: WINDOW})


# ---- tensor parallelism: a split head's window, gained alike on every rank -----------------------------


def test_entries_every_rank_gains_alike_add_to_each_ranks_counts():
    """A split head's local-layer window (``RankCounts.of_plan``, one rank's counts) added to a node's counts
    of two ranks: each rank holds it, so each one's entries and the cells every rank reserves grow by it."""
    node = RankCounts.of_positions(10, torch.tensor([[2, 0, 1, 1], [0, 2, 2, 2]]), 8)
    gained = RankCounts.of_positions(10, torch.tensor([[0, 0, 3, 3]]), 4)
    both = node.plus(gained)
    assert both.per_rank().tolist() == [10, 12] and both.reserved() == node.reserved() + 6
    assert both.entries_per_position == 8 and both.restricted(12, 14).per_rank().tolist() == [8, 10]
    with pytest.raises(AssertionError):
        node.plus(RankCounts.of_positions(10, torch.zeros(3, 4, dtype=torch.int64), 8))  # three ranks' counts


def test_the_evaluate_commands_preflight_refuses_gemma_3_where_the_launcher_would(gemma_dir):
    """``python -m sgl_kvevict.evaluate`` checks every plugin server before stock starts: Gemma 3 with decode
    graphs is refused there, not after stock has run; FlashInfer and several TP ranks are served."""
    from sgl_kvevict.measure.servers import ServerError, ServerVariant, check_model_takes

    full = ServerVariant("full")
    check_model_takes(str(gemma_dir), full, 4096, ())
    check_model_takes(str(gemma_dir), full, 4096, ("--tp-size", "2"))
    with pytest.raises(ServerError, match="--cuda-graph-backend-decode full cannot be used with a --kv-evict-policy"):
        check_model_takes(str(gemma_dir), full, 4096, ("--attention-backend", "flashinfer", "--cuda-graph-backend-decode", "full"))
