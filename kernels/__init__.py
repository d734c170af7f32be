"""Kernels of sgl-kvevict (import name ``sgl_kvevict.kernels``): Triton on CUDA, torch twins on CPU.

Importing this package imports triton; ``TRITON_INTERPRET=1`` must be set before that for the Triton
kernels to run on CPU (see ``runtime``).
"""

from sgl_kvevict.kernels.compaction import ArenaCellMap
from sgl_kvevict.kernels.dispatch import (
    copy_kv_rows,
    gather_kv_to_arena,
    merge_attention_states,
    scatter_arena_to_kv,
    segment_attention,
    window_stats_paged,
)
from sgl_kvevict.kernels.window_scores import CompressedCells

__all__ = [
    "ArenaCellMap",
    "CompressedCells",
    "copy_kv_rows",
    "gather_kv_to_arena",
    "merge_attention_states",
    "scatter_arena_to_kv",
    "segment_attention",
    "window_stats_paged",
]
