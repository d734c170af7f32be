"""Every Triton kernel compiles to a cubin for the GPUs the project targets, on this CPU-only machine.

Triton's NVIDIA backend (its LLVM and the ptxas shipped in the triton wheel) needs no GPU to compile:
a compile-only driver names the target, and each public op runs its Python wrapper on CPU tensors
with every launch turned into a warm-up (compile, no launch). That catches what the interpreter
cannot: constructs the compiler rejects (the interpreter runs any Python), type errors of the lowered
IR, and resources: shared memory over the SM's limit (a launch failure on the GPU), registers and
spills (``ptxas -v`` on the kernel's PTX). It says nothing about numerics or speed on a GPU.

The compilation runs in a fresh process (``python tests/test_kernels_compile.py SM``), which must not
have the interpreter on and whose patched Triton driver must not leak into other tests.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Compute capability -> the largest dynamic shared memory one block may use (CUDA programming guide,
# "Technical Specifications per Compute Capability").
TARGETS = {90: 227 * 1024, 80: 163 * 1024}  # H100/H200, A100
KERNEL_MODULES = ("compaction", "merge_states", "segment_attention", "window_scores")


def compile_every_kernel(capability: int) -> list[dict]:
    """Compile each kernel at the variants the public ops launch; returns one record per compilation."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class CompileOnlyDriver:
        """The driver calls ``JITFunction.run`` makes before compiling, for a GPU that is not here."""

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(CompileOnlyDriver())
    compiled = []  # (case label, KV dtype, compiled kernel)
    launch = JITFunction.run
    for label, dtype, run_case in compile_cases(torch):

        def compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
            compiled.append((label, str(dtype), launch(self, *args, grid=grid, warmup=True, **kwargs)))

        JITFunction.run = compile_instead_of_launch
        run_case()

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(capability).path
    records = []
    for label, dtype, kernel in compiled:
        # ptxas -v on the kernel's own PTX reports what Triton's compilation got: registers and spills.
        ptx = kernel.asm["ptx"]
        arch = re.search(r"^\.target (sm_\w+)", ptx, re.M).group(1)
        with tempfile.TemporaryDirectory() as folder:
            source = Path(folder) / "kernel.ptx"
            source.write_text(ptx)
            report = subprocess.run(
                [ptxas, "-v", f"-arch={arch}", str(source), "-o", str(source.with_suffix(".cubin"))],
                capture_output=True, text=True, check=True,
            ).stderr  # fmt: skip
        records.append(
            dict(
                name=kernel.name, case=label, dtype=dtype, capability=capability, shared=kernel.metadata.shared,
                num_warps=kernel.metadata.num_warps, num_stages=kernel.metadata.num_stages,
                registers=int(re.search(r"Used (\d+) registers", report).group(1)),
                spill_bytes=int(re.search(r"(\d+) bytes spill stores", report).group(1)),
            )  # fmt: skip
        )
    return records


