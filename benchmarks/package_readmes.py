"""A folder of real markdown nobody here wrote, for ``python -m sgl_kvevict.evaluate --documents``: the long
descriptions (READMEs) of the packages installed in this environment, from their ``*.dist-info/METADATA``.

    python -m benchmarks.package_readmes OUT [--count 8] [--min-tokens 2000] [--max-tokens 4500]

Takes, in package-name order, the first ``--count`` whose README is ``--min-tokens`` to ``--max-tokens``
tokens long in the model's tokenizer, and writes each as ``OUT/<package>.md``. The same environment
gives the same folder (docs/benchmarks.md, "Before production").
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
from pathlib import Path

from sgl_kvevict.measure.chat import model_token_counter


# Ours is installed too, and we wrote it.
OWN_DISTRIBUTION = "sgl-kvevict"


def readmes() -> list[tuple[str, str]]:
    """``(package, README)`` of every installed distribution but ours with a markdown long description, by name."""
    found = {}
    for distribution in importlib.metadata.distributions():
        metadata = distribution.read_text("METADATA") or ""
        message = email.parser.Parser().parsestr(metadata)
        body = message.get_payload()
        # A folder's own egg-info (an editable install run from the clone) has no METADATA, so no name.
        if not message["Name"] or message["Name"].lower() == OWN_DISTRIBUTION:
            continue
        if "markdown" in (message.get("Description-Content-Type") or "") and isinstance(body, str) and body.strip():
            found.setdefault(message["Name"].lower(), body.strip())
    return sorted(found.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write (created)")
    parser.add_argument("--count", type=int, default=8, help="how many READMEs (default 8)")
    parser.add_argument("--min-tokens", type=int, default=2000, help="shortest README taken (default 2000)")
    parser.add_argument("--max-tokens", type=int, default=4500, help="longest README taken (default 4500)")
    parser.add_argument("--model", default="smollm2", help="whose tokenizer counts tokens (default smollm2)")
    args = parser.parse_args(argv)
    count_tokens = model_token_counter(args.model)
    chosen = [(name, text) for name, text in readmes() if args.min_tokens <= count_tokens(text) <= args.max_tokens]
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in chosen[: args.count]:
        (args.out / f"{name}.md").write_text(text + "\n")
        print(f"{name}: {count_tokens(text)} tokens")
    return 0 if chosen else 1


if __name__ == "__main__":
    raise SystemExit(main())
