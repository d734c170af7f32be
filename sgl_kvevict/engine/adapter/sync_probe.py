"""A debug probe: host-synchronising tensor calls per forward, counted in the scheduler process.

On a GPU every ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool(tensor)``, ``.nonzero()`` and
``torch.tensor(python_list)`` is a device-host round trip (or an upload) that stalls the launch queue.
With ``KVEVICT_SYNC_PROBE=<file>`` set, ``install`` (called by the plugin in every SGLang process, so
stock servers are measured the same way) counts those calls made in the scheduler process and writes
``{"decode": {"forwards": n, "calls": c}, "extend": {...}}`` to the file after every forward. Calls are
attributed to the forward whose interval they fall in (from its start to the next forward's start), so
the scheduler's own work around a forward counts too, for stock and plugin alike.

The test suite reads it (``tests/test_engine_sync.py``) to hold the compressed decode path to stock's
count, whatever the number of layers. CPU tensors never really synchronise; the count is what a GPU
run would pay.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

PROBE_ENV = "KVEVICT_SYNC_PROBE"
SYNCING_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "nonzero")


class SyncProbe:
    def __init__(self, path: Path):
        self.path = path
        self.calls = 0
        self.mode: str | None = None
        self.totals = {"decode": {"forwards": 0, "calls": 0}, "extend": {"forwards": 0, "calls": 0}}

    def counted(self, function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            self.calls += 1
            return function(*args, **kwargs)

        return wrapper

    def forward_started(self, is_decode: bool) -> None:
        """Close the previous forward's interval, open this one's, and publish the totals."""
        if self.mode is not None:
            self.totals[self.mode]["calls"] += self.calls
        self.mode = "decode" if is_decode else "extend"
        self.totals[self.mode]["forwards"] += 1
        self.calls = 0
        self.path.write_text(json.dumps(self.totals))


def install() -> None:
    """Count syncing calls in this process if ``KVEVICT_SYNC_PROBE`` names a file (the scheduler only)."""
    target = os.environ.get(PROBE_ENV)
    if not target or getattr(torch.Tensor, "_kvevict_probed", False):
        return
    from sglang.srt.model_executor.model_runner import ModelRunner

    probe = SyncProbe(Path(target))
    for name in SYNCING_METHODS:
        setattr(torch.Tensor, name, probe.counted(getattr(torch.Tensor, name)))
    stock_tensor = torch.tensor

    @functools.wraps(stock_tensor)
    def tensor(data, *args, **kwargs):
        if isinstance(data, (list, tuple)):
            probe.calls += 1
        return stock_tensor(data, *args, **kwargs)

    torch.tensor = tensor
    stock_forward = ModelRunner.forward

    @functools.wraps(stock_forward)
    def forward(runner, forward_batch, *args, **kwargs):
        probe.forward_started(forward_batch.forward_mode.is_decode())
        return stock_forward(runner, forward_batch, *args, **kwargs)

    ModelRunner.forward = forward
    torch.Tensor._kvevict_probed = True
