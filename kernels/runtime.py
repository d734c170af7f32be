"""Where the kernels of this package run: compiled Triton on CUDA, the Triton interpreter on CPU.

Triton decides between compiling a kernel and interpreting it when ``@triton.jit`` runs, by reading
``TRITON_INTERPRET``. Its own standard library (``tl.sum``, ``tl.max``, ...) is decorated when
``triton.language`` is first imported, so the variable only takes effect if it is set before the
first ``import triton`` of the process; setting it later yields kernels that can run nowhere. This
module is imported before any kernel here is decorated and records which mode the process is in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

TRITON_INTERPRETED: bool = isinstance(tl.sum, InterpretedFunction)
"""True when every Triton kernel of this process runs in the interpreter (CPU tensors allowed)."""

if triton.knobs.runtime.interpret != TRITON_INTERPRETED:
    raise ImportError(
        "TRITON_INTERPRET changed after triton was imported: Triton's standard library and the kernels of "
        "sgl_kvevict would run in different modes. Set it before the first `import triton` of the process."
    )


def use_triton(device: torch.device) -> bool:
    """Triton on CUDA; on CPU only in interpreter mode (tests), the torch twins otherwise."""
    return device.type == "cuda" or TRITON_INTERPRETED


def dot_block(size: int) -> int:
    """Block extent for a ``tl.dot`` operand dimension: a power of two, at least 16 (the MMA minimum)."""
    return max(16, triton.next_power_of_2(size))


def upcast_dot_operands(dtype: torch.dtype) -> bool:
    """Whether ``dot`` must cast bf16 operands to fp32 (the ``UPCAST`` flag of the kernels here).

    Triton 3.9's interpreter multiplies bf16 tiles as their raw uint16 storage (``create_dot`` runs
    ``np.matmul`` on the bit patterns), so interpreted kernels upcast them first. The products of
    bf16 numbers are exact in fp32 either way, so both variants compute the same sums.
    """
    return TRITON_INTERPRETED and dtype == torch.bfloat16


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32; fp32 operands are multiplied in IEEE fp32, never rounded to TF32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        result = tl.dot(a, b, input_precision="ieee")
    else:
        result = tl.dot(a, b)
    return result


@triton.jit
def split_range(split, num_splits, begin, end, BLOCK_N: tl.constexpr):
    """Entries ``[lo, hi)`` of ``[begin, end)`` that split ``split`` of ``num_splits`` handles.

    Splits take ``ceil(ceil(n / num_splits) / BLOCK_N)`` whole blocks each, so only a split's last block
    is partial; trailing splits may be empty (``lo >= hi``: a ``range(lo, hi, BLOCK_N)`` loop does nothing).
    Computed per program from device-resident bounds, so each sequence or KV head is split by its own
    length and the grid needs only ``num_splits`` from the host.
    """
    per_split = tl.cdiv(tl.cdiv(end - begin, num_splits), BLOCK_N) * BLOCK_N
    lo = begin + split * per_split
    return lo, tl.minimum(lo + per_split, end)
