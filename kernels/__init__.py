"""Kernels of sgl-kvevict (import name ``sgl_kvevict.kernels``): Triton on CUDA, torch twins on CPU.

Importing this package imports triton; ``TRITON_INTERPRET=1`` must be set before that for the Triton
kernels to run on CPU (see ``runtime``).
"""

from sgl_kvevict.kernels.dispatch import copy_kv_rows, merge_attention_states, segment_attention, window_stats_paged
from sgl_kvevict.kernels.segment_attention import MIN_CELLS_TO_SPLIT
from sgl_kvevict.kernels.window_scores import CompressedCells

__all__ = [
    "MIN_CELLS_TO_SPLIT",
    "CompressedCells",
    "copy_kv_rows",
    "merge_attention_states",
    "segment_attention",
    "window_stats_paged",
]
