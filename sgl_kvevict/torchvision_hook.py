"""Lets ``import torchvision`` succeed in every Python process of the CPU environment.

The PyPI torchvision wheel is CUDA-linked: beside the CPU build of torch its C ops do not load, and
the import stops with ``operator torchvision::nms does not exist``. SGLang and transformers import
torchvision, so a program that imports them without our launcher (SGLang's own tools, such as
``python -m sglang.benchmark.serving``) fails before it starts. ``make setup`` writes
``sgl_kvevict_torchvision_hook.pth`` into the environment's site-packages, which imports this module
at interpreter start-up. It adds a finder that, the first time anything looks for torchvision,
registers the op schemas torchvision needs (``sgl_kvevict.compat.register_torchvision_op_schemas``,
which does nothing where the ops load) and then steps aside. Nothing is imported at start-up: torch
only when torchvision is wanted.
"""

from __future__ import annotations

import importlib.abc
import sys


class _RegisterSchemasFirst(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)  # before the registration, which looks for torchvision itself
            from sgl_kvevict.compat import register_torchvision_op_schemas

            register_torchvision_op_schemas()
        return None  # the usual finders import it


if not any(isinstance(finder, _RegisterSchemasFirst) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterSchemasFirst())
