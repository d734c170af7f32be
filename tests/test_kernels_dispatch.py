"""Dispatch: Triton on CUDA, torch on CPU, the Triton interpreter on CPU only with TRITON_INTERPRET=1 set in time."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from sgl_kvevict.kernels import dispatch, runtime
from sgl_kvevict.kernels.merge_states import merge_attention_states_torch
from sgl_kvevict.kernels.segment_attention import segment_attention_torch
from sgl_kvevict.kernels.window_scores import CompressedCells, window_stats_torch
from sgl_kvevict.scoring.window import StatsRequest


SET_INTERPRET = "import os; os.environ['TRITON_INTERPRET'] = '1'"


@pytest.mark.parametrize(
    "code_before_kernels, expected",
    [
        ("", "False"),
        (SET_INTERPRET, "True"),  # set before triton's first import: the interpreter is on
        (f"import triton; {SET_INTERPRET}", "ImportError"),  # too late: refused with an explanation
    ],
    ids=["unset", "set-before-import", "set-after-import"],
)
def test_interpreter_mode_is_read_when_triton_is_first_imported(code_before_kernels: str, expected: str):
    code = f"{code_before_kernels}\nfrom sgl_kvevict.kernels import runtime\nprint(runtime.TRITON_INTERPRETED)"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if expected == "ImportError":
        assert result.returncode != 0 and "before the first `import triton`" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == expected


def test_cuda_always_uses_triton_and_cpu_only_in_the_interpreter():
    assert runtime.use_triton(torch.device("cuda", 0))
    assert runtime.use_triton(torch.device("cpu")) == runtime.TRITON_INTERPRETED


def test_public_ops_run_the_torch_twins_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(dispatch, "use_triton", lambda device: False)
    generator = torch.Generator().manual_seed(0)
    q_window = torch.randn(4, 3, 16, generator=generator)
    k_buffer, v_buffer = torch.randn(2, 9, 2, 16, generator=generator)
    kv_indices = torch.tensor([3, 1, 7, 5, 8])
    request = StatsRequest(attn_sum=True, value_l1=True)
    stats = dispatch.window_stats_paged(q_window, k_buffer, v_buffer, kv_indices, 0.25, request)
    expected = window_stats_torch(q_window, k_buffer, v_buffer, kv_indices, 0.25, request)
    assert torch.equal(stats.attn_sum, expected.attn_sum) and torch.equal(stats.value_l1, expected.value_l1)

    # a compressed prefix: dense keys at positions 4..8, KV head 0 keeps cells at positions 1 and 3
    arena = torch.randn(6, 16, generator=generator)
    cells = CompressedCells(arena, arena, torch.tensor([5, 2]), torch.tensor([1, 3]), torch.tensor([0, 2, 2]))
    positions = torch.arange(4, 9)
    stats = dispatch.window_stats_paged(q_window, k_buffer, v_buffer, kv_indices, 0.25, request, positions, 9, cells)
    expected = window_stats_torch(q_window, k_buffer, v_buffer, kv_indices, 0.25, request, positions, 9, cells)
    assert torch.equal(stats.attn_sum, expected.attn_sum) and stats.attn_sum.shape == (4, 9)

    q = torch.randn(2, 4, 16, generator=generator)
    qo_indptr, kv_indptr, kv_indices = torch.tensor([0, 1, 2]), torch.tensor([0, 2, 2, 5, 6]), torch.arange(6)
    out, lse = dispatch.segment_attention(q, arena, arena, qo_indptr, kv_indptr, kv_indices, 2, 0.25, 1, 3)
    expected_out, expected_lse = segment_attention_torch(q, arena, arena, qo_indptr, kv_indptr, kv_indices, 2, 0.25)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)

    destination = torch.zeros(4, 16)
    dispatch.copy_kv_rows(arena, arena, destination, destination, torch.tensor([5, 0]), torch.tensor([1, 3]))
    assert torch.equal(destination[[1, 3]], arena[[5, 0]]) and not destination[[0, 2]].any()

    merged = dispatch.merge_attention_states(out, lse, out, lse)
    assert all(map(torch.equal, merged, merge_attention_states_torch(out, lse, out, lse)))
    assert torch.allclose(merged[0], out) and torch.allclose(merged[1], lse + math.log(2))  # a state merged with itself


GPU_TEST = "tests/test_kernels_segment_attention.py::test_merge_matches_twin_and_naive"


@pytest.mark.parametrize("gpu_tests", ["unset", "1"])
def test_gpu_tests_are_deselected_by_default_and_fail_without_a_gpu(gpu_tests: str):
    """KVEVICT_GPU_TESTS=1 selects the CUDA variants of the kernel tests; without CUDA they fail (never
    skip or pass), and without the variable they are deselected, not skipped."""
    env = {key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", "KVEVICT_GPU_TESTS")}
    if gpu_tests == "1":
        env["KVEVICT_GPU_TESTS"] = "1"
    one_case = "cuda and 5-3-64 and float32"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", one_case, GPU_TEST]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    summary = result.stdout.strip().splitlines()[-1]
    assert "skipped" not in summary, summary
    if gpu_tests == "unset":
        assert result.returncode == pytest.ExitCode.NO_TESTS_COLLECTED and "deselected" in summary, summary
    elif torch.cuda.is_available():
        assert result.returncode == 0 and "1 passed" in summary, result.stdout[-3000:]
    else:
        assert result.returncode == pytest.ExitCode.TESTS_FAILED and "1 error" in summary, summary
        assert "KVEVICT_GPU_TESTS=1 selects the CUDA kernel tests, but torch sees no CUDA device" in result.stdout
