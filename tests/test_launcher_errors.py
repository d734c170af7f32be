"""Bad input to the launcher: non-zero exit, one-line reason, before any model is loaded."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest

from serving import error_lines, free_port, launcher_command

# Validation happens before SGLang is imported; a run that got as far as loading would take >20 s.
FAST_EXIT_SECONDS = 15


def run_launcher(*args: str) -> tuple[int, str, float]:
    start = time.monotonic()
    result = subprocess.run(launcher_command(*args), capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout + result.stderr, time.monotonic() - start


def fast_refusal(*args: str, exit_code: int | None = None) -> tuple[str, str]:
    """Runs the launcher with ``args``, which it must refuse before any model is loaded: a non-zero exit
    (``exit_code`` where given) within ``FAST_EXIT_SECONDS`` and one error line. Returns that line and
    the whole output."""
    code, output, elapsed = run_launcher(*args)
    assert code != 0 if exit_code is None else code == exit_code
    [line] = error_lines(output)
    assert elapsed < FAST_EXIT_SECONDS and "Load weight" not in output
    return line, output


def test_unknown_policy_is_refused_with_the_valid_names(tiny_llama_dir):
    line, _ = fast_refusal("--model", str(tiny_llama_dir), "--kv-evict-policy", "nonsense")
    assert "nonsense" in line and "valid: none, ada-pyramidkv" in line


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kv-evict-policy", "lava", "--page-size", "16"], "--page-size 16 cannot be used with a --kv-evict-policy"),
        (["--kv-evict-policy", "lava", "--pp-size=2"], "--pp-size 2 cannot be used"),
        (["--kv-evict-policy", "snapkv", "--chunked-prefill-size", "16"], "smaller than the 32-token observation window"),
        (["--kv-evict-policy", "snapkv", "--kv-evict-scope", "block", "--kv-evict-block-size", "2048",
          "--chunked-prefill-size", "2048", "--max-total-tokens", "4000"], "do not fit together in --max-total-tokens 4000"),
        # CPU mode's chunk shrinks to fit beside a block (540 - 512 - 1), but not below the window.
        (["--kv-evict-policy", "snapkv", "--kv-evict-scope", "block", "--max-total-tokens", "540"],
         "--chunked-prefill-size 27 is smaller than the 32-token observation window"),
        (["--kv-evict-policy", "lava", "--enable-hicache"], "HiCache copies tree values"),
        (["--kv-evict-policy", "lava", "--radix-cache-backend", "x"], "compression lives in the plugin's own radix cache"),
        (["--kv-evict-policy", "lava", "--cuda-graph-backend-prefill", "full"], "a replayed prefill graph skips"),
        (["--kv-evict-policy", "lava", "--cuda-graph-backend-decode", "breakable"], "breakable graphs and CPU graphs"),
        (["--kv-evict-policy", "lava", "--cuda-graph-backend-decode", "full"], "captures CPU decode graphs with torch.compile"),
        (["--kv-evict-policy", "lava", "--enable-mixed-chunk"], "batches mixing prefill and decode tokens"),
        (["--kv-evict-policy", "lava", "--kv-evict-budget", "1.5"], "budget ratio 1.5 must be in (0, 1)"),
        (["--kv-evict-window", "16"], "--kv-evict-window: only with a --kv-evict-policy"),
    ],
)
def test_refused_combinations_exit_before_sglang_starts(tiny_llama_dir, args, message):
    line, _ = fast_refusal("--model", str(tiny_llama_dir), "--port", str(free_port()), *args, exit_code=2)
    assert message in line


def test_sglangs_metadata_glue_graph_in_the_environment_is_refused(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "1")  # the launcher's process inherits it
    line, _ = fast_refusal(
        "--model", str(tiny_llama_dir), "--port", str(free_port()), "--kv-evict-policy", "lava", exit_code=2
    )
    assert "SGLANG_ENABLE_METADATA_GLUE_GRAPH=1 cannot be used with a --kv-evict-policy" in line


def test_missing_model_path_is_refused(tmp_path):
    code, output, elapsed = run_launcher("--model", str(tmp_path / "no-such-model"))
    assert code != 0
    [line] = error_lines(output)
    assert "no-such-model" in line
    assert elapsed < FAST_EXIT_SECONDS


def test_folder_without_config_is_refused(tmp_path):
    code, output, _ = run_launcher("--model", str(tmp_path))
    assert code != 0
    [line] = error_lines(output)
    assert "config.json" in line


def test_port_in_use_is_refused(tiny_llama_dir):
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        line, _ = fast_refusal("--model", str(tiny_llama_dir), "--port", str(port))
    assert str(port) in line and "in use" in line


@pytest.mark.parametrize("flag", ["--model-path", "--port=0", "--host"])
def test_flags_the_launcher_owns_are_refused_or_checked(tiny_llama_dir, flag):
    args = ["--model", str(tiny_llama_dir), flag] + ([] if "=" in flag else ["x"])
    code, output, _ = run_launcher(*args)
    assert code != 0
    assert len(error_lines(output)) == 1


def test_bad_sglang_flag_fails_startup_with_a_reason(tiny_llama_dir):
    code, output, _ = run_launcher("--model", str(tiny_llama_dir), "--port", str(free_port()), "--no-such-flag")
    assert code != 0
    assert "no-such-flag" in output
    assert "before becoming healthy" in error_lines(output)[-1]


def test_an_attention_backend_the_engine_does_not_wrap_is_refused_with_a_policy(tiny_llama_dir):
    line, _ = fast_refusal(
        "--model", str(tiny_llama_dir), "--kv-evict-policy", "snapkv", "--attention-backend", "flex_attention"
    )
    assert "--attention-backend flex_attention" in line and "torch_native" in line


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    """A tiny random Gemma 3: three local layers (window 16), then a global one."""
    from sgl_kvevict.checkpoints import build_tiny_model

    overrides = dict(layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=16)
    return build_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3", num_layers=4, overrides=overrides)


def test_gemma_3_with_decode_graphs_on_cuda_is_refused_before_it_loads(tiny_gemma3_dir, monkeypatch, capsys):
    """In-process, as on a CUDA machine (CPU mode refuses decode graphs for every model first): a Gemma 3 model
    with a policy and decode CUDA graphs is refused from its config.json, before SGLang starts."""
    import sgl_kvevict.compat
    from sgl_kvevict.server import launcher

    monkeypatch.setattr(sgl_kvevict.compat, "cpu_mode_needed", lambda: False)
    monkeypatch.setattr(launcher, "run_single", lambda *args: pytest.fail("the server was started"))
    code = launcher.main(["--model", str(tiny_gemma3_dir), "--port", str(free_port()), "--kv-evict-policy", "snapkv",
                          "--cuda-graph-backend-decode", "full"])  # fmt: skip
    assert code == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert f"--cuda-graph-backend-decode full cannot be used with a --kv-evict-policy on the model in {tiny_gemma3_dir}" in line
    assert "3 local attention layers (window 16)" in line and "decode graph has no windowed part" in line


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workers", "0"], "--workers 0: at least one worker is needed"),
        # A terabyte of KV pool per worker on this tiny model: refused from the host's MemAvailable.
        (["--workers", "2", "--max-total-tokens", "2000000000"], "--workers 2 needs about"),
    ],
)
def test_scale_out_without_room_is_refused_before_any_worker_starts(tiny_llama_dir, args, message):
    line, output = fast_refusal("--model", str(tiny_llama_dir), "--port", str(free_port()), *args, exit_code=2)
    assert message in line and "worker 0" not in output


def test_a_missing_router_is_refused_before_the_model_resolves(monkeypatch, tmp_path, capsys):
    """In-process: the launcher looks the router package up before anything else of the scale-out."""
    import importlib.util

    from sgl_kvevict.server.launcher import main

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sglang_router" else real_find_spec(name, *a)
    )
    assert main(["--model", str(tmp_path / "not-resolved"), "--port", str(free_port()), "--workers", "2"]) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert "--workers 2 needs SGLang's router: pip install sglang-router==0.3.2" in line


def test_a_server_started_without_the_launcher_is_refused_by_the_tree(tiny_llama_dir, tmp_path):
    """SGLang started directly with the plugin's tree: the tree reads the same limits from SGLang's
    resolved configuration (sgl_kvevict.limits via engine/adapter/factory.py) and refuses to be built."""
    import os
    import signal
    import sys

    from sgl_kvevict.serving import ENV_VAR, ServingConfig

    command = [
        sys.executable, "-m", "sgl_kvevict.server.sglang_entry", "--model-path", str(tiny_llama_dir),
        "--host", "127.0.0.1", "--port", str(free_port()), "--radix-cache-backend", "sgl_kvevict",
        "--device", "cpu", "--attention-backend", "torch_native", "--cuda-graph-backend-decode", "disabled",
        "--cuda-graph-backend-prefill", "disabled", "--disable-overlap-schedule", "--page-size", "1",
        "--dtype", "float32", "--skip-server-warmup", "--max-total-tokens", "4000", "--mem-fraction-static", "0.3",
        "--page-size", "16", "--enable-mixed-chunk",  # what the launcher would refuse
    ]  # fmt: skip
    env = {**os.environ, ENV_VAR: ServingConfig("lava").to_env(), "OMP_NUM_THREADS": "1"}
    log_path = tmp_path / "sglang.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    try:  # the scheduler's error is enough; SGLang then waits a minute for GPU crash dumps before exiting
        while process.poll() is None and time.monotonic() < deadline:
            if "KV eviction cannot run with:" in log_path.read_text(errors="replace"):
                break
            time.sleep(0.5)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    output = log_path.read_text(errors="replace")
    assert "Uvicorn running" not in output  # refused before it served
    [line] = [line for line in output.splitlines() if "KV eviction cannot run with:" in line][-1:]
    assert "page size: compressed segments are token-granular" in line and "mixed chunks: batches mixing" in line
