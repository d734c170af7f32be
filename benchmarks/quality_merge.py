"""Merge quality runs that cover different context lengths or modes of one grid into one report.

A long grid is run as one process per length or mode (in parallel on a 2-core machine), each with
its own ``--out``; this puts their cells back into a single ``quality.json`` / ``.md`` / ``.png``:

    python -m benchmarks.quality_merge docs/results /tmp/q1k/quality.json /tmp/q2k/quality.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from benchmarks.quality import CellResult, GridConfig, SampleResult, write_outputs
from sgl_kvevict.reference import Mode

# Grid fields that must agree for the runs' cells to be comparable (lengths and modes may differ).
SHARED_GRID_FIELDS = ("model", "dtype", "policies", "budgets", "kinds", "samples", "seed", "max_new_tokens")


def load_cells(payload: dict) -> list[CellResult]:
    return [
        CellResult(**{**cell, "samples": tuple(SampleResult(**sample) for sample in cell["samples"])})
        for cell in payload["cells"]
    ]


def merged_meta(metas: Sequence[dict]) -> dict:
    first = metas[0]
    for meta in metas[1:]:
        differing = [name for name in SHARED_GRID_FIELDS if meta["grid"][name] != first["grid"][name]]
        if differing:
            raise SystemExit(f"runs differ in {', '.join(differing)}: only runs of one grid can be merged")
    lengths = sorted({length for meta in metas for length in meta["grid"]["lengths"]})
    modes = list(dict.fromkeys(mode for meta in metas for mode in meta["grid"]["modes"]))
    return {
        **first,
        "command": " ; ".join(meta["command"] for meta in metas),
        "grid": {**first["grid"], "lengths": lengths, "modes": modes},
        "mean_prompt_tokens": {k: v for meta in metas for k, v in meta["mean_prompt_tokens"].items()},
        "seconds": sum(meta["seconds"] for meta in metas),
        "date": max(meta["date"] for meta in metas),
        "cells_done": sum(meta["cells_done"] for meta in metas),
        # The merged grid's size: a run cut short after its share of the grid (one mode of two, say)
        # still counts its whole grid in its own cells_total.
        "cells_total": len(grid_config({**first["grid"], "lengths": lengths, "modes": modes}).cells()),
    }


def grid_config(grid: dict) -> GridConfig:
    """The ``GridConfig`` a report's ``meta["grid"]`` describes (JSON lists back to tuples)."""
    return GridConfig(
        **{
            **grid,
            **{name: tuple(grid[name]) for name in ("policies", "budgets", "lengths", "kinds")},
            "modes": tuple(Mode(mode) for mode in grid["modes"]),
            "block_sizes": tuple(grid.get("block_sizes", (None,))),
        }
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the merged quality.json, quality.md, quality.png")
    parser.add_argument("runs", type=Path, nargs="+", help="quality.json files of the runs to merge")
    args = parser.parse_args(argv)
    payloads = [json.loads(path.read_text()) for path in args.runs]
    cells = [cell for payload in payloads for cell in load_cells(payload)]
    keys = [(cell.policy, cell.budget, cell.mode, cell.length, cell.block_size) for cell in cells]
    duplicated = sorted({key for key in keys if keys.count(key) > 1}, key=str)
    if duplicated:
        raise SystemExit(f"cells present in more than one run: {duplicated[:5]}")
    write_outputs(cells, merged_meta([payload["meta"] for payload in payloads]), args.out)
    print(f"merged {len(cells)} cells from {len(payloads)} runs into {args.out}")


if __name__ == "__main__":
    main()
