"""The GPU kit does not rot (docs/gpu.md, "Run the server on a lent GPU"): on CPU, without network.

* The stand-in ``sgl_kernel`` and the installed SGLang still import along SGLang's CUDA branches
  (``tools/gpu_launch_imports.py`` with CUDA faked and ``tests/fake_flashinfer.py`` for FlashInfer), the
  names it stands in for are still the ones SGLang imports, the launch path imports no file the kit
  trims and no distribution the lent machine lacks and the kit does not pin.
* The dual-GEMM stub keeps every name SGLang takes from the module it replaces.
* ``tools/gpu_kit.py``: the carry-size refusal, what the working tree counts, the trim rules, and
  wheels rewritten with a RECORD that matches their files.
* ``tools/gpu_smoke.py``: the report of a dry run names every check; the step runner reports a failure
  and goes on; the token comparison's verdicts; the random checkpoint loads in transformers; the
  capture log lines parse; a rehearsal reports what needs a GPU as NOT ON CPU and exits 0 without a
  FAIL; the decode-step slot's servers need no learned weights.
"""

from __future__ import annotations

import ast
import csv
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

from sgl_kvevict.compat.sgl_kernel_names import CUDA_SUBMODULE_NAMES, IMPORTED_NAMES
from tools import gpu_kit, gpu_smoke

REPO = Path(__file__).resolve().parents[1]
SGLANG = Path(importlib.util.find_spec("sglang").origin).parent
STANDIN = REPO / "tools" / "gpu_kit_files" / "standin"
STUB = REPO / "tools" / "gpu_kit_files" / "cutedsl_dual_gemm.py"
MIB = 1 << 20


def sglang_trees(needle: str) -> list[tuple[Path, ast.Module]]:
    """The parsed SGLang files whose text mentions ``needle`` (parsing all 2,500 takes minutes)."""
    trees = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))  # SGLang's own escape sequences
        for path in sorted(SGLANG.rglob("*.py")):
            text = path.read_text()
            if needle in text:
                trees.append((path, ast.parse(text)))
    return trees


def imported_names(module: str, relative_from: str | None = None) -> set[str]:
    """Every name SGLang imports from ``module`` (absolutely, or relatively from the package ``relative_from``)."""
    names = set()
    for path, tree in sglang_trees(module if relative_from is None else module.rsplit(".", 1)[-1]):
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            absolute = node.level == 0 and node.module == module
            relative = (
                relative_from is not None and node.level == 1 and path.parent == SGLANG.parent / relative_from.replace(".", "/")
                and node.module == module.rsplit(".", 1)[-1]
            )  # fmt: skip
            if absolute or relative:
                names.update(alias.name for alias in node.names)
    return names


# --- the stand-in and the launch path ------------------------------------------------------------


def test_standin_names_are_the_ones_sglang_imports():
    assert imported_names("sgl_kernel") == set(IMPORTED_NAMES)
    for submodule, names in CUDA_SUBMODULE_NAMES.items():
        assert imported_names(f"sgl_kernel.{submodule}") == set(names), submodule
    # Every other submodule SGLang imports stays absent, so that its ImportError fallbacks run.
    package = {path.stem for path in (STANDIN / "sgl_kernel").glob("*.py")}
    assert package == {"__init__", "_unavailable", *CUDA_SUBMODULE_NAMES}


