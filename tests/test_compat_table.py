"""The compatibility tables are generated from the matrix, and README.md and docs/compatibility.md carry
the current ones (what each row claims is tests/test_compat_matrix.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sgl_kvevict.server.compat_table import FULL, SHORT, rows

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("section, document", [(SHORT, "README.md"), (FULL, "docs/compatibility.md")])
def test_the_documents_carry_the_current_table(section, document):
    text = (ROOT / document).read_text()
    assert section.of(text) == section.fresh(), f"run python -m sgl_kvevict.server.compat_table --write {document}"


def test_every_architecture_has_one_row_with_its_verdict_and_every_refusal_its_reason():
    full, short = FULL.render(), SHORT.render()
    for row in rows():
        assert full.count(f"| {row.arch.title} | {row.arch.examples} |") == 1
        [line] = [line for line in short.split("\n") if line.endswith(f"| {row.verdict} |")]
        assert row.arch.title in line.split(" | ")[0].removeprefix("| ").split(", ")
        if row.limit is not None:
            assert f"* **{row.limit.name}**: {row.limit.reason}." in full


def test_compatibility_md_names_the_backends_sglang_runs_gemma_4_gpt_oss_and_exaone_4_on():
    from sgl_kvevict.architectures import SGLANG_ATTENTION_BACKENDS

    text = (ROOT / "docs/compatibility.md").read_text()
    for architecture in ("Gemma4ForCausalLM", "GptOssForCausalLM", "Exaone4ForCausalLM"):
        backends = SGLANG_ATTENTION_BACKENDS[architecture]
        assert ", ".join(f"`{backend}`" for backend in backends[:-1]) + f" or `{backends[-1]}`" in text, architecture
