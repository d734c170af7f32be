"""Host-to-device copies that never make the host wait: staged in pinned memory, issued non-blocking.

CUDA copies from pageable host memory synchronise: the driver waits for the stream's earlier work
before it starts one. Under SGLang's overlap schedule the host prepares batch N + 1 while the device
runs batch N, so one such copy in that preparation waits for N and the overlap is lost. FlashInfer's
``plan`` avoids it (a pinned staging buffer, ``non_blocking=True``); the engine's own metadata does the
same through these two functions. Staging uses ``Tensor.pin_memory``, whose caching host allocator
keeps a block until the copies that read it have run, so a staged tensor may be dropped at once.

On CPU nothing is copied (and pinning needs CUDA): ``stages_in_pinned_memory`` is the one place that
decides, and the tests drive it.

Torch only: nothing here imports SGLang.
"""

from __future__ import annotations

import torch


def stages_in_pinned_memory(device: torch.device) -> bool:
    """Whether a host tensor bound for ``device`` is first copied to pinned memory: for a CUDA device,
    where a copy from pageable memory synchronises the stream."""
    return device.type == "cuda"


def _staged(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` as the source of a copy to ``device``: pinned when it is a host tensor bound for CUDA."""
    return tensor.pin_memory() if tensor.device.type == "cpu" and stages_in_pinned_memory(device) else tensor


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` (itself when it is there already), copied without making the host wait."""
    return _staged(tensor, device).to(device, non_blocking=True)


def write(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` in place, without making the host wait when ``source`` is on the host."""
    target.copy_(_staged(source, target.device), non_blocking=True)
