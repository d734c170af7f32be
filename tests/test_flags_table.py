"""The flag table of docs/flags.md is generated from the launcher's parser, and docs/flags.md carries
the current one."""

from __future__ import annotations

from pathlib import Path

import pytest

from sgl_kvevict.limits import LIMITS
from sgl_kvevict.server.flags import build_parser
from sgl_kvevict.server.flags_table import SECTION, main, render, split_help

FLAGS_DOC = Path(__file__).resolve().parent.parent / "docs" / "flags.md"


def test_every_flag_of_ours_has_a_row_with_its_default_and_every_limit_is_listed():
    table = render()
    for action in build_parser()._actions:
        if action.option_strings and action.option_strings[0] != "-h":
            meaning, default = split_help(action)
            assert f"| `{action.option_strings[0]}" in table and meaning and default
    assert "| `--kv-evict-window VALUE` | 32 for " in table  # a per-policy default, from the policy classes
    assert "| `--workers N` | 1: no router |" in table
    for limit in LIMITS:
        for flag in limit.flags:
            assert flag.condition() in table


def test_write_replaces_the_section_and_check_sees_a_stale_one(tmp_path, capsys):
    readme = tmp_path / "flags.md"
    readme.write_text(f"# title\n\n{SECTION.begin}\nold table\n{SECTION.end}\n\nafter\n")
    assert main(["--check", str(readme)]) == 1
    assert "stale" in capsys.readouterr().out
    assert main(["--write", str(readme)]) == 0
    assert readme.read_text() == f"# title\n\n{SECTION.fresh()}\n\nafter\n"
    assert main(["--check", str(readme)]) == 0
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="no generated flags section"):
        main(["--check", str(readme)])


def test_the_documented_flags_section_is_current():
    assert SECTION.of(FLAGS_DOC.read_text()) == SECTION.fresh(), "run python -m sgl_kvevict.server.flags_table --write docs/flags.md"
