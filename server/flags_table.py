"""The table of the launcher's flags in docs/flags.md, generated from the parser (``flags.build_parser``),
the settings' metadata and ``sgl_kvevict.limits``, so the documentation never retypes a flag, a default
or a refused feature.

    python -m sgl_kvevict.server.flags_table                 # print the section
    python -m sgl_kvevict.server.flags_table --write docs/flags.md  # replace it between the markers
    python -m sgl_kvevict.server.flags_table --check docs/flags.md  # exit 1 if it is stale

(``sgl_kvevict.generated_section``: the markers and the command.)
"""

from __future__ import annotations

import argparse
import re
import sys

from sgl_kvevict.generated_section import GeneratedSection
from sgl_kvevict.generated_section import main as section_main
from sgl_kvevict.server.flags import build_parser, launcher_notes

# Every help text of ours ends with its default (a test holds the parser to it).
DEFAULT_SUFFIX = re.compile(r"^(?P<help>.*) \(default (?P<default>.*)\)$", re.DOTALL)


def split_help(action: argparse.Action) -> tuple[str, str]:
    """(what it does, its default) of one flag; required flags have no default."""
    text = action.help.replace("%%", "%")
    if action.required:
        return text, "required"
    match = DEFAULT_SUFFIX.match(text)
    if match is None:
        raise ValueError(f"help of {action.option_strings[0]} does not end with '(default ...)'")
    return match["help"], match["default"]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    rows = ["| flag | default | what it does |", "| --- | --- | --- |"]
    for action in build_parser()._actions:
        if not action.option_strings or action.option_strings[0] == "-h":
            continue
        meaning, default = split_help(action)
        flag = action.option_strings[0] + (f" {action.metavar}" if action.metavar else "")
        rows.append(f"| `{flag}` | {_cell(default)} | {_cell(meaning)} |")
    notes = [f"* {note}" for note in launcher_notes()]
    return "\n".join([*rows, "", *notes])


SECTION = GeneratedSection("flags", "python -m sgl_kvevict.server.flags_table", render)


def main(argv: list[str]) -> int:
    return section_main([SECTION], argv, __doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
