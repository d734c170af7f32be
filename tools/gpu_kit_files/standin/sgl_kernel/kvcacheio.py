"""``sgl_kernel.kvcacheio``: the names SGLang imports from it unguarded on CUDA, each raising if called."""

from sgl_kvevict.compat.sgl_kernel_names import CUDA_SUBMODULE_NAMES

from sgl_kernel._unavailable import unavailable_functions

globals().update(unavailable_functions("sgl_kernel.kvcacheio", CUDA_SUBMODULE_NAMES["kvcacheio"]))
