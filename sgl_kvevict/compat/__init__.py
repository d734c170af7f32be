"""CPU development mode: what SGLang 0.5.23 and transformers need to start on a machine without CUDA.

This is a development and test mode, not a deployment target. ``activate_cpu_mode()`` does four
things, each only when the real part is absent, so it never shadows a real installation:

* a stand-in ``sgl_kernel`` module (no CPU build of it exists on PyPI). It provides every name
  SGLang imports from it (``sgl_kernel_names.IMPORTED_NAMES``): a torch implementation for the ones
  a CPU path really calls, and otherwise a function that raises a clear error naming itself;
* the ``torchvision::nms`` / ``torchvision::qnms`` op schemas, so the CUDA-linked torchvision wheel
  (a hard import of SGLang and of transformers) imports on CPU torch;
* ``SGLANG_USE_CPU_ENGINE=1``, which makes SGLang pick its CPU platform;
* one start-up line naming the SGLang model modules it cannot import here, instead of one warning
  each (``skipped_models``).

Call it before importing sglang or transformers models. Processes SGLang spawns re-import the
launcher module, which calls it at import time, so they are covered too.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types

import torch

from sgl_kvevict.compat.sgl_kernel_names import IMPORTED_NAMES
from sgl_kvevict.compat.skipped_models import summarise_skipped_model_modules

STANDIN_MARKER = "__sgl_kvevict_standin__"


def has_real_sgl_kernel() -> bool:
    module = sys.modules.get("sgl_kernel")
    if module is not None:
        return not getattr(module, STANDIN_MARKER, False)
    return importlib.util.find_spec("sgl_kernel") is not None


def cpu_mode_needed() -> bool:
    """True on a machine with no CUDA device and no real ``sgl_kernel``."""
    return not torch.cuda.is_available() and not has_real_sgl_kernel()


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """``req_to_token[row_i, start_i:end_i] = out_cache_loc[concatenated segment i]`` (sgl_kernel contract)."""
    consumed = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[row, start:end] = out_cache_loc[consumed : consumed + end - start]
        consumed += end - start


TORCH_IMPLEMENTATIONS = {"assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu}


def _unavailable(name: str):
    def raise_unavailable(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is sgl-kvevict's CPU development mode: no real "
            f"sgl_kernel is installed and this function has no torch implementation. Use the torch_native "
            f"attention backend on CPU, or install sglang with CUDA (pip install 'sgl-kvevict[gpu]')."
        )

    raise_unavailable.__name__ = name
    raise_unavailable.__qualname__ = f"sgl_kernel.{name}"
    return raise_unavailable


def install_sgl_kernel_standin() -> None:
    """Register a ``sgl_kernel`` package in ``sys.modules`` that holds every name SGLang imports from it."""
    module = types.ModuleType("sgl_kernel", "sgl-kvevict CPU stand-in for sgl_kernel")
    # A package spec with an empty search path: importing any submodule raises ImportError, which
    # sends SGLang to its own fallbacks.
    module.__spec__ = importlib.machinery.ModuleSpec("sgl_kernel", loader=None, is_package=True)
    module.__path__ = []
    setattr(module, STANDIN_MARKER, True)
    for name in IMPORTED_NAMES:
        setattr(module, name, TORCH_IMPLEMENTATIONS.get(name) or _unavailable(name))
    sys.modules["sgl_kernel"] = module


def _torchvision_ops_loadable() -> bool:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return True  # no torchvision: nothing to patch
    for folder in spec.submodule_search_locations:
        for filename in os.listdir(folder):
            if filename.startswith("_C.") and filename.endswith((".so", ".pyd")):
                try:
                    torch.ops.load_library(os.path.join(folder, filename))
                    return True
                except (OSError, RuntimeError):
                    return False
    return False


_torchvision_library = None


def register_torchvision_op_schemas() -> None:
    """Define the two op schemas torchvision's fake registrations need when its C ops cannot load."""
    global _torchvision_library
    # Looked up first: finding torchvision runs ``sgl_kvevict.torchvision_hook`` where it is installed,
    # which registers the schemas itself (a nested call) before this one goes on.
    if _torchvision_ops_loadable() or _torchvision_library is not None:
        return
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold, float scale, int zero_point) -> Tensor")
    _torchvision_library = library  # the schemas live as long as this object


def activate_cpu_mode() -> bool:
    """Enable the CPU development mode if this machine needs it; returns whether it is active."""
    if not cpu_mode_needed():
        return False
    install_sgl_kernel_standin()
    register_torchvision_op_schemas()
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    summarise_skipped_model_modules()
    return True


def prepare_transformers() -> None:
    """What importing transformers models needs here (the torchvision schemas), without SGLang's mode."""
    if not torch.cuda.is_available():
        register_torchvision_op_schemas()
