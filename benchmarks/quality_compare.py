"""Compare two quality runs sample by sample: is a rerun the same run?

    python -m benchmarks.quality_compare /tmp/run-a/quality.json /tmp/run-b/quality.json

For every cell present in both, prints the accuracies and the samples whose greedy output differs,
and the numerics of both runs where they differ (``benchmarks/numerics.py``). Exits 0 when every
common sample has the same output, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from benchmarks.quality_report import load_report


def compare(a: dict, b: dict) -> tuple[list[str], int]:
    """Report lines and the number of common samples whose outputs differ."""
    (cells_a, meta_a), (cells_b, meta_b) = load_report(a), load_report(b)
    lines, differing = [], 0
    numerics_a, numerics_b = meta_a.get("numerics", {}), meta_b.get("numerics", {})
    for name in sorted(set(numerics_a) | set(numerics_b)):
        if numerics_a.get(name) != numerics_b.get(name):
            lines.append(f"numerics differ in {name}: {numerics_a.get(name)!r} vs {numerics_b.get(name)!r}")
    by_key = {cell.key: cell for cell in cells_b}
    for cell in cells_a:
        other = by_key.get(cell.key)
        if other is None:
            continue
        pairs = list(zip(cell.samples, other.samples))
        changed = [i for i, (x, y) in enumerate(pairs) if x.output != y.output]
        differing += len(changed)
        right_a, right_b = (sum(x.correct for x, _ in pairs), sum(y.correct for _, y in pairs))
        lines.append(
            f"{cell.key.label():<28} L={cell.key.length:<5} {cell.key.mode:<14} correct {right_a}/{len(pairs)} vs "
            f"{right_b}/{len(pairs)}; outputs differ in {len(changed)} of {len(pairs)} samples"
            + (f": {changed}" if changed else "")
        )
        for i in changed[:3]:
            lines.append(f"    sample {i}: {pairs[i][0].output!r} vs {pairs[i][1].output!r}")
    return lines, differing


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality_compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="quality.json of the first run")
    parser.add_argument("b", type=Path, help="quality.json of the second run")
    args = parser.parse_args(argv)
    lines, differing = compare(json.loads(args.a.read_text()), json.loads(args.b.read_text()))
    print("\n".join(lines))
    print("identical outputs in every common sample" if differing == 0 else f"{differing} samples differ")
    return 0 if differing == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
