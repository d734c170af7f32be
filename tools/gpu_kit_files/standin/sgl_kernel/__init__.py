"""sgl-kvevict's GPU-kit stand-in for ``sgl_kernel`` (docs/gpu.md, "Run the server on a lent GPU").

The real sglang-kernel wheel is built for another torch than the lent GPU machine's and does not load
there, but SGLang imports these names from it at module import time. The smoke run's settings
(``SGLANG_FORCE_FUSED_OP_BACKEND=torch``, ``--sampling-backend pytorch``, ``--cuda-graph-backend-prefill
disabled``) keep a Llama forward from calling any of them; one called anyway raises, naming itself.
Only the submodules SGLang imports unguarded on CUDA exist (``utils``, ``quantization``, ``kvcacheio``):
every other one stays absent, so SGLang takes its ``ImportError`` fallbacks.
"""

from sgl_kvevict.compat.sgl_kernel_names import IMPORTED_NAMES

from sgl_kernel._unavailable import unavailable_functions

__sgl_kvevict_standin__ = True  # the marker sgl_kvevict.compat reads (STANDIN_MARKER)

globals().update(unavailable_functions("sgl_kernel", IMPORTED_NAMES))