def run_python(code: str, env: dict | None = None, args: list[str] = (), timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def test_standin_raises_naming_the_kernel_and_keeps_guarded_submodules_absent():
    result = run_python(
        "import sgl_kernel, sgl_kernel.kvcacheio as kv\n"
        "from sgl_kernel.utils import is_arch_support_pdl\n"
        "assert sgl_kernel.__sgl_kvevict_standin__ and is_arch_support_pdl() is False\n"
        "for call in (sgl_kernel.rmsnorm, kv.transfer_kv_direct):\n"
        "    try:\n"
        "        call()\n"
        "    except NotImplementedError as error:\n"
        "        print(str(error).split(' was called')[0])\n"
        "for guarded in ('scalar_type', 'flash_attn', 'mamba', 'elementwise'):\n"
        "    try:\n"
        "        __import__(f'sgl_kernel.{guarded}')\n"
        "    except ImportError:\n"
        "        print('absent', guarded)\n",
        env={**os.environ, "PYTHONPATH": str(STANDIN)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:6] == [
        "sgl_kernel.rmsnorm", "sgl_kernel.kvcacheio.transfer_kv_direct",
        "absent scalar_type", "absent flash_attn", "absent mamba", "absent elementwise",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def launch_trace(tmp_path_factory):
    """The launch path imported along SGLang's CUDA branches, with the stand-in and the fake FlashInfer."""
    report = tmp_path_factory.mktemp("trace") / "trace.json"
    command = [sys.executable, "tools/gpu_launch_imports.py", "--fake-cuda", "--fake-flashinfer", "--json", str(report)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": str(STANDIN)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(report.read_text())


def test_the_cuda_launch_path_imports_with_the_standin(launch_trace):
    assert [item for item in launch_trace["imports"] if item["error"]] == []
    modules = {item["module"] for item in launch_trace["imports"]}
    assert {"sglang.srt.server_args", "sglang.srt.model_executor.model_runner", "sgl_kvevict.engine.adapter.flashinfer_backend"} <= modules
    assert launch_trace["sgl_kernel"] == "stand-in"
    assert launch_trace["origins"]["sgl_kernel"] == str(STANDIN)
    # The CUDA branches ran: they import the stand-in's submodules (CPU mode never does).
    assert launch_trace["sgl_kernel_submodules"] == ["sgl_kernel.kvcacheio", "sgl_kernel.quantization"]


def test_the_launch_path_needs_nothing_the_kit_trims_or_lacks(launch_trace):
    assert [path for path in launch_trace["loaded"]["sglang"] if not gpu_kit.sglang_keeps(path)] == []
    pinned, machine = gpu_kit.pinned_names(gpu_kit.PINS), gpu_kit.pinned_names(gpu_kit.MACHINE_PACKAGES)
    assert gpu_kit.missing_distributions(launch_trace["distributions"], pinned, machine) == []
    assert "pydantic-core" in pinned and "torch" in machine and not pinned & machine


def test_missing_distributions_names_what_neither_side_has():
    missing = gpu_kit.missing_distributions(["torch", "Pydantic_Core", "newdep", "sgl-kvevict", "soundfile"], {"pydantic-core"}, {"torch"})
    assert missing == ["newdep"]


# --- the dual-GEMM stub --------------------------------------------------------------------------


def load_stub():
    spec = importlib.util.spec_from_file_location("cutedsl_dual_gemm_stub", STUB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dual_gemm_stub_keeps_every_name_sglang_takes_from_the_module():
    used = imported_names("sglang.kernels.ops.gemm.cutedsl_dual_gemm", relative_from="sglang.kernels.ops.gemm")
    registry = (SGLANG / "kernels" / "ops" / "gemm" / "__init__.py").read_text()
    used |= set(re.findall(r"cutedsl_dual_gemm:(\w+)", registry))
    assert {"DualGemmQuantMode", "can_use_dual_gemm", "dual_gemm_swiglu", "dual_gemm_swiglu_fp8"} <= used
    stub = load_stub()
    assert [name for name in sorted(used) if not hasattr(stub, name)] == []

    real = ast.parse((SGLANG / gpu_kit.DUAL_GEMM_PATH.removeprefix("sglang/")).read_text())
    enum = next(node for node in real.body if isinstance(node, ast.ClassDef) and node.name == "DualGemmQuantMode")
    members = {target.id: node.value.value for node in enum.body if isinstance(node, ast.Assign) for target in node.targets}
    assert {member.name: member.value for member in stub.DualGemmQuantMode} == members
    constant = next(node for node in real.body if isinstance(node, ast.Assign) and node.targets[0].id == "MAX_DUAL_GEMM_DECODE_TOKENS")
    assert stub.MAX_DUAL_GEMM_DECODE_TOKENS == constant.value.value
    assert stub.can_use_dual_gemm(1, 4096, 14336, stub.DualGemmQuantMode.UNQUANT) is False
    with pytest.raises(NotImplementedError, match="dual_gemm_swiglu"):
        stub.dual_gemm_swiglu(None, None)
    assert "cutlass" not in STUB.read_text().split('"""', 2)[2]  # imported nowhere below the docstring


# --- the builder ---------------------------------------------------------------------------------


def test_carry_size_check_refuses_a_kit_over_the_limit():
    assert "64.0 MiB of the 64.0 MiB" in gpu_kit.check_carry_size(60 * MIB, 4 * MIB)
    with pytest.raises(gpu_kit.KitError, match=r"64\.0 MiB of the 64\.0 MiB a device run carries: over the limit"):
        gpu_kit.check_carry_size(60 * MIB, 4 * MIB + 1)
    with pytest.raises(gpu_kit.KitError, match="over the limit by 10.0 MiB"):
        gpu_kit.check_carry_size(10 * MIB, 4 * MIB, limit=4 * MIB)


def test_working_tree_counts_tracked_and_untracked_files_not_ignored_ones(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/gpu-kit/\n")
    (tmp_path / "tracked.py").write_bytes(b"x" * 100)
    subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
    (tmp_path / "untracked.txt").write_bytes(b"y" * 7)
    (tmp_path / "gpu-kit").mkdir()
    (tmp_path / "gpu-kit" / "big.whl").write_bytes(b"z" * 5000)
    assert gpu_kit.working_tree_bytes(tmp_path) == len("/gpu-kit/\n") + 100 + 7


@pytest.mark.parametrize(
    ("path", "kept"),
    [
        ("sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so", False),
        ("sglang/srt/rust_extensions/_grpc.cpython-312-x86_64-linux-gnu.so", False),
        ("sglang/srt/rust_extensions/loader.py", True),
        ("sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-312-x86_64-linux-gnu.so", True),
        ("sglang/multimodal_gen/runtime/x.py", False),
        ("sglang/srt/multimodal/processors/base.py", True),
        ("sglang/test/test_utils.py", False),
        ("sglang/srt/server_args.py", True),
    ],
)
def test_sglang_trim_rules(path, kept):
    assert gpu_kit.sglang_keeps(path) is kept


@pytest.mark.parametrize(
    ("path", "kept"),
    [
        ("flashinfer_python-0.7.2.dist-info/METADATA", True),
        ("flashinfer/prefill.py", True),  # a top-level module
        ("flashinfer/jit/attention/modules.py", True),  # a JIT generator
        ("flashinfer/comm/mnnvl.py", True),  # imported by the trace
        ("flashinfer/comm/unused.py", False),
        ("flashinfer/experimental/b12x/kernel.py", False),
        ("flashinfer/data/include/flashinfer/page.cuh", True),
        ("flashinfer/data/cutlass/include/cute/tensor.hpp", True),
        ("flashinfer/data/csrc/batch_prefill.cu", True),
        ("flashinfer/data/csrc/fused_moe/kernel.cu", False),
        ("flashinfer/data/build_backend.py", False),
    ],
)
def test_flashinfer_trim_rules(path, kept):
    assert gpu_kit.flashinfer_keeper({"flashinfer/comm/mnnvl.py"})(path) is kept


def make_wheel(path: Path) -> Path:
    files = [
        ("pkg/__init__.py", b"A = 1\n"),
        ("pkg/data/a,b=1.json", b"{}"),  # SGLang ships names with commas: the RECORD must quote them
        ("pkg/drop/me.py", b"B = 2\n"),
        ("pkg-1.0.dist-info/METADATA", b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n"),
        ("pkg-1.0.dist-info/WHEEL", b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"),
    ]
    gpu_kit.write_wheel(path, files)
    return path


def test_trimmed_wheels_keep_what_is_asked_with_a_record_of_exactly_their_files(tmp_path):
    source = make_wheel(tmp_path / "pkg-1.0-py3-none-any.whl")
    (tmp_path / "out").mkdir()
    trimmed = gpu_kit.trim_wheel(source, tmp_path / "out", lambda name: "/drop/" not in name, {"pkg/__init__.py": b"A = 2\n"})
    assert (trimmed.kept, trimmed.dropped, trimmed.replaced) == (5, 1, ["pkg/__init__.py"])
    with zipfile.ZipFile(trimmed.wheel) as archive:
        names = archive.namelist()
        assert "pkg/drop/me.py" not in names and archive.read("pkg/__init__.py") == b"A = 2\n"
        rows = list(csv.reader(io.StringIO(archive.read("pkg-1.0.dist-info/RECORD").decode())))
        for name, digest, size in rows[:-1]:
            assert gpu_kit.record_row(name, archive.read(name)) == (name, digest, int(size))
        assert sorted(row[0] for row in rows) == sorted(names)
    with pytest.raises(gpu_kit.KitError, match="has no"):
        gpu_kit.trim_wheel(source, tmp_path / "out", lambda name: True, {"pkg/absent.py": b""})


def test_the_standin_wheel_installs_the_standin_package(tmp_path):
    wheel = gpu_kit.standin_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {f"sgl_kernel/{name}.py" for name in ("__init__", "_unavailable", *CUDA_SUBMODULE_NAMES)} <= names
    assert f"{gpu_kit.STANDIN_DISTRIBUTION[0]}-{gpu_kit.STANDIN_DISTRIBUTION[1]}.dist-info/RECORD" in names


# --- the smoke run -------------------------------------------------------------------------------


def test_a_dry_run_reports_every_check_in_order(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "SMOKE_WORK": str(tmp_path / "work")}
    result = subprocess.run(["bash", "tools/gpu_smoke.sh", "--dry-run"], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (tmp_path / "out" / "gpu_smoke.md").read_text()
    checks = [line.split("**")[1] for line in report.splitlines() if line.startswith("- **")]
    assert checks == [
        "install", "imports", "model", "stock", "full", "snapkv", "snapkv-eager",
        "(a) capture full", "(a) capture snapkv", "(b) tokens full vs stock", "(b) tokens snapkv-eager vs snapkv",
        "(b) stats snapkv", "(b) stats snapkv-eager", "(c) syncs", "(d) ITL", "(f) Gemma 3 local layers", "(e) kernel tests",
        "decode step benchmark (issue 38)", "evaluate (issue 48)",
    ]  # fmt: skip
    assert "(c) syncs** NOT RUN: no syncs of the stock server / syncs of the snapkv server" in report
    assert (tmp_path / "out" / "logs.tar.gz").exists()


def test_the_step_runner_reports_a_failure_and_goes_on(tmp_path):
    report = gpu_smoke.Report(tmp_path / "report.md", ["# test"])
    ran = []

    def fails():
        raise RuntimeError("server exited\nValueError: the real reason")

    steps = [
        gpu_smoke.Step("first", fails, 0),
        gpu_smoke.Step("second", lambda: ran.append("second") or [gpu_smoke.Line("second", "PASS", "ok")], 0),
        gpu_smoke.Step("after first", lambda: ran.append("after first") or [], 0, ("first",)),
        gpu_smoke.Step("too long", lambda: ran.append("too long") or [], 10_000),
    ]
    passed = gpu_smoke.run_steps(steps, report, gpu_smoke.Budget(100))
    assert ran == ["second"] and passed == {"first": False, "second": True, "after first": False, "too long": False}
    text = (tmp_path / "report.md").read_text()
    assert "- **first** FAIL: RuntimeError: ValueError: the real reason" in text
    assert "- **after first** NOT RUN: needs first, which did not pass" in text
    assert "- **too long** NOT RUN:" in text and "it needs 10000 s" in text


TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8, "initializer_range": 0.02, "tie_word_embeddings": True, "rms_norm_eps": 1e-5}  # fmt: skip


def test_every_smoke_server_command_is_accepted_by_the_launcher_and_sglang(tmp_path):
    """The flags each smoke server gets on a GPU (no CPU mode), through the launcher's checks, then the
    resulting SGLang command line through SGLang's own parser."""
    from sgl_kvevict.server.flags import parse_args
    from sgl_kvevict.server.refusals import check_chunked_prefill, check_cpu_graphs
    from sgl_kvevict.server.worker import sglang_args

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    commands = []
    for plan in gpu_smoke.SERVER_PLANS:
        config = parse_args(["--model", str(tmp_path), *plan.flags, *gpu_smoke.common_flags(rehearsal=False)])
        args = sglang_args(config, cpu_mode=False)
        if config.serving.enabled:
            check_chunked_prefill(config.serving, args)
            check_cpu_graphs(config.serving, args, cpu_mode=False)
        commands.append(["--model-path", str(tmp_path), *args])
    result = run_python(
        "import json, sys\n"
        "from sgl_kvevict.compat import activate_cpu_mode\n"
        "activate_cpu_mode()\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    a = prepare_server_args(argv)\n"
        "    print(a.attention_backend, a.sampling_backend, a.cuda_graph_backend_decode, a.cuda_graph_backend_prefill,"
        " a.cuda_graph_max_bs_decode, a.radix_cache_backend)\n",
        args=[json.dumps(commands)],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    graphs = "None"  # left to SGLang, whose CUDA default captures decode graphs; the eager server turns them off
    assert result.stdout.split("\n")[:4] == [
        f"flashinfer pytorch {graphs} disabled 8 None",
        f"flashinfer pytorch {graphs} disabled 8 sgl_kvevict",
        f"flashinfer pytorch {graphs} disabled 8 sgl_kvevict",
        "flashinfer pytorch disabled disabled 8 sgl_kvevict",
    ]


def replies(*sequences: tuple[list[int], list[float], list[list[float]]]) -> dict:
    return {"replies": [{"output_ids": ids, "token_logprobs": lps, "top2": top} for ids, lps, top in sequences]}


def test_token_comparison_passes_equal_tokens_and_tie_flips_only():
    stock = replies(([1, 2, 3], [-1.0, -1.0, -1.0], [[-1.0, -3.0], [-1.0, -1.01], [-1.0, -4.0]]))
    assert gpu_smoke.compare_tokens(stock, stock)[0] == "PASS"
    tie = replies(([1, 9, 9], [-1.0, -1.02, -2.0], [[]] * 3))  # diverges at step 1, where stock's margin is 0.01
    status, detail = gpu_smoke.compare_tokens(stock, tie)
    assert status == "PASS" and "near-ties" in detail and "request 0 at step 1" in detail
    wrong = replies(([9, 2, 3], [-1.0, -1.0, -1.0], [[]] * 3))  # diverges at step 0, margin 2.0
    assert gpu_smoke.compare_tokens(stock, wrong)[0] == "FAIL"
    drift = replies(([1, 2, 3], [-1.0, -1.5, -1.0], [[]] * 3))  # same tokens, scored far apart
    assert gpu_smoke.compare_tokens(stock, drift)[0] == "FAIL"


def test_the_random_checkpoint_loads_in_transformers_with_every_weight(tmp_path):
    from transformers import LlamaForCausalLM

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps(TINY_LLAMA))
    (tmp_path / "config" / "tokenizer.json").write_text("{}")
    out = gpu_smoke.write_random_checkpoint(tmp_path / "config", tmp_path / "model", {"num_hidden_layers": 3})
    assert (out / "tokenizer.json").exists() and json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3
    model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and len(model.model.layers) == 3
    weight = model.model.layers[2].mlp.down_proj.weight.float()
    assert 0.015 < weight.std().item() < 0.025 and (model.model.norm.weight == 1).all()


def test_capture_and_pool_lines_parse():
    # As SGLang 0.5.23 logs them (model_runner_components/cuda_graph_setup.py, managers/scheduler.py).
    log = (
        "Capture target decode CUDA graph end. bs=[1, 2, 4, 8], elapsed=3.25 s, mem usage=0.41 GB, avail mem=70.02 GB.\n"
        "max_total_num_tokens=2812345, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=4096, "
        "context_len=8192, available_gpu_mem=9.87 GB\n"
    )

    class Server:
        def log(self):
            return log

    found = gpu_smoke.measure_capture(None, None, Server())
    assert found == {"captured": True, "batch_sizes": "[1, 2, 4, 8]", "seconds": 3.25, "mem_usage_gb": 0.41,
                     "avail_after_gb": 70.02, "pool_tokens": 2812345, "available_gpu_gb": 9.87}  # fmt: skip


def test_the_checks_judge_what_the_servers_measured():
    """(a)-(d) from measurements as a GPU run would report them (a CPU rehearsal has no capture or graphs)."""
    capture = {"captured": True, "batch_sizes": "[1, 2, 4, 8]", "seconds": 3.0, "mem_usage_gb": 0.4, "avail_after_gb": 70.0,
               "pool_tokens": 1000, "available_gpu_gb": 9.0}  # fmt: skip
    tokens = replies(([1, 2], [-1.0, -1.0], [[-1.0, -2.0], [-1.0, -2.0]]))
    stats = {"requests_compressed": 4, "graph_decodes": 250, "decode_graph_fallbacks": 0, "overlap_waits": 4}
    results = {
        "stock": {"capture": capture, "tokens": tokens, "syncs": {"forwards": 63, "calls_per_forward": 3.0, "compressed_nodes": None},
                  "itl": {"batch_1_ms": 4.0, "batch_8_ms": 5.0}},
        "full": {"capture": capture, "tokens": tokens},
        "snapkv": {"capture": {"captured": False}, "tokens": tokens, "stats": stats,
                   "syncs": {"forwards": 63, "calls_per_forward": 7.5, "compressed_nodes": 1}, "itl": {"batch_1_ms": 5.0, "batch_8_ms": 5.0}},
        "snapkv-eager": {"tokens": tokens, "stats": {**stats, "graph_decodes": 0, "decode_graph_fallbacks": 2}},
    }  # fmt: skip
    lines = {line.check: line for line in gpu_smoke.checks(results, on_gpu=True)}
    assert {check: line.status for check, line in lines.items()} == {
        "(a) capture full": "PASS", "(a) capture snapkv": "FAIL", "(b) tokens full vs stock": "PASS",
        "(b) tokens snapkv-eager vs snapkv": "PASS", "(b) stats snapkv": "PASS", "(b) stats snapkv-eager": "FAIL",
        "(c) syncs": "FAIL", "(d) ITL": "INFO",
    }  # fmt: skip
    assert "capture used 0.40 GB (stock 0.4)" in lines["(a) capture full"].detail
    assert "snapkv 7.50 syncing calls" in lines["(c) syncs"].detail and "(1 compressed nodes)" in lines["(c) syncs"].detail
    assert "batch 1: snapkv 5.00 ms, stock 4.00 ms (x1.25)" in lines["(d) ITL"].detail
    results["snapkv"]["syncs"] = {"forwards": 63, "calls_per_forward": 6.5, "compressed_nodes": 1}
    assert gpu_smoke.check_syncs(results)[0].status == "PASS"
    results["snapkv"]["syncs"]["compressed_nodes"] = 0  # the prompt stayed dense: nothing was measured
    assert gpu_smoke.check_syncs(results)[0].status == "FAIL"


def test_the_gemma3_line_judges_full_against_stock_the_trim_and_the_reuse():
    turns = replies(([1, 2], [-1.0, -1.0], [[-1.0, -2.0], [-1.0, -2.0]]))
    stock = {**turns, "cached_tokens": [300, 300], "pool_tokens": 5000}
    stats = {"compressed_tokens": 600, "arena_cells_per_slot": 6, "kept_cells": 1200}
    results = {"stock": stock, "full": {**stock, "pool_tokens": 4990}, "stats": stats}
    line = gpu_smoke.check_gemma3(results)
    assert line.status == "PASS" and line.check == "(f) Gemma 3 local layers"
    assert "kept share 0.33 of 600 compressed prompt tokens' KV" in line.detail and "KV pool 4990 tokens (stock 5000)" in line.detail
    untrimmed = {**results, "stats": {**stats, "kept_cells": 3600}}  # local layers kept whole: no trim
    no_reuse = {**results, "full": {**results["full"], "cached_tokens": [300, 0]}}
    diverged = {**results, "full": {**results["full"], **replies(([1, 3], [-1.0, -1.0], [[-1.0, -2.0], [-1.0, -2.0]]))}}
    for failing in (untrimmed, no_reuse, diverged):
        assert gpu_smoke.check_gemma3(failing).status == "FAIL"
    missing = gpu_smoke.check_gemma3({"stock": stock})
    assert missing.status == "NOT RUN" and missing.detail == "no full / stats"


def test_a_rehearsal_reports_what_needs_a_gpu_as_not_on_cpu_and_passes_on_the_rest(tmp_path):
    """On CPU: no capture and no graph replays to judge, the kernel tests not run; what a CPU runs is still
    judged. On a GPU the same measurements FAIL. The exit code counts FAIL lines only."""
    tokens = replies(([1, 2], [-1.0, -1.0], [[-1.0, -2.0], [-1.0, -2.0]]))
    eager = {"requests_compressed": 4, "graph_decodes": 0, "decode_graph_fallbacks": 0, "overlap_waits": 4}
    results = {
        "stock": {"capture": {"captured": False}, "tokens": tokens},
        "full": {"capture": {"captured": False}, "tokens": tokens},
        "snapkv": {"capture": {"captured": False}, "tokens": tokens, "stats": eager},
        "snapkv-eager": {"tokens": tokens, "stats": eager},
    }  # fmt: skip
    on_cpu = {line.check: line for line in gpu_smoke.checks(results, on_gpu=False)}
    on_gpu = {line.check: line for line in gpu_smoke.checks(results, on_gpu=True)}
    assert [on_cpu[f"(a) capture {name}"].status for name in ("full", "snapkv")] == [gpu_smoke.NOT_ON_CPU] * 2
    assert [on_gpu[f"(a) capture {name}"].status for name in ("full", "snapkv")] == ["FAIL"] * 2
    assert on_cpu["(b) stats snapkv"].status == "PASS" and "graph replays: not on CPU" in on_cpu["(b) stats snapkv"].detail
    assert on_gpu["(b) stats snapkv"].status == "FAIL"  # a GPU server with graphs on must replay them
    results["snapkv"]["stats"] = {**eager, "decode_graph_fallbacks": 1}
    assert {line.check: line.status for line in gpu_smoke.checks(results, on_gpu=False)}["(b) stats snapkv"] == "FAIL"

    smoke = gpu_smoke.Smoke(out=tmp_path, work=tmp_path, model=tmp_path, workload=None, rehearsal=True, budget=gpu_smoke.Budget(60))
    kernels = gpu_smoke.kernel_tests_step(smoke)  # returns at once: no pytest started
    assert [(line.check, line.status) for line in kernels] == [("(e) kernel tests", gpu_smoke.NOT_ON_CPU)]

    Line = gpu_smoke.Line
    rehearsal = [Line("imports", "PASS", ""), Line("model", "INFO", ""), *on_cpu.values(), *kernels]
    assert {line.status for line in rehearsal} == {"PASS", "INFO", "NOT RUN", gpu_smoke.NOT_ON_CPU}  # (c), (d): not measured here
    assert gpu_smoke.exit_code(rehearsal) == 0
    assert gpu_smoke.exit_code([*rehearsal, Line("(c) syncs", "FAIL", "")]) == 1


def random_model(folder: Path) -> Path:
    """A tiny Llama with random weights, as the smoke run writes its own: no learned weights fit it."""
    (folder / "config").mkdir(parents=True)
    (folder / "config" / "config.json").write_text(json.dumps(TINY_LLAMA))
    return gpu_smoke.write_random_checkpoint(folder / "config", folder / "model")


def test_the_evaluate_slot_runs_the_command_on_the_smoke_model_with_the_gpu_flags(tmp_path):
    """Issue 48's command in the smoke run: it parses in the command's own parser, on the run's model with
    the smoke servers' GPU flags, a candidate whose score needs no weights, its report in $OUT."""
    from sgl_kvevict.evaluate.__main__ import build_parser

    smoke = gpu_smoke.Smoke(out=tmp_path / "out", work=tmp_path / "work", model=random_model(tmp_path), workload=None,
                            rehearsal=False, budget=gpu_smoke.Budget(60))  # fmt: skip
    command = gpu_smoke.evaluate_command(smoke)
    assert command[1:3] == ["-m", "sgl_kvevict.evaluate"]
    args = build_parser().parse_args(command[3:])
    assert args.model == str(smoke.model) and str(args.out) == str(tmp_path / "out")
    assert args.server_arg == gpu_smoke.common_flags(rehearsal=False)
    assert args.policies == f"topk:{gpu_smoke.DECODE_STEP_SCORE}" and args.no_full
    short = gpu_smoke.Smoke(out=tmp_path, work=tmp_path, model=tmp_path, workload=None, rehearsal=False, budget=gpu_smoke.Budget(10))
    [line] = gpu_smoke.evaluate_step(short)
    assert (line.check, line.status) == (gpu_smoke.EVALUATE_SLOT, "NOT RUN")


def test_the_decode_step_slot_runs_the_quick_benchmark_on_the_smoke_model_with_the_gpu_flags(tmp_path):
    """Issue 38's per-step benchmark in the smoke run: its command parses in the benchmark's own parser,
    short (--quick), on the run's model, every server with the smoke servers' GPU flags, report in $OUT;
    its compressing servers rank by a score that needs no weights, so the launcher's checks (learned
    weights included) accept every server on a random model, where the default learned score is refused."""
    from benchmarks import decode_step

    smoke = gpu_smoke.Smoke(out=tmp_path / "out", work=tmp_path / "work", model=random_model(tmp_path), workload=None,
                            rehearsal=False, budget=gpu_smoke.Budget(60))  # fmt: skip
    command = gpu_smoke.decode_step_command(smoke)
    assert command[1:3] == ["-m", "benchmarks.decode_step"]
    parser = decode_step.build_parser()
    args = parser.parse_args(command[3:])
    assert args.quick and args.model == str(smoke.model) and args.out == tmp_path / "out"
    assert args.server_arg == gpu_smoke.common_flags(rehearsal=False)
    parser.set_defaults(**decode_step.QUICK)
    config = decode_step.config_from_args(parser.parse_args(command[3:]))
    assert config.score == gpu_smoke.DECODE_STEP_SCORE != decode_step.LEARNED_SCORE
    assert {decode_step.KEEP_ALL, "default-block"} <= set(config.variants)  # the ratios against keep-99 need it
    decode_step.check_servers(config)
    for name in config.variants:
        flags = decode_step.server_variant(name, config.score).launcher_flags()
        assert not any("learned" in flag for flag in flags), flags
    learned = decode_step.config_from_args(parser.parse_args([*command[3:], "--score", "learned"]))
    with pytest.raises(decode_step.ServerError, match="keep-99: --kv-evict-score learned: score 'learned' has no bundled weights"):
        decode_step.check_servers(learned)
