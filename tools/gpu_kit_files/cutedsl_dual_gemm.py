"""The GPU kit's replacement for ``sglang/kernels/ops/gemm/cutedsl_dual_gemm.py`` (SGLang 0.5.23).

The real module is a CuTe-DSL kernel for SM100 (Blackwell) that imports ``cutlass`` unguarded, which
the lent H100/H200 machine does not have. On CUDA every Llama MLP imports it
(``sglang/srt/layers/dual_gemm.py``) to ask ``can_use_dual_gemm``, which is False below SM100 there
too; this stub answers that without cutlass and keeps the module's public names, so the kernels'
registry (``sglang/kernels/ops/gemm/__init__.py``) still resolves them.
"""

from __future__ import annotations

from enum import IntEnum

MAX_DUAL_GEMM_DECODE_TOKENS = 16


class DualGemmQuantMode(IntEnum):
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self) -> bool:
        return self is not self.UNQUANT

    @property
    def is_dynamic(self) -> bool:
        return self in (self.DYNAMIC_PER_TENSOR, self.DYNAMIC_PER_TOKEN)

    @property
    def is_per_token(self) -> bool:
        return self in (self.STATIC_PER_TOKEN, self.DYNAMIC_PER_TOKEN)


def can_use_dual_gemm(num_tokens: int, hidden_size: int, intermediate_size: int, quant_mode: DualGemmQuantMode) -> bool:
    """The SM100 kernel never runs here (the real module answers False below SM100 as well)."""
    return False


def _sm100_only(name: str):
    def raise_sm100_only(*args, **kwargs):
        raise NotImplementedError(f"{name}: the SM100 dual-GEMM kernel is not in sgl-kvevict's GPU kit")

    raise_sm100_only.__name__ = name
    return raise_sm100_only


dual_gemm_swiglu = _sm100_only("dual_gemm_swiglu")
dual_gemm_swiglu_fp8 = _sm100_only("dual_gemm_swiglu_fp8")
