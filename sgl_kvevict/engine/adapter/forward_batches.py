"""A KVzip reconstruction piece (``engine.reconstruction.PieceForward``) as SGLang's ``ForwardBatch``:
an EXTEND batch of one pseudo-request, run by the model runner between scheduler batches."""

from __future__ import annotations

from typing import Callable

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

from sgl_kvevict.engine.reconstruction import PieceForward


def piece_forward(model_runner) -> Callable[[PieceForward], None]:
    """Runs a piece through ``model_runner`` (its K/V written to the piece's slots, its attention
    captured by the backend's scoring jobs)."""

    def run(piece: PieceForward) -> None:
        model_runner.forward(forward_batch_of(piece))

    return run


def forward_batch_of(piece: PieceForward) -> ForwardBatch:
    device = piece.slots.device
    length = len(piece.input_ids)
    first = piece.first
    seq_len = first + length
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=1,
        input_ids=torch.tensor(piece.input_ids, dtype=torch.int64, device=device),
        req_pool_indices=torch.tensor([piece.row], dtype=torch.int64, device=device),
        seq_lens=torch.tensor([seq_len], dtype=torch.int64, device=device),
        seq_lens_cpu=torch.tensor([seq_len], dtype=torch.int64),
        orig_seq_lens=torch.tensor([seq_len], dtype=torch.int64, device=device),
        out_cache_loc=piece.slots,
        seq_lens_sum=seq_len,
        positions=torch.arange(first, seq_len, dtype=torch.int64, device=device),
        extend_num_tokens=length,
        extend_seq_lens=torch.tensor([length], dtype=torch.int32, device=device),
        extend_prefix_lens=torch.tensor([first], dtype=torch.int32, device=device),
        extend_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
        extend_prefix_lens_cpu=[first],
        extend_seq_lens_cpu=[length],
        extend_logprob_start_lens_cpu=[length],
        return_logprob=False,
        capture_hidden_mode=CaptureHiddenMode.NULL,
        rids=[piece.rid],
    )
