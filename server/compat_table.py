"""The compatibility tables, generated from the compatibility matrix: the full one in
docs/compatibility.md and the short one in README.md ("Does it fit my deployment?").

    python -m sgl_kvevict.server.compat_table                                   # print both
    python -m sgl_kvevict.server.compat_table --write README.md docs/compatibility.md
    python -m sgl_kvevict.server.compat_table --check README.md docs/compatibility.md

Each row is one architecture of ``checkpoints.COMPATIBILITY_MATRIX``; whether it is served or refused,
and why, is the launcher's own reading of its config.json (``architectures.model_facts`` against
``limits``), the same reading ``tests/test_compat_matrix.py`` holds to SGLang's and to the real server:
the tables never claim what that test does not check.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

from sgl_kvevict.architectures import local_layers_of_config, model_facts
from sgl_kvevict.checkpoints import COMPATIBILITY_MATRIX, TinyArchitecture
from sgl_kvevict.generated_section import GeneratedSection
from sgl_kvevict.generated_section import main as section_main
from sgl_kvevict.limits import LIMITS, Limit, SetupFacts

COMMAND = "python -m sgl_kvevict.server.compat_table"
SERVED = "served"


class Row:
    """One architecture as the launcher reads its tiny version's config.json."""

    def __init__(self, arch: TinyArchitecture):
        config = arch.config()
        saved = json.loads(config.to_json_string())  # what save_pretrained writes as config.json
        facts = model_facts(saved)
        self.arch = arch
        self.model_type = config.model_type
        self.limit: Optional[Limit] = next(
            (limit for limit in LIMITS if limit.violated is not None and limit.violated(SetupFacts(**facts))), None
        )
        if facts["mla_model"]:
            self.kv_layout = "one latent per token for every head (MLA)"
        elif facts["state_space_layers"]:
            self.kv_layout = "attention layers + linear-attention state"
        elif facts["sliding_window_layers"]:
            self.kv_layout = "global + sliding-window layers"
        elif local_layers_of_config(saved) is not None:
            self.kv_layout = "global + sliding-window layers, one pool (local layers kept to their window)"
        else:
            groups = config.num_attention_heads // config.num_key_value_heads
            self.kv_layout = f"K and V per KV head, one pool (GQA, {groups} query heads per KV head)"

    @property
    def verdict(self) -> str:
        return SERVED if self.limit is None else f"refused: {self.limit.name}"


def rows() -> list[Row]:
    return [Row(arch) for arch in COMPATIBILITY_MATRIX]


def render_full() -> str:
    lines = [
        "| architecture | e.g. | `model_type` | KV cache | head dim tested | with a `--kv-evict-policy` |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    refusals: dict[str, str] = {}
    for row in rows():
        arch = row.arch
        head_dim = arch.head_dim if row.limit is None else "-"
        lines.append(f"| {arch.title} | {arch.examples} | `{row.model_type}` | {row.kv_layout} | {head_dim} | {row.verdict} |")
        if row.limit is not None:
            refusals[row.limit.name] = row.limit.reason
    lines += ["", "Why each refusal (the launcher's line, from `sgl_kvevict/limits.py`):", ""]
    lines += [f"* **{name}**: {reason}." for name, reason in refusals.items()]
    return "\n".join(lines)


def render_short() -> str:
    """One row per verdict, its architectures in the matrix's order (the checkpoints they stand for are
    the full table's: README.md has room for no more)."""
    by_verdict: dict[str, list[str]] = {}
    for row in rows():
        by_verdict.setdefault(row.verdict, []).append(row.arch.title)
    lines = ["| architecture | with a `--kv-evict-policy` |", "| --- | --- |"]
    lines += [f"| {', '.join(titles)} | {verdict} |" for verdict, titles in by_verdict.items()]
    return "\n".join(lines)


FULL = GeneratedSection("compatibility", COMMAND, render_full)
SHORT = GeneratedSection("compatibility summary", COMMAND, render_short)


def main(argv: list[str]) -> int:
    return section_main([FULL, SHORT], argv, __doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