def compile_cases(torch):
    """``(label, KV dtype, call)`` of every public op at serving-like shapes, covering each kernel's
    constexpr variants (shapes of an 8-KV-head, 32-query-head, head-dim-128 model)."""
    from sgl_kvevict.kernels.compaction import copy_kv_rows_triton
    from sgl_kvevict.kernels.merge_states import merge_attention_states_triton, merge_split_states_triton
    from sgl_kvevict.kernels.segment_attention import segment_attention_triton
    from sgl_kvevict.kernels.window_scores import CompressedCells, window_stats_triton
    from sgl_kvevict.scoring.window import StatsRequest

    every_stat = StatsRequest(
        attn_sum=True, attn_max=True, tail_rows=2, obc_value=True, obc_key=True, obc_joint=True, value_l1=True
    )

    def window(dtype, window_len, request, compressed: bool, head_dim_v: int = 128, index=torch.int32):
        """index: dtype of the cell ids, positions and head_indptr (the engine may pass int32 or int64)."""
        q = torch.zeros(32, window_len, 128, dtype=dtype)
        k_buffer = torch.zeros(4096, 8, 128, dtype=dtype)
        v_buffer = torch.zeros(4096, 8, head_dim_v, dtype=dtype)
        kv_indices = torch.arange(window_len + 64, dtype=torch.int32)
        if not compressed:
            return lambda: window_stats_triton(q, k_buffer, v_buffer, kv_indices, 0.1, request)
        cells = CompressedCells(
            torch.zeros(1000, 128, dtype=dtype), torch.zeros(1000, head_dim_v, dtype=dtype),
            torch.arange(800, dtype=index), torch.arange(800, dtype=index), torch.arange(9, dtype=index) * 100,
        )  # fmt: skip
        positions = kv_indices.long() + 1000
        return lambda: window_stats_triton(
            q, k_buffer, v_buffer, kv_indices, 0.1, request, key_positions=positions,
            context_length=window_len + 1064, cells=cells,
        )  # fmt: skip

    def segment(dtype, group, q_lens, num_kv_splits, index=torch.int32):
        q = torch.zeros(sum(q_lens), 8 * group, 128, dtype=dtype)
        rows = torch.zeros(4096, 128, dtype=dtype)
        qo_indptr = torch.tensor([0, *q_lens]).cumsum(0).int()
        kv_indptr = torch.arange(8 * len(q_lens) + 1, dtype=index) * 100
        kv_indices = torch.arange(int(kv_indptr[-1]), dtype=index)
        return lambda: segment_attention_triton(
            q, rows, rows, qo_indptr, kv_indptr, kv_indices, 8, 0.1, max(q_lens), num_kv_splits=num_kv_splits
        )

    def merge(dtype):
        out, lse = torch.zeros(16, 32, 128, dtype=dtype), torch.zeros(16, 32)
        return lambda: merge_attention_states_triton(out, lse, out, lse)

    def merge_splits(dtype):
        partial_out, partial_lse = torch.zeros(4, 16, 32, 128), torch.zeros(4, 16, 32)
        out, lse = torch.zeros(16, 32, 128, dtype=dtype), torch.zeros(16, 32)
        return lambda: merge_split_states_triton(partial_out, partial_lse, out, lse)

    def copy(dtype, head_dim, head_dim_v):
        k, v = torch.zeros(1000, head_dim, dtype=dtype), torch.zeros(1000, head_dim_v, dtype=dtype)
        rows = torch.arange(100)
        return lambda: copy_kv_rows_triton(k, v, k, v, rows, rows + 500)

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    every = every_stat
    return [
        ("window attn_sum w32", bf16, window(bf16, 32, StatsRequest(attn_sum=True), compressed=False)),
        ("window every stat w32 cells Dv64 int64", bf16, window(bf16, 32, every, True, 64, torch.int64)),
        ("window attn_max w2048 cells", bf16, window(bf16, 2048, StatsRequest(attn_max=True), compressed=True)),
        ("window attn_sum+l1 w32", fp16, window(fp16, 32, StatsRequest(attn_sum=True, value_l1=True), False)),
        ("window every stat w32", fp32, window(fp32, 32, every, compressed=False)),
        ("segment decode B4 G4", bf16, segment(bf16, 4, [1] * 4, num_kv_splits=1)),
        ("segment decode B1 G4 16 splits int64", bf16, segment(bf16, 4, [1], 16, torch.int64)),
        ("segment extend 200 G8", fp16, segment(fp16, 8, [200], num_kv_splits=1)),
        ("segment extend G1 2 splits", fp32, segment(fp32, 1, [3, 1], num_kv_splits=2)),
        ("merge", bf16, merge(bf16)),
        ("merge", fp32, merge(fp32)),
        ("merge splits", bf16, merge_splits(bf16)),
        ("merge splits", fp32, merge_splits(fp32)),
        ("copy rows D128", bf16, copy(bf16, 128, 128)),
        ("copy rows D64 Dv128", fp32, copy(fp32, 64, 128)),
    ]


def jit_kernel_names() -> set[str]:
    """Names of every ``@triton.jit`` kernel (``_..._kernel``) of the package's kernel modules."""
    import importlib

    from triton.runtime.jit import JITFunction

    names = set()
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(f"sgl_kvevict.kernels.{module_name}")
        names |= {
            name for name, value in vars(module).items() if isinstance(value, JITFunction) and name.endswith("_kernel")
        }
    return names


@pytest.mark.parametrize("capability", sorted(TARGETS), ids=lambda c: f"sm_{c}")
def test_every_kernel_compiles_for_the_target_gpus(capability: int, tmp_path: Path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile, never reuse a cached cubin
    result = subprocess.run(
        [sys.executable, __file__, str(capability)], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-6000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert {record["name"] for record in records} == jit_kernel_names()
    for record in records:
        assert record["shared"] <= TARGETS[capability], record  # more fails every launch of it
        # Registers spilled to local memory, at the serving dtypes. fp32 KV (tests, debugging) multiplies
        # in IEEE fp32 on CUDA cores, whose operand tiles do not fit in registers: it spills, knowingly.
        if record["dtype"] != "torch.float32":
            assert record["spill_bytes"] == 0, record


if __name__ == "__main__":
    for record in compile_every_kernel(int(sys.argv[1])):
        print(json.dumps(record))
