"""``sgl_kernel.quantization``: the names SGLang imports from it unguarded on CUDA, each raising if called."""

from sgl_kvevict.compat.sgl_kernel_names import CUDA_SUBMODULE_NAMES

from sgl_kernel._unavailable import unavailable_functions

globals().update(unavailable_functions("sgl_kernel.quantization", CUDA_SUBMODULE_NAMES["quantization"]))
