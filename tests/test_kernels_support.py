"""Shared by the kernel tests (holds no tests): interpreter and CUDA harness, tolerances, KV-buffer builders.

Without a GPU the Triton kernels run only in Triton's interpreter, which a process enables by setting
``TRITON_INTERPRET=1`` before its first ``import triton`` (``sgl_kvevict/kernels/runtime.py``); it
also routes every CPU call of ``sgl_kvevict.kernels`` to the slow interpreted kernels. So the test
process itself never turns it on: each kernel test module holds one ``test_in_interpreter_process``
(made by ``interpreter_process_test``) that reruns the module in a fresh process with the variable
set, where its other tests (deselected here) run. ``TRITON_INTERPRET=1 pytest tests/test_kernels_window.py`` runs them directly.

Tests parametrised with ``on_kernel_devices`` run twice: on CPU in the interpreter process (mark
``triton_interpreter``) and compiled on CUDA (mark ``gpu``, selected only by ``KVEVICT_GPU_TESTS=1``,
where a missing CUDA device fails them; ``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sgl_kvevict.kernels import runtime

GPU_TESTS_VARIABLE = "KVEVICT_GPU_TESTS"  # =1 selects the tests marked gpu (tests/conftest.py)

# Interpreter-only tests are deselected (not skipped) in a process without the interpreter, and the
# driver test below is deselected inside the interpreter process: tests/conftest.py applies both marks.
requires_interpreter = pytest.mark.triton_interpreter


# The device a kernel test runs its Triton kernels on: the interpreter on CPU, or compiled on CUDA.
on_kernel_devices = pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=requires_interpreter, id="interpreter"),
        pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    ],
)


def interpreter_process_test(test_file: str):
    """A test that runs ``test_file`` under ``TRITON_INTERPRET=1`` in a fresh process and requires all
    of its interpreter tests to pass, none skipped."""

    @pytest.mark.triton_interpreter_driver
    def test_in_interpreter_process():
        repo = Path(__file__).resolve().parents[1]
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
        # The CUDA tests of the module stay deselected in the interpreter process, whatever this one runs.
        env = {key: value for key, value in os.environ.items() if key != GPU_TESTS_VARIABLE}
        result = subprocess.run(
            command, cwd=repo, env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900
        )
        summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
        assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-8000:]}\n{result.stderr[-2000:]}"
        assert " passed" in summary and "skipped" not in summary, summary
        print(f"{test_file}: {summary}")

    return test_in_interpreter_process


# Tolerance by KV dtype, relative to the largest magnitude of the expected tensor. "fp32 math": results
# computed in fp32 from the same (already rounded) KV values, which agree with the fp32 reference up to
# summation order whatever the KV dtype. "via P @ V": anything that multiplies probabilities by values
# rounds the probabilities to the KV dtype first (as flash attention does), and outputs stored in the
# KV dtype are rounded once more.
TOLERANCE = {
    # dtype: (fp32 math, via P @ V)
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-5, 4e-3),
    torch.bfloat16: (2e-5, 3e-2),
}
DTYPES = list(TOLERANCE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float, scale: float | None = None) -> None:
    """Elementwise ``|a - e| <= tolerance * (|e| + scale)``; infinities must match exactly.

    scale: magnitude the error is measured against, by default the largest finite ``|expected|``.
    """
    actual, expected = actual.float().cpu(), expected.float().cpu()
    if scale is None:
        finite = expected[expected.isfinite()]
        scale = float(finite.abs().max()) if finite.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance * scale)


def random_kv_buffer(
    num_slots: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    live_slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang-layout ``k_buffer``, ``v_buffer`` ``[num_slots, H_kv, D]`` (one layer), random normal.

    With ``live_slots``, every other slot holds NaN, so a kernel that reads outside its slot list fails.
    """
    shape = (num_slots, num_kv_heads, head_dim)
    buffers = []
    for _ in range(2):
        buffer = torch.randn(shape, generator=generator).to(dtype)
        if live_slots is not None:
            live = buffer[live_slots.long()]
            buffer.fill_(float("nan"))
            buffer[live_slots.long()] = live
        buffers.append(buffer)
    return buffers[0], buffers[1]


def scattered_slots(count: int, num_slots: int, generator: torch.Generator) -> torch.Tensor:
    """int32 ``[count]``: distinct slots in random order, never slot 0 (SGLang's padding slot)."""
    return (torch.randperm(num_slots - 1, generator=generator)[:count] + 1).to(torch.int32)


@contextlib.contextmanager
def no_host_sync():
    """Raise on any CUDA call that makes the host wait for the device (torch's sync-debug mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
