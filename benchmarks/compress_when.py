"""When to compress: after the prefill or under pressure, from the runs that measured both.

    python -m benchmarks.compress_when            # writes docs/results/compress_when.md
    python -m benchmarks.compress_when --check    # exit 1 if the committed page is stale

Reads two results of the same lineup (stock, ``full``, a policy compressing at prefill and the same
policy under ``--kv-evict-when pressure``, all in block scope at equal ``--max-total-tokens``):
``sweep_pressure.json`` (``benchmarks.multiturn sweep --when prefill,pressure``: every history fits, half,
a quarter) and ``sglang_client_pressure.json`` (``benchmarks.sglang_client --when prefill,pressure``), and
``sglang_client_pressure_roomy.json`` when it exists (the same client in a pool that holds it all). Per
pool and server: output tok/s, the pressure server against the prefill one, hit rate, nodes compressed
under pressure (``/kvevict/stats``), and, for the multi-turn runs, answers: fact questions right and the
replies identical to stock's and to ``full``'s (same user and turn; later turns carry each server's own
earlier answers, so a changed reply may change the next).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.local_layers import differing_replies

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
NAME = "compress_when"
PRESSURE_TAG = "pressure"


def _pressure_pair(labels: Sequence[str]) -> tuple[str, str]:
    """The labels of the policy server under pressure and of the same server at prefill."""
    pressure = next(label for label in labels if label.endswith(f" {PRESSURE_TAG}"))
    return pressure, pressure.removesuffix(f" {PRESSURE_TAG}")


def _ratio(value: Optional[float], base: Optional[float]) -> str:
    return "-" if not value or not base else f"x{value / base:.2f}"


def _same_replies(records: list[dict], reference: list[dict]) -> tuple[int, int]:
    """Replies of ``records`` identical to ``reference``'s for the same user and turn, of those both have."""
    both, differing = differing_replies(records, reference)
    return len(both) - len(differing), len(both)


def _under_pressure(stats: Optional[dict]) -> str:
    """Cold nodes compressed when SGLang asked for room / segments compressed at their checkpoint meanwhile /
    prompts admitted by their compressed size."""
    last = (stats or {}).get("last") or {}
    if "nodes_compressed_under_pressure" not in last:
        return "-"
    counts = (last["nodes_compressed_under_pressure"], last.get("compressed_at_checkpoint_under_pressure", 0),
              last.get("prompts_admitted_compressed", "-"))  # fmt: skip
    return " / ".join(map(str, counts))


def sweep_table(report: dict) -> list[str]:
    runs = [run for run in report["runs"] if not run["error"]]
    pressure, prefill = _pressure_pair(report["meta"]["variants"])
    lines = [
        "| pool | server | output tok/s | vs prefill | hit rate | facts right | replies as stock's | replies as `full`'s | "
        "compressed under pressure: cold / at checkpoint / admitted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for pool in report["meta"]["pools"]:
        here = {run["label"]: run for run in runs if run["pool"] == pool["name"]}
        stock, full = here.get("vanilla"), next((r for label, r in here.items() if label.startswith("full")), None)
        base = here.get(prefill)
        for label, run in here.items():
            m = run["metrics"]
            as_stock = "-" if stock is None or run is stock else "{}/{}".format(*_same_replies(run["records"], stock["records"]))
            as_full = "-" if full is None or run is full or run is stock else "{}/{}".format(*_same_replies(run["records"], full["records"]))
            versus = _ratio(m["output_tokens_per_second"], base and base["metrics"]["output_tokens_per_second"]) if label == pressure else "-"
            lines.append(
                f"| {pool['name']} ({pool['tokens']}) | {label} | {m['output_tokens_per_second']:.2f} | {versus} | "
                f"{m['hit_rate']:.2f} | {m['fact_correct']}/{m['fact_questions']} | {as_stock} | {as_full} | "
                f"{_under_pressure(run.get('kvevict_stats'))} |"
            )
    return lines


def client_table(report: dict) -> list[str]:
    runs = [run for run in report["runs"] if not run["error"]]
    pressure, prefill = _pressure_pair([run["label"] for run in runs])
    by_label = {run["label"]: run for run in runs}
    lines = [
        "| server | output tok/s | vs prefill | TTFT median (s) | ITL mean (ms) | hit rate | compressed under pressure: cold / at checkpoint / admitted |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        c = run["client"]
        base = by_label.get(prefill)
        versus = _ratio(c["output_throughput"], base and base["client"]["output_throughput"]) if run["label"] == pressure else "-"
        lines.append(
            f"| {run['label']} | {c['output_throughput']:.2f} | {versus} | {c['median_ttft_ms'] / 1000:.2f} | "
            f"{c['mean_itl_ms']:.1f} | {run['cache_report']['cache_hit_rate_pct'] / 100:.2f} | "
            f"{_under_pressure(run.get('kvevict_stats'))} |"
        )
    return lines



def render(results: Path = RESULTS) -> str:
    sweep = json.loads((results / "sweep_pressure.json").read_text())
    client = json.loads((results / "sglang_client_pressure.json").read_text())
    roomy_path = results / "sglang_client_pressure_roomy.json"
    lines = [
        "# When to compress: after the prefill or under pressure",
        "",
        "> What does `--kv-evict-when pressure` cost or save against compressing every prompt after its prefill?",
        "",
        "Generated by `python -m benchmarks.compress_when` from the runs below; the policy is the default "
        "(topk, learned score, 25% kept, 512-token blocks), each run's servers one at a time at equal "
        "`--max-total-tokens` on one machine. Choosing from it: [choosing.md](../choosing.md#when-to-compress-after-the-prefill-or-under-pressure).",
        "",
        f"## Multi-turn chats: 6 users x 4 turns over their own documents ([sweep_pressure.md](sweep_pressure.md))",
        "",
        f"`{sweep['meta']['command']}`",
        "",
        *sweep_table(sweep),
        "",
        f"## SGLang's own client, `generated-shared-prefix`, pool {client['meta']['pool_tokens']} "
        "([sglang_client_pressure.md](sglang_client_pressure.md))",
        "",
        f"`{client['meta']['command']}`",
        "",
        *client_table(client),
    ]
    if roomy_path.exists():
        roomy = json.loads(roomy_path.read_text())
        lines += [
            "",
            f"## The same client in a pool of {roomy['meta']['pool_tokens']} ([sglang_client_pressure_roomy.md]"
            "(sglang_client_pressure_roomy.md))",
            "",
            f"`{roomy['meta']['command']}`",
            "",
            *client_table(roomy),
        ]
    lines += [
        "",
        "Replies as stock's: the replies (user, turn) equal, as text, to stock SGLang's in the same pool; "
        "later turns carry each server's own earlier answers. Compressed under pressure, at the end of the run "
        "(`/kvevict/stats`): cold prompts compressed in place when SGLang asked for room "
        "(`nodes_compressed_under_pressure`, released prompts included) / prompts compressed right after their prefill "
        "once SGLang had asked for room the pool did not have free (`compressed_at_checkpoint_under_pressure`) / "
        "prompts admitted by their compressed size while the pool was full (`prompts_admitted_compressed`; "
        "-: measured before it was counted). "
        "Machines are shared: compare within one run.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compress_when", description=__doc__.partition("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the results JSON (default docs/results)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed page differs from a fresh one")
    args = parser.parse_args(argv)
    text = render(args.results)
    path = args.results / f"{NAME}.md"
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is stale: run python -m benchmarks.compress_when", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
