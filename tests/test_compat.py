"""The CPU development mode: the sgl_kernel stand-in and when it is (not) activated.

Each check runs in a fresh interpreter: the mode changes sys.modules and the torch op registry.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from sgl_kvevict.compat import assign_req_to_token_pool_cpu


def run_python(code: str, *, pythonpath: str | None = None) -> str:
    env = None
    if pythonpath:
        import os

        env = dict(os.environ, PYTHONPATH=pythonpath)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_standin_provides_every_imported_name_and_sglang_imports():
    out = run_python(
        """
        from sgl_kvevict.compat import activate_cpu_mode
        from sgl_kvevict.compat.sgl_kernel_names import IMPORTED_NAMES
        assert activate_cpu_mode()
        import os, sgl_kernel
        assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
        missing = [n for n in IMPORTED_NAMES if not callable(getattr(sgl_kernel, n, None))]
        assert not missing, missing
        try:
            sgl_kernel.flash_mla_decode()
        except NotImplementedError as error:
            assert "sgl_kernel.flash_mla_decode" in str(error) and "CPU development mode" in str(error)
        else:
            raise AssertionError("a stand-in without implementation must raise")
        try:
            import sgl_kernel.scalar_type
        except ImportError:
            pass  # submodules stay absent so SGLang takes its own ImportError fallbacks
        else:
            raise AssertionError("sgl_kernel.scalar_type must not be importable")
        import torchvision
        from sglang.srt.layers.quantization.utils import scalar_types
        from sglang.srt.mem_cache.allocation import alloc_for_extend
        from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_func
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_a_real_sgl_kernel_is_never_shadowed(tmp_path):
    real = tmp_path / "sgl_kernel"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    out = run_python(
        """
        from sgl_kvevict.compat import activate_cpu_mode, cpu_mode_needed
        assert not cpu_mode_needed()
        assert not activate_cpu_mode()
        import sgl_kernel
        print(sgl_kernel.REAL)
        """,
        pythonpath=str(tmp_path),
    )
    assert out.strip() == "True"


@pytest.mark.parametrize("seed", [0, 1])
def test_assign_req_to_token_pool_cpu_matches_a_loop(seed):
    generator = torch.Generator().manual_seed(seed)
    req_to_token = torch.zeros(6, 40, dtype=torch.int32)
    rows = torch.tensor([4, 1, 3])
    starts = torch.randint(0, 10, (3,), generator=generator)
    ends = starts + torch.randint(0, 20, (3,), generator=generator)
    out_cache_loc = torch.randint(1, 1000, (int((ends - starts).sum()),), generator=generator)

    expected = req_to_token.clone()
    offset = 0
    for row, start, end in zip(rows.tolist(), starts.tolist(), ends.tolist()):
        for position in range(start, end):
            expected[row, position] = out_cache_loc[offset]
            offset += 1

    assign_req_to_token_pool_cpu(rows, req_to_token, starts, ends, out_cache_loc, req_to_token.shape[1])
    assert torch.equal(req_to_token, expected)


def test_skipped_model_modules_are_summarised_in_one_line_before_the_next_record():
    """SGLang's registry warns once per model module it cannot import; the CPU mode turns a burst of
    them into one line, logged before the process's next record, and lets the registry's other
    records through. (The real burst: tests/test_server_e2e.py reads a stock server's log.)"""
    out = run_python(
        """
        import logging, sys
        from sgl_kvevict.compat import activate_cpu_mode
        assert activate_cpu_mode() and activate_cpu_mode()  # twice: one filter, one summary
        logging.basicConfig(stream=sys.stdout, format="%(name)s|%(message)s", level=logging.INFO)
        registry = logging.getLogger("sglang.srt.models.registry")
        for module, error in (("grok", "no fused_moe_router_cpu"), ("mamba", "cannot import name 'x'")):
            registry.warning(f"Ignore import error when loading sglang.srt.models.{module}: {error}")
        registry.warning("No model architectures are specified")
        logging.getLogger("sglang.srt.model_executor").info("Load weight begin.")
        registry.warning("Ignore import error when loading sglang.srt.models.qwen3_5: no fused_sigmoid_mul_cpu")
        logging.getLogger("sglang.srt.managers").info("ready")
        """
    )
    summary = "SGLang model modules skipped on CPU (they need CUDA ops or packages the CPU development mode lacks"
    assert "Ignore import error" not in out
    assert out.splitlines() == [
        f"sgl_kvevict.compat.skipped_models|2 {summary}; other models are unaffected): grok, mamba",
        "sglang.srt.models.registry|No model architectures are specified",
        "sglang.srt.model_executor|Load weight begin.",
        f"sgl_kvevict.compat.skipped_models|1 {summary}; other models are unaffected): qwen3_5",
        "sglang.srt.managers|ready",
    ]
