"""Merge quality runs that cover different context lengths or modes of one grid into one report.

A long grid is run as one process per length or mode (in parallel on a 2-core machine), each with
its own ``--out``; this puts their cells back into a single ``quality.json`` / ``.md`` / ``.png``:

    python -m benchmarks.quality_merge docs/results /tmp/q1k/quality.json /tmp/q2k/quality.json

Runs are merged only when they are of one grid (same policies, budgets, samples, ...) and were computed
with the same arithmetic (the same numerics probe, ``benchmarks/numerics.py``): cells of two machines
whose kernels differ would not be comparable.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from benchmarks.quality import GridConfig
from benchmarks.quality_report import load_report, write_outputs
from sgl_kvevict.reference import Mode

# Grid fields that must agree for the runs' cells to be comparable (lengths and modes may differ).
SHARED_GRID_FIELDS = ("model", "dtype", "policies", "budgets", "kinds", "samples", "seed", "max_new_tokens")


class MergeError(ValueError):
    """Runs that cannot be merged; the message says why."""


def merged_meta(metas: Sequence[dict]) -> dict:
    first = metas[0]
    for meta in metas[1:]:
        differing = [name for name in SHARED_GRID_FIELDS if meta["grid"][name] != first["grid"][name]]
        if differing:
            raise MergeError(f"runs differ in {', '.join(differing)}: only runs of one grid can be merged")
        probes = {m.get("numerics", {}).get("probe_sha256") for m in (first, meta)}
        if len(probes) > 1:
            raise MergeError(
                f"runs differ in their numerics probe ({', '.join(map(str, sorted(probes, key=str)))}): they ran on "
                "different CPU kernels and their answers are not comparable"
            )
    lengths = sorted({length for meta in metas for length in meta["grid"]["lengths"]})
    modes = list(dict.fromkeys(mode for meta in metas for mode in meta["grid"]["modes"]))
    grid = {**first["grid"], "lengths": lengths, "modes": modes}
    return {
        **first,
        "command": " ; ".join(meta["command"] for meta in metas),
        "grid": grid,
        "mean_prompt_tokens": {k: v for meta in metas for k, v in meta["mean_prompt_tokens"].items()},
        "seconds": sum(meta["seconds"] for meta in metas),
        "date": max(meta["date"] for meta in metas),
        "cells_done": sum(meta["cells_done"] for meta in metas),
        # The merged grid's size: a run cut short after its share of the grid (one mode of two, say)
        # still counts its whole grid in its own cells_total.
        "cells_total": len(grid_config(grid).cells()),
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


def merge(payloads: Sequence[dict]) -> tuple[list, dict]:
    runs = [load_report(payload) for payload in payloads]
    cells = [cell for run_cells, _ in runs for cell in run_cells]
    keys = [cell.key for cell in cells]
    duplicated = sorted({key for key in keys if keys.count(key) > 1}, key=str)
    if duplicated:
        raise MergeError(f"cells present in more than one run: {[k.label() for k in duplicated[:5]]}")
    return cells, merged_meta([meta for _, meta in runs])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality_merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the merged quality.json, quality.md, quality.png")
    parser.add_argument("runs", type=Path, nargs="+", help="quality.json files of the runs to merge")
    args = parser.parse_args(argv)
    try:
        cells, meta = merge([json.loads(path.read_text()) for path in args.runs])
    except MergeError as error:
        parser.error(str(error))
    write_outputs(cells, meta, args.out)
    print(f"merged {len(cells)} cells from {len(args.runs)} runs into {args.out}")


if __name__ == "__main__":
    main()
