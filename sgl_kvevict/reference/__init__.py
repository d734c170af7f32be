"""HF-transformers reference engine: prefill, compression with the project's policies, greedy decode.

The only package besides ``sgl_kvevict.checkpoints`` that imports transformers models; importing it prepares
transformers for this machine first (``sgl_kvevict.compat.prepare_transformers``).
"""

from sgl_kvevict.compat import prepare_transformers

prepare_transformers()

from sgl_kvevict.reference.engine import (  # noqa: E402  (transformers must be prepared first)
    GenerationResult,
    Prompt,
    ReferenceEngine,
    ReferenceSequence,
)
from sgl_kvevict.reference.schedule import Mode, PrefillStep, Schedule, Segment  # noqa: E402

__all__ = [
    "GenerationResult",
    "Mode",
    "PrefillStep",
    "Prompt",
    "ReferenceEngine",
    "ReferenceSequence",
    "Schedule",
    "Segment",
]
