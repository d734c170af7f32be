"""A decode step's attention on CPU over K/V rows read in place (``paged_decode.cpp``), built on first use.

The torch path of a decode step gathers each sequence's keys into a padded copy and hands it to SDPA: the
keys are read twice and written once, and padding is attended as well. This C++ kernel reads each listed
row once, where it lies in the pool, and stops at each sequence's own end, so its cost follows the keys
kept. It is compiled with ``torch.utils.cpp_extension`` the first time a process asks for it (about 10 s on two cores;
``make setup`` does it once, and later processes load the cached build from ``TORCH_EXTENSIONS_DIR``,
``~/.cache/torch_extensions`` by default). The build is named by the vector ISA it targets
(``torch.backends.cpu.get_cpu_capability()``), so a cache shared by CPUs of different kinds never loads
code one of them cannot run. Where it cannot be built (no C++ compiler), ``paged_decode_available`` is
False, logs why once, and the caller keeps its torch path.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode.cpp")
# Instruction sets by ATen's own CPU capability names: the flags ATen compiles its kernels of that level with.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


@functools.cache
def paged_decode_available() -> bool:
    """Whether the kernel is built and loaded (``torch.ops.sgl_kvevict.paged_decode``): built here on the
    first call of a process where no cached build exists; False where it cannot be built."""
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-ffast-math", *_ISA_FLAGS.get(capability, [])]
    try:
        cpp_extension.load(
            name=f"sgl_kvevict_paged_decode_{capability.lower()}", sources=[str(_SOURCE)], extra_cflags=flags,
            is_python_module=False,
        )
        return True
    except Exception as error:  # no compiler, no ninja, a failed build: the torch path serves instead
        logger.warning("CPU paged decode kernel unavailable (%s); decode attends through padded SDPA", error)
        return False


def paged_decode(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor, ends: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """Each sequence's G query heads over its listed rows: ``q`` ``[S, G, D]`` (contiguous), ``k_rows``
    ``[rows, D]`` / ``v_rows`` ``[rows, D_v]`` (unit inner stride, any row stride, q's dtype: fp32, bf16 or
    fp16), ``rows`` int64 ``[S, W]`` (sequence ``s`` attends to ``rows[s, :ends[s]]``; the rest is not read),
    ``ends`` int64 ``[S]``. Returns ``[S, G, D_v]`` in q's dtype, accumulated in fp32 and rounded once; a
    sequence without keys gives 0. Only on CPU tensors, and only where ``paged_decode_available()``."""
    if not paged_decode_available():  # loads the build into this process on the first call
        raise RuntimeError("the CPU paged decode kernel could not be built (see the warning logged)")
    return torch.ops.sgl_kvevict.paged_decode(q, k_rows, v_rows, rows, ends, sm_scale)
